"""The sparse MLA forward's kernel is plain Python (dsagen/kernels/sparse_mla/fwd_sm90.py and the device helpers it
imports from the shared Hopper toolkit, dsagen/kernels/common/sm90/); its template only binds a spec. Editing any of
these modules changes the
key and the identity of every spec of the op; editing another family's kernel module changes neither."""

from __future__ import annotations

import shutil

import pytest

from dsagen.jit import identity_of, key_material, key_of
from dsagen.jit.keys import identity_material
from dsagen.jit.render import KERNEL_LIB, render
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdSpec

TC = {"nvidia-cutlass-dsl": "4.8.1"}
SPECS = [SparseAttnFwdSpec(arch="sm_90a"), SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512, dtype="float16")]
MODULES = ["sparse_mla/fwd_sm90", "common/sm90/gather", "common/sm90/softmax", "common/sm90/ptx"]


def test_template_only_binds_a_spec():
    text = (KERNEL_LIB / "sparse_mla" / "fwd_sm90.py.j2").read_text()
    assert len(text.splitlines()) <= 60
    for needle in ("@cute.kernel", "@cute.jit", "def ", "{% import", "{% include", "{% macro", "{% if", "{% for"):
        assert needle not in text, needle
    assert "from dsagen.kernels.sparse_mla.fwd_sm90 import build" in text
    assert not (KERNEL_LIB / "sparse_mla" / "fwd_sm90").exists()             # no template parts


@pytest.mark.parametrize("module", MODULES)
def test_key_and_identity_follow_the_kernel_modules(module, monkeypatch, tmp_path):
    import dsagen.jit.render as r

    name = "dsagen.kernels." + module.replace("/", ".")
    sources = [render(s) for s in SPECS]
    for spec, src in zip(SPECS, sources):
        assert name in key_material(spec, src, TC)["helpers"] and name in identity_material(spec)["helpers"]
    before = [(key_of(key_material(s, src, TC)), identity_of(s)) for s, src in zip(SPECS, sources)]

    lib = tmp_path / "kernels"
    shutil.copytree(KERNEL_LIB, lib, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    monkeypatch.setattr(r, "TEMPLATES", lib)
    assert [(key_of(key_material(s, src, TC)), identity_of(s)) for s, src in zip(SPECS, sources)] == before

    other = lib / "indices" / "compactify.py"
    other.write_text(other.read_text() + "# edited\n")
    assert [(key_of(key_material(s, src, TC)), identity_of(s)) for s, src in zip(SPECS, sources)] == before

    path = lib / f"{module}.py"
    path.write_text(path.read_text() + "# edited\n")
    after = [(key_of(key_material(s, src, TC)), identity_of(s)) for s, src in zip(SPECS, sources)]
    assert all(k != k0 and i != i0 for (k, i), (k0, i0) in zip(after, before))
