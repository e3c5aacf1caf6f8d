"""The package's layers import one way: public ops -> family host code -> {jit (render, compile, resolve) -> store,
runtime}. This test reads every module's imports (module level and inside functions) and fails naming the
module and the import that breaks a rule."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "dsagen"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)   # `from pkg import module`
    return out


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PKG.rglob("*.py"))}


def _violations(importer_prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for mod, imps in _modules().items():
        if mod == importer_prefix or mod.startswith(importer_prefix + "."):
            for imp in sorted(imps):
                if any(imp == a or imp.startswith(a + ".") for a in allowed):
                    continue
                if any(imp == f or imp.startswith(f + ".") for f in forbidden):
                    bad.append(f"{mod} imports {imp}")
    return bad


def test_the_runtime_imports_no_compiler_template_store_or_op():
    # the arch table (capability -> arch name) is the one piece of the spec layer it reads
    assert not _violations("dsagen.runtime", ("dsagen.jit", "dsagen.store", "dsagen.ops", "dsagen.kernels",
                                              "dsagen.spec", "cutlass", "jinja2"),
                           allowed=("dsagen.spec.arch",))


def test_the_store_imports_no_compiler():
    assert not _violations("dsagen.store", ("dsagen.jit", "dsagen.ops", "dsagen.kernels", "dsagen.runtime",
                                            "dsagen.spec", "cutlass", "jinja2"))


def _host_modules() -> tuple[str, ...]:
    return tuple(m for m in _modules() if m.startswith("dsagen.kernels.") and m.endswith(".host"))


def test_the_compiler_layer_imports_no_op_or_host_code():
    assert not _violations("dsagen.jit", ("dsagen.ops",) + _host_modules())


def test_specs_import_no_host_code_and_no_torch():
    """A spec module (and the spec layer) stays importable where only specs are needed (a build machine's
    CLI, presets): no host code, no torch, no compiler."""
    bad = []
    for mod, imps in _modules().items():
        if mod.startswith("dsagen.spec") or (mod.startswith("dsagen.kernels.") and mod.endswith(".spec")):
            bad += [f"{mod} imports {i}" for i in sorted(imps)
                    if i in ("torch", "cutlass", "jinja2") or i.startswith(("torch.", "cutlass.", "dsagen.jit", "dsagen.ops"))
                    or any(i == h or i.startswith(h + ".") for h in _host_modules())]
    assert not bad


def test_every_family_holds_its_spec_kernels_and_host_code_in_one_folder():
    families = [p for p in (PKG / "kernels").iterdir() if p.is_dir() and (p / "__init__.py").exists()
                and p.name != "common"]                        # common/: the shared toolkit, no family
    assert families
    for fam in families:
        assert (fam / "spec.py").is_file(), fam.name
        assert any(fam.rglob("*.py.j2")), f"{fam.name} has no kernel module"


def test_nothing_but_the_package_root_imports_the_public_ops():
    bad = []
    for mod, imps in _modules().items():
        if mod in ("dsagen",) or mod.startswith("dsagen.ops"):
            continue
        bad += [f"{mod} imports {i}" for i in sorted(imps) if i == "dsagen.ops" or i.startswith("dsagen.ops.")]
    assert not bad


def test_the_command_line_executes_no_test_module():
    """It builds the GPU tests' kernels from a data file (tests/gpu/required_specs.json), never by importing them."""
    src = (PKG / "cli.py").read_text()
    for needle in ("exec_module", "spec_from_file_location", "REQUIRED_SPECS"):
        assert needle not in src, needle


def test_logging_and_version_are_leaves():
    """dsagen.log and dsagen._version are imported by every layer (store and runtime included), so they import no
    other dsagen module than the errors."""
    mods = _modules()
    for leaf in ("dsagen.log", "dsagen._version"):
        own = sorted(i for i in mods[leaf] if i.startswith("dsagen") and i not in ("dsagen.errors",)
                     and not i.startswith("dsagen.errors."))
        assert not own, f"{leaf} imports {own}"


def test_the_model_config_builds_specs_through_the_families_spec_modules_only():
    imps = _modules()["dsagen.spec.model_config"]
    kernels = sorted({i.rsplit(".", 1)[0] if i.count(".") > 3 else i for i in imps if i.startswith("dsagen.kernels.")})
    assert kernels and all(k.endswith(".spec") or k.split(".")[-2] == "spec" for k in kernels), kernels


def test_every_spec_module_imports_first_in_a_fresh_interpreter():
    """A family's spec.py (or the presets, or the model config) as the first dsagen import of a program: the spec
    layer loads every family while that module is half-initialised, so no family may import another's spec.py
    and the spec package may not re-export family names at import time."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    families = sorted(p.parent.name for p in (root / "dsagen" / "kernels").glob("*/spec.py"))
    modules = [f"dsagen.kernels.{f}.spec" for f in families] + ["dsagen.spec.presets", "dsagen.spec.model_config"]
    assert len(families) >= 6
    for m in modules:
        r = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=root, capture_output=True, text=True)
        assert r.returncode == 0, f"import {m} first fails:\n{r.stderr[-2000:]}"
