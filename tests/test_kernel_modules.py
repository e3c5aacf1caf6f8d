"""Kernel bodies are plain Python modules under dsagen/kernels/<family>/; a template only binds a spec's values to
one of them. The cache key and the identity change whenever such a module changes, and every rendered module
owns its kernel object."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from dsagen.jit import identity_of, key_material, key_of
from dsagen.jit.keys import identity_material
from dsagen.jit.render import KERNEL_LIB, render
from dsagen.spec import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec

TC = {"nvidia-cutlass-dsl": "4.8.1"}
#: families whose templates only bind a spec to a kernel module
BINDING_FAMILIES = ("indices", "testing")
#: (spec, the kernel module its rendered source imports, as a path under dsagen/kernels)
KERNEL_MODULES = [
    (CompactifySpec(arch="sm_90a"), "indices/compactify.py"),
    (LocalToGlobalSpec(arch="sm_90a"), "indices/local_to_global.py"),
    (RuntimeProbeSpec(arch="sm_90a", feature="tma"), "testing/runtime_probe.py"),
    (RuntimeProbeSpec(arch="sm_90a", feature="smem", smem_bytes=65536), "testing/runtime_probe.py"),
    (RuntimeProbeSpec(arch="sm_90a", feature="cluster"), "testing/runtime_probe.py"),
]


def _module_name(rel: str) -> str:
    return "dsagen.kernels." + rel.removesuffix(".py").replace("/", ".")


@pytest.mark.parametrize("family", BINDING_FAMILIES)
def test_templates_only_bind_a_spec_to_a_kernel_module(family):
    """At most 60 lines, no kernel code, and an import of a module of the family's folder."""
    templates = sorted((KERNEL_LIB / family).glob("*.py.j2"))
    assert templates
    for t in templates:
        text = t.read_text()
        assert len(text.splitlines()) <= 60, t.name
        for needle in ("@cute.kernel", "@cute.jit", "def "):
            assert needle not in text, (t.name, needle)
        module = t.name.removesuffix(".py.j2")
        assert f"from dsagen.kernels.{family}.{module} import build" in text, t.name
        assert (KERNEL_LIB / family / f"{module}.py").is_file(), t.name


@pytest.mark.parametrize("spec,rel", KERNEL_MODULES, ids=lambda v: v.name() if hasattr(v, "name") else v)
def test_key_and_identity_follow_the_kernel_module(spec, rel, monkeypatch, tmp_path):
    """Editing the kernel module a spec renders against changes its key and its identity; editing another
    family's kernel module changes neither."""
    import dsagen.jit.render as r

    source = render(spec)
    mod = _module_name(rel)
    assert mod in key_material(spec, source, TC)["helpers"]
    assert mod in identity_material(spec)["helpers"]
    key0, ident0 = key_of(key_material(spec, source, TC)), identity_of(spec)

    lib = tmp_path / "kernels"
    shutil.copytree(KERNEL_LIB, lib, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    monkeypatch.setattr(r, "TEMPLATES", lib)
    assert key_of(key_material(spec, source, TC)) == key0 and identity_of(spec) == ident0

    other = "testing/runtime_probe.py" if rel.startswith("indices/") else "indices/compactify.py"
    (lib / other).write_text((lib / other).read_text() + "# edited\n")
    assert key_of(key_material(spec, source, TC)) == key0 and identity_of(spec) == ident0

    (lib / rel).write_text((lib / rel).read_text() + "# edited\n")
    assert key_of(key_material(spec, source, TC)) != key0
    assert identity_of(spec) != ident0


def _load(source: str, path: Path, name: str):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(name, None)
    return mod


@pytest.mark.compile
def test_every_rendered_module_owns_its_kernel(tmp_path):
    """Two rendered modules, of different specs or of the same one, never share a kernel, host or declaration
    object, so naming one kernel (set_name_prefix) never renames another's."""
    specs = [CompactifySpec(arch="sm_90a", warps_per_cta=4), CompactifySpec(arch="sm_90a", warps_per_cta=4),
             CompactifySpec(arch="sm_90a"), RuntimeProbeSpec(arch="sm_90a", feature="cluster"),
             RuntimeProbeSpec(arch="sm_90a", feature="cluster")]
    mods = [_load(render(s), tmp_path / f"m{i}.py", f"_dsagen_test_module_{i}") for i, s in enumerate(specs)]
    for attr in ("kernel", "host", "PARAMS", "LAUNCH"):
        objs = [getattr(m, attr) for m in mods]
        assert len({id(o) for o in objs}) == len(objs), attr
    assert mods[0].LAUNCH["block"] == [128, 1, 1] and mods[2].LAUNCH["block"] == [256, 1, 1]
    assert hasattr(mods[3], "HOST_ARGS") is False
    tma = _load(render(RuntimeProbeSpec(arch="sm_90a", feature="tma")), tmp_path / "tma.py", "_dsagen_test_tma")
    assert [a["name"] for a in tma.HOST_ARGS][0] == "x" and tma.PARAMS[0]["kind"] == "tensormap"


@pytest.mark.compile
def test_specs_of_one_kernel_module_compile_side_by_side(tmp_path):
    """Kernels built from one module with different values, compiled in one process, each match their own
    declaration (the values are bound per build, not shared through the module)."""
    from dsagen.jit.build import compile_module

    blocks = []
    for i, spec in enumerate([CompactifySpec(arch="sm_90a", warps_per_cta=4), CompactifySpec(arch="sm_90a"),
                              LocalToGlobalSpec(arch="sm_90a", threads=128, items_per_thread=2),
                              LocalToGlobalSpec(arch="sm_90a")]):
        rec = compile_module(spec, render(spec), tmp_path / str(i)).record
        blocks.append(rec["launch"]["block"][0])
        assert rec["symbol"] == spec.symbol() + "_0"
    assert blocks == [128, 256, 128, 256]
