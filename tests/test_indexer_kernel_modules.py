"""The lightning indexer's kernel bodies are plain Python modules (dsagen/kernels/lightning_indexer/*_sm90.py); its
templates only bind a spec's values to them. Editing a kernel module changes the cache key and the identity of every
spec that uses it, and every rendered module owns its kernel object."""

from __future__ import annotations

import re
import shutil

import pytest

from dsagen.jit import identity_of, key_material, key_of
from dsagen.jit.keys import identity_material
from dsagen.jit.render import KERNEL_LIB, render
from dsagen.kernels.lightning_indexer.spec import (TOPK_COMPACT_CAP, IndexerScoreSpec, IndexerScoresMaskSpec,
                                                   IndexerTopkSoftmaxSpec, IndexerTopkSpec, config_for,
                                                   forward_topk_config_for, scores_config_for)

TC = {"nvidia-cutlass-dsl": "4.8.1"}
FAMILY = KERNEL_LIB / "lightning_indexer"
SCORE = "dsagen.kernels.lightning_indexer.score_sm90"
TOPK = "dsagen.kernels.lightning_indexer.topk_sm90"
MASK = "dsagen.kernels.lightning_indexer.mask_lse_sm90"
SOFTMAX = "dsagen.kernels.lightning_indexer.topk_softmax_sm90"
COMMON = "dsagen.kernels.lightning_indexer.common_sm90"


def _specs():
    return [*config_for(64, 128, "bfloat16", "sm_90a").specs(), IndexerTopkSpec(arch="sm_90a", threads=512),
            IndexerScoreSpec(arch="sm_90a", num_heads=8, head_dim=64, dtype="float16", stages=2),
            *scores_config_for(64, 128, "bfloat16", "sm_90a").specs(),
            *forward_topk_config_for(64, 128, "bfloat16", "sm_90a").specs(),
            *forward_topk_config_for(64, 128, "bfloat16", "sm_90a", finish_in_topk=False).specs()]


def _own_modules(spec) -> set[str]:
    """The family's kernel modules a spec's template binds (and they import)."""
    if isinstance(spec, IndexerScoreSpec):
        return {SCORE}
    if isinstance(spec, IndexerTopkSoftmaxSpec):
        return {SOFTMAX}
    # the top-k kernels' finishing form shares the finishing kernel's row code (topk_softmax_sm90.finish_row)
    return {MASK} if isinstance(spec, IndexerScoresMaskSpec) else {TOPK, SOFTMAX}


def test_templates_only_bind_a_spec():
    """No kernel logic in jinja: no branches, loops, macros, includes or re-indented blocks, at most 60 lines."""
    templates = sorted(FAMILY.glob("*.py.j2"))
    assert [t.name for t in templates] == ["mask_lse_sm90.py.j2", "score_sm90.py.j2", "topk_sm90.py.j2",
                                           "topk_softmax_sm90.py.j2"]
    for t in templates:
        text = t.read_text()
        assert len(text.splitlines()) <= 60, t.name
        assert not re.search(r"{%-?\s*(if|for|macro|include|import|from|call)\b", text), t.name
        assert "| indent" not in text and "|indent" not in text, t.name


def test_rendered_modules_import_their_kernel_modules():
    """Key material and identity both name the kernel module and the shared device code (followed transitively)."""
    for spec in _specs():
        own = _own_modules(spec)
        helpers = key_material(spec, render(spec), TC)["helpers"]
        family = {m for m in helpers if not m.startswith("dsagen.kernels.common.sm90.") and m != "dsagen.kernels.built"}
        assert family == {*own, COMMON}, (spec.name(), helpers)
        assert "dsagen.kernels.common.sm90.reduce" in helpers or "dsagen.kernels.common.sm90.layout" in helpers
        assert identity_material(spec)["helpers"] == helpers


@pytest.mark.parametrize("module", ["score_sm90.py", "topk_sm90.py", "mask_lse_sm90.py", "topk_softmax_sm90.py",
                                    "common_sm90.py"])
def test_editing_a_kernel_module_changes_key_and_identity(module, monkeypatch, tmp_path):
    import dsagen.jit.render as r

    lib = tmp_path / "kernels"
    shutil.copytree(KERNEL_LIB, lib)
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    monkeypatch.setattr(r, "TEMPLATES", lib)
    name = f"dsagen.kernels.lightning_indexer.{module[:-3]}"
    specs = [s for s in _specs() if name in identity_material(s)["helpers"]]
    assert specs, module
    before = [(key_of(key_material(s, render(s), TC)), identity_of(s)) for s in specs]
    assert before == [(key_of(key_material(s, render(s), TC)), identity_of(s)) for s in specs]   # stable
    path = lib / "lightning_indexer" / module
    path.write_text(path.read_text() + "# changed\n")
    for spec, (key, ident) in zip(specs, before):
        assert key_of(key_material(spec, render(spec), TC)) != key, (module, spec.name())
        assert identity_of(spec) != ident, (module, spec.name())


def test_every_build_makes_its_own_kernel():
    """Two rendered modules never share a kernel function object (each names it with its own SYMBOL)."""
    pytest.importorskip("cutlass")
    from dsagen.kernels.lightning_indexer import score_sm90, topk_sm90

    a, b = topk_sm90.build(512, True, TOPK_COMPACT_CAP[512])[0], topk_sm90.build(512, True, TOPK_COMPACT_CAP[512])[0]
    assert a is not b
    assert score_sm90.build(64, 128, "bfloat16", 4)[0] is not score_sm90.build(64, 128, "bfloat16", 4)[0]
    assert (score_sm90.build(64, 128, "bfloat16", 4, True)[0]
            is not score_sm90.build(64, 128, "bfloat16", 4, True)[0])
    from dsagen.kernels.lightning_indexer import mask_lse_sm90

    assert mask_lse_sm90.build(256).kernel is not mask_lse_sm90.build(256).kernel
