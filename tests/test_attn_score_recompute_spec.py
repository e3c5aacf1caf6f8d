"""CPU tests of the sparse attention score recompute family (dsagen/kernels/attn_score_recompute): spec checks, the
binding, and the compiled kernels' SASS (wgmma for S, the gather, no deadlocking register budgets)."""

from __future__ import annotations

import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.attn_score_recompute.spec import AttnScoreRecomputeConfig, AttnScoreRecomputeSpec, config_for
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=32), "num_heads=32 must be 64 or 128"),
    (dict(d_qk=128), "d_qk=128 must be 512 or 576"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(regs_consumer=240), "exceeds 504"),
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(prefetch_ids=1), "field prefetch_ids must be a bool, got 1"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        AttnScoreRecomputeSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_binding():
    cfg = config_for(128, 576, "bfloat16", "sm_90a", 132)
    assert cfg == AttnScoreRecomputeConfig() and cfg.n_ctas(132) == 132
    assert cfg.spec(128, 576, "bfloat16") == AttnScoreRecomputeSpec(arch="sm_90a")
    assert config_for(64, 512, "bfloat16", "sm_90a", 132) == AttnScoreRecomputeConfig(prefetch_ids=True)
    assert config_for(64, 576, "bfloat16", "sm_90a", 132) == AttnScoreRecomputeConfig()
    with pytest.raises(ValueError, match="grid=-1"):
        AttnScoreRecomputeConfig(grid=-1)
    src = render(AttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.attn_score_recompute.recompute_sm90 import build" in src
    assert len(src.split("SYMBOL = ")[1].splitlines()) <= 12
    assert "dsagen.kernels.attn_score_recompute.recompute_sm90" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("h,d,prefetch", [(128, 576, False), (64, 512, True)])
def test_compiles_to_wgmma(h, d, prefetch, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = AttnScoreRecomputeSpec(arch="sm_90a", num_heads=h, d_qk=d, prefetch_ids=prefetch)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [384, 1, 1] and ck.record["launch"]["smem"] <= 227 * 1024
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    # both consumers run the same code on alternate tiles: per tile D / 16 k-steps of one 64 x 64 wgmma per 64 heads
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ", sass)) == (h // 64) * (d // 16)
    assert not re.findall(r"HGMMA\.64x(?!64x)\d+x16", sass)
    # waited about once per 64-column block: ptxas did not serialize the wgmma (C7520, as it did with prefetch_ids
    # while its id loads sat behind a branch on the row's tile count)
    assert sass.count("WARPGROUP.DEPBAR") <= d // 64 + 1, "wgmma serialized by ptxas"
    # one place: each consumer's own named barrier (id 1 + w, a register) over its 128 threads
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x80", sass)) == 1
    assert not re.findall(r"(LDL|STL)", sass)                                      # no spills
    budgets = sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == sorted([spec.regs_producer, spec.regs_consumer])


def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """The host's batch flattening (local ids range-checked per batch), head padding (lse = +inf) and row
    normalisation, with a stand-in for the kernel that computes its contract in torch (out[t, j] = the head sum of
    exp(scale q.k - lse) over valid slots j < length), against the reference op."""
    import torch

    import dsagen
    from dsagen.kernels.attn_score_recompute import host as rc_host

    class Kernel:
        def launch(self, q, keys, ids, length, lse, out, rows, n_kv, topk, ld_q, ld_kv, ld_idx, scale, has_length,
                   n_ctas):
            valid = (ids >= 0) & (ids < n_kv)
            if has_length:
                valid &= torch.arange(topk).view(1, -1) < length.view(-1, 1)
            rows_k = keys.float()[ids.clamp(0, n_kv - 1).long()]                        # (rows, topk, D)
            s = torch.einsum("rhd,rkd->rhk", q.float(), rows_k) * scale
            p = torch.exp(s - lse.view(rows, -1, 1)).sum(1)
            out.copy_(torch.where(valid, p, 0.0))

    spec = AttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512)
    monkeypatch.setattr(rc_host, "_launch_plan", lambda *a, **k: (spec, Kernel(), 3))
    gen = torch.Generator().manual_seed(2)
    b, s_q, h, d, s_k, k = 2, 3, 16, 512, 9, 6
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    kv = torch.randn(b, s_k, d, generator=gen).bfloat16()
    ids = torch.randint(-2, s_k + 2, (b, s_q, k), generator=gen, dtype=torch.int32)
    lse = torch.randn(b, s_q, h, generator=gen) + 20.0
    length = torch.tensor([[6, 2, 0], [5, 6, 1]], dtype=torch.int32)
    got = rc_host.sparse_attn_score_recompute(q, kv, lse, ids, 0.05, topk_length=length)
    want = dsagen.sparse_attn_score_recompute(q, kv, lse, ids, 0.05, topk_length=length, impl="reference")
    assert got.shape == (b, s_q, k) and got.dtype == torch.float32
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert (got[0, 2] == 0).all()                                               # topk_length 0


def test_the_custom_op_and_its_fake(monkeypatch):
    """torch.library.opcheck of dsagen::sparse_attn_score_recompute_fused (schema, fake tensor, AOT dispatch) on the
    CPU, the kernel a stand-in that writes its contract's shape: the fake's output matches the op's."""
    import torch

    from dsagen.kernels.attn_score_recompute import host as rc_host

    class Kernel:
        def launch(self, q, keys, ids, length, lse, out, rows, *rest):
            out.copy_(torch.rand(out.shape, generator=torch.Generator().manual_seed(1)))

    spec = AttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512)
    monkeypatch.setattr(rc_host, "_launch_plan", lambda *a, **k: (spec, Kernel(), 3))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 64, 512, generator=gen).bfloat16()
    kv = torch.randn(1, 9, 512, generator=gen).bfloat16()
    ids = torch.randint(-1, 9, (1, 3, 6), generator=gen, dtype=torch.int32)
    lse = torch.randn(1, 3, 64, generator=gen) + 20.0
    torch.library.opcheck(rc_host._fused_op, (q, kv, lse, ids, 0.05, None, False))


def test_launch_plans_of_both_score_recomputes(monkeypatch):
    """Both score recomputes' _launch_plan (sparse_mla.host.head_padded_launch_plan), with the device queries and the
    kernel loader stood in: the spec of the padded head count under the op's config or the caller's, the loaded
    kernel of that spec, n_ctas from the device's SMs, and one load per call shape."""
    import torch

    from dsagen.kernels.attn_score_recompute import host as rc_host
    from dsagen.kernels.indexer_score_recompute import host as isr_host
    from dsagen.kernels.indexer_score_recompute.spec import IndexerScoreRecomputeConfig
    from dsagen.kernels.sparse_mla import host as mla_host

    loads = []
    monkeypatch.setattr(mla_host, "device_arch", lambda dev: "sm_90a")
    monkeypatch.setattr(mla_host, "device_index", lambda dev: 0)
    monkeypatch.setattr(mla_host, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(mla_host, "get_kernel", lambda spec, index: loads.append(spec) or ("kernel", spec))
    dev = torch.device("cuda", 0)
    for host, d, cfg in ((rc_host, 576, AttnScoreRecomputeConfig(grid=5)),
                         (isr_host, 128, IndexerScoreRecomputeConfig(grid=5))):
        monkeypatch.setattr(host, "_launch_plans", {})
        loads.clear()
        op_cfg = host.config_for(128, d, torch.bfloat16, "sm_90a", 132)
        spec, kernel, n_ctas = host._launch_plan(100, d, torch.bfloat16, dev, None)
        assert spec == op_cfg.spec(128, d, "bfloat16", "sm_90a") and spec.num_heads == 128
        assert kernel == ("kernel", spec) and n_ctas == op_cfg.n_ctas(132)
        assert host._launch_plan(100, d, torch.bfloat16, dev, None) == (spec, kernel, n_ctas) and loads == [spec]
        spec5, kernel5, n5 = host._launch_plan(40, d, torch.float16, dev, cfg)
        assert spec5 == cfg.spec(64, d, "float16", "sm_90a") and spec5.num_heads == 64 and n5 == 5
        assert kernel5 == ("kernel", spec5) and loads == [spec, spec5]
