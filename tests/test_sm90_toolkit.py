"""The Hopper toolkit (dsagen/kernels/common/sm90/) is the one home of the building blocks every sm_90a family
uses: each family's kernel modules import the blocks from it (never another family's kernel module), every block
has a docstring of its contract, and editing a toolkit module changes the key and the identity of every spec whose
kernel imports it, directly or through another toolkit module, and of no other."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from dsagen.jit import identity_of, key_material, key_of
from dsagen.jit.keys import identity_material
from dsagen.jit.render import KERNEL_LIB, helper_modules, render
from dsagen.kernels.attn_score_recompute.spec import AttnScoreRecomputeSpec
from dsagen.kernels.indexer_bwd.spec import IndexerBwdSpec
from dsagen.kernels.indexer_score_recompute.spec import IndexerScoreRecomputeSpec
from dsagen.kernels.indices.spec import CompactifySpec
from dsagen.kernels.lightning_indexer.spec import IndexerScoreSpec, IndexerTopkSpec
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdSpec
from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdOrderSpec, SparseAttnBwdSpec

TC = {"nvidia-cutlass-dsl": "4.8.1"}
TOOLKIT = KERNEL_LIB / "common" / "sm90"
TOOLKIT_MODULES = sorted(p.stem for p in TOOLKIT.glob("*.py") if p.name != "__init__.py")
FAMILY_SPECS = [SparseAttnFwdSpec(arch="sm_90a"), SparseAttnBwdSpec(arch="sm_90a"), IndexerBwdSpec(arch="sm_90a"),
                AttnScoreRecomputeSpec(arch="sm_90a"), IndexerScoreRecomputeSpec(arch="sm_90a"),
                IndexerScoreSpec(arch="sm_90a"), IndexerTopkSpec(arch="sm_90a"), SparseAttnBwdOrderSpec(arch="sm_90a")]


def _imports(path: Path) -> set[str]:
    """The dsagen.kernels.* modules a file imports (absolute `from X import ...`)."""
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("dsagen.kernels.")}


def _kernel_modules() -> list[Path]:
    """Every hand-written device module of a family (not spec, host or package files)."""
    return sorted(p for p in KERNEL_LIB.glob("*/*.py")
                  if p.parent.name != "common" and p.name not in ("spec.py", "host.py", "__init__.py"))


@pytest.mark.parametrize("path", _kernel_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_family_modules_import_only_the_toolkit_and_their_own_family(path):
    family = path.parent.name
    for mod in _imports(path):
        parts = mod.split(".")
        assert parts[2] in ("common", "built", family), f"{path.name} imports {mod}, another family's module"


@pytest.mark.parametrize("module", TOOLKIT_MODULES)
def test_toolkit_modules_document_every_block(module):
    tree = ast.parse((TOOLKIT / f"{module}.py").read_text())
    assert ast.get_docstring(tree), f"{module}.py has no module docstring"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            assert ast.get_docstring(node), f"{module}.{node.name} has no docstring"
    for mod in _imports(TOOLKIT / f"{module}.py"):
        assert mod.startswith("dsagen.kernels.common.sm90."), f"{module}.py imports {mod} from outside the toolkit"


def test_every_sm90_family_is_built_from_the_toolkit():
    for spec in FAMILY_SPECS:
        helpers = helper_modules(render(spec))
        assert any(m.startswith("dsagen.kernels.common.sm90.") for m in helpers), spec.op


def _keys(specs, sources):
    return [(key_of(key_material(s, src, TC)), identity_of(s)) for s, src in zip(specs, sources)]


@pytest.mark.parametrize("module", TOOLKIT_MODULES)
def test_key_and_identity_follow_the_toolkit_modules(module, monkeypatch, tmp_path):
    """An edit of toolkit module M changes the key and identity of exactly the specs whose kernels import M,
    directly or transitively (gather imports ptx, layout and ring)."""
    import dsagen.jit.render as r

    specs = FAMILY_SPECS + [CompactifySpec(arch="sm_90a")]
    sources = [render(s) for s in specs]
    name = f"dsagen.kernels.common.sm90.{module}"
    users = [name in helper_modules(src) for src in sources]
    assert not users[-1]                                     # compactify uses no toolkit module
    for spec, src, uses in zip(specs, sources, users):
        assert (name in key_material(spec, src, TC)["helpers"]) == uses
        assert (name in identity_material(spec)["helpers"]) == uses
    before = _keys(specs, sources)

    lib = tmp_path / "kernels"
    shutil.copytree(KERNEL_LIB, lib, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    monkeypatch.setattr(r, "TEMPLATES", lib)
    path = lib / "common" / "sm90" / f"{module}.py"
    path.write_text(path.read_text() + "# edited\n")
    after = _keys(specs, sources)
    for (k, i), (k0, i0), uses in zip(after, before, users):
        assert (k != k0 and i != i0) if uses else (k == k0 and i == i0)
