"""Rendering and cross-compilation: templates render with StrictUndefined, compile to cubins for
sm_90a, and a declaration that disagrees with the compiled kernel is refused."""

from __future__ import annotations

import jinja2
import pytest

from dsagen.jit import abi
from dsagen.jit.render import helper_modules, render, template_name
from dsagen.spec import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec


def test_render_includes_spec_values():
    src = render(CompactifySpec(arch="sm_90a", warps_per_cta=4))
    assert 'SYMBOL = "dsagen_compactify_warps_per_cta4_sm_90a"' in src
    assert "from dsagen.kernels.indices.compactify import build" in src and "build(warps_per_cta=4)" in src
    compile(src, "kernel.py", "exec")  # valid Python


def test_render_is_strict(monkeypatch):
    spec = CompactifySpec(arch="sm_90a")
    monkeypatch.setattr(CompactifySpec, "template_context", lambda self: {"arch": self.arch})
    with pytest.raises(jinja2.UndefinedError):
        render(spec)


def test_template_lookup_is_the_family_folder_with_the_arch_family_filled_in():
    from dsagen.jit.render import TemplateNotFound
    from dsagen.kernels.sparse_mla.spec import SparseAttnFwdSpec

    assert template_name(CompactifySpec(arch="sm_90a")) == "indices/compactify.py.j2"   # arch-independent
    assert template_name(RuntimeProbeSpec(arch="sm_90a", feature="tma")) == "testing/runtime_probe.py.j2"
    assert template_name(SparseAttnFwdSpec(arch="sm_90a")) == "sparse_mla/fwd_sm90.py.j2"
    with pytest.raises(TemplateNotFound, match="sparse_mla/fwd_sm100.py.j2"):
        template_name(SparseAttnFwdSpec(arch="sm_100a"))


def test_helper_modules_are_hashed(tmp_path, monkeypatch):
    import dsagen.jit.render as r

    lib = tmp_path / "kernels"
    lib.mkdir()
    (lib / "mathx.py").write_text("from dsagen.kernels.inner import y\nx = 1\n")
    (lib / "inner.py").write_text("y = 2\n")
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    h1 = helper_modules("from dsagen.kernels.mathx import x\n")
    assert set(h1) == {"dsagen.kernels.mathx", "dsagen.kernels.inner"}
    (lib / "inner.py").write_text("y = 3\n")
    assert helper_modules("from dsagen.kernels.mathx import x\n")["dsagen.kernels.inner"] != h1["dsagen.kernels.inner"]


def test_param_declaration_reasons():
    bad = [{"name": "a", "kind": "ptr", "dtype": "int32", "align": 3}, {"name": "a", "kind": "i16"},
           {"name": "m", "kind": "tensormap"}]
    r = " | ".join(abi.param_reasons(bad))
    assert "align 3" in r and "duplicate name 'a'" in r and "kind 'i16'" in r and "encode" in r


@pytest.mark.compile
@pytest.mark.parametrize("spec", [CompactifySpec(arch="sm_90a"), LocalToGlobalSpec(arch="sm_90a"),
                                  LocalToGlobalSpec(arch="sm_100a"),
                                  RuntimeProbeSpec(arch="sm_90a", feature="tma"),
                                  RuntimeProbeSpec(arch="sm_90a", feature="cluster")])
def test_compile_produces_a_checked_cubin(spec, tmp_path):
    from dsagen.jit.build import compile_module

    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.cubin[:4] == b"\x7fELF"
    sm = {"sm_90a": 90, "sm_100a": 100}[spec.arch]
    assert abi.cubin_sm(ck.cubin) == sm
    kernels = abi.cubin_kernels(ck.cubin)
    assert ck.record["symbol"] in kernels
    assert [(p["offset"], p["size"]) for p in ck.record["params"]] == kernels[ck.record["symbol"]].params
    assert list(kernels[ck.record["symbol"]].reqntid) == ck.record["launch"]["block"]


@pytest.mark.compile
def test_tensormap_param_is_128_bytes(tmp_path):
    from dsagen.jit.build import compile_module

    spec = RuntimeProbeSpec(arch="sm_90a", feature="tma")
    rec = compile_module(spec, render(spec), tmp_path).record
    assert rec["params"][0]["kind"] == "tensormap" and rec["params"][0]["size"] == 128
    assert rec["params"][1]["offset"] == rec["params"][0]["offset"] + 128  # cbank offsets come from the cubin


@pytest.mark.compile
@pytest.mark.parametrize("edit,match", [
    ('PARAMS = [dict(p, kind="i64") if p["name"] == "k" else p for p in PARAMS]', "param k declared i64"),
    ('HOST_ARGS = list(PARAMS)\nPARAMS = PARAMS + [{"name": "extra", "kind": "i32"}]', "PARAMS declares 9"),
    ('LAUNCH = dict(LAUNCH, block=[128, 1, 1])', "reqntid"),
    ('LAUNCH = dict(LAUNCH, smem=1024)', "smem"),
])
def test_declaration_mismatch_is_refused(tmp_path, edit, match):
    """A rendered module whose PARAMS or LAUNCH (here overridden at its end) disagree with the compiled kernel."""
    from dsagen.jit.build import compile_module

    spec = CompactifySpec(arch="sm_90a")
    with pytest.raises(abi.AbiError, match=match):
        compile_module(spec, render(spec) + "\n" + edit + "\n", tmp_path)


def test_helper_modules_follow_submodule_and_relative_imports(tmp_path, monkeypatch):
    """`from dsagen.kernels.fam import mod` hashes mod (not only the package), multi-line imports are read,
    and a kernel module's relative imports are followed: an edit of any of them changes the key."""
    import dsagen.jit.render as r

    lib = tmp_path / "kernels"
    (lib / "fam").mkdir(parents=True)
    (lib / "fam" / "__init__.py").write_text("")
    (lib / "fam" / "body.py").write_text("from .parts import (\n    piece,\n)\nfrom . import tiles\n")
    (lib / "fam" / "parts.py").write_text("piece = 1\n")
    (lib / "fam" / "tiles.py").write_text("t = 2\n")
    monkeypatch.setattr(r, "KERNEL_LIB", lib)
    h = helper_modules("from dsagen.kernels.fam import body\n")
    assert set(h) == {"dsagen.kernels.fam", "dsagen.kernels.fam.body", "dsagen.kernels.fam.parts",
                      "dsagen.kernels.fam.tiles"}
    (lib / "fam" / "tiles.py").write_text("t = 3\n")
    assert helper_modules("from dsagen.kernels.fam import body\n")["dsagen.kernels.fam.tiles"] != h["dsagen.kernels.fam.tiles"]
