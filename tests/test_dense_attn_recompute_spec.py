"""CPU tests of the dense attention score recompute kernel (attn_score_recompute/dense_sm90.py): spec checks, the
binding, the compiled kernels' SASS, and the host path with a stand-in kernel that computes the kernel's contract
in torch."""

from __future__ import annotations

import math
import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.attn_score_recompute.spec import (DenseAttnScoreRecomputeConfig, DenseAttnScoreRecomputeSpec,
                                                      dense_config_for)
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=32), "num_heads=32 must be 64 or 128"),
    (dict(d_qk=128), "d_qk=128 must be 512 or 576"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(regs_consumer=240), "exceeds 504"),
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(row_pairs=True), "row_pairs needs num_heads=64"),
    (dict(num_heads=64, row_pairs=1), "field row_pairs must be a bool"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        DenseAttnScoreRecomputeSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_binding():
    cfg = dense_config_for(128, 576, "bfloat16", "sm_90a", 132)
    assert cfg == DenseAttnScoreRecomputeConfig() and cfg.n_ctas(132) == 132
    assert cfg.spec(128, 576, "bfloat16") == DenseAttnScoreRecomputeSpec(arch="sm_90a")
    with pytest.raises(ValueError, match="grid=-1"):
        DenseAttnScoreRecomputeConfig(grid=-1)
    pairs = DenseAttnScoreRecomputeConfig(row_pairs=True)
    assert pairs.spec(64, 512, "bfloat16").row_pairs and not pairs.spec(128, 576, "bfloat16").row_pairs
    src = render(DenseAttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.attn_score_recompute.dense_sm90 import build" in src
    assert "dsagen.kernels.attn_score_recompute.dense_sm90" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("h,d,pairs", [(128, 576, False), (128, 512, False), (64, 512, False), (64, 576, True)])
def test_compiles_to_wgmma(h, d, pairs, tmp_path):
    """S^T = K Q^T per tile as D / 16 wgmmas of M = 64 keys and N = H heads (with row_pairs N = 128: two rows' 64),
    waited once per 64-column block (ptxas did not serialize them: every wgmma waited alone was 1.3-1.4x slower on
    the H200); the TMA key boxes (one per 64-column block); no named barrier per tile (the head sums stay in
    registers), only
    the item end's over both consumers' 256 threads (id 3); no spills; register budgets that fit the CTA's pool
    (setmaxnreg moves registers inside it)."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = DenseAttnScoreRecomputeSpec(arch="sm_90a", num_heads=h, d_qk=d, row_pairs=pairs)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [384, 1, 1] and ck.record["launch"]["smem"] <= 227 * 1024
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    assert len(re.findall(rf"HGMMA\.64x{2 * h if pairs else h}x16\.F32\.BF16 ", sass)) == d // 16
    assert sass.count("WARPGROUP.DEPBAR") == d // 64, "wgmma serialized by ptxas"
    assert len(re.findall(r"UTMALDG", sass)) == d // 64
    assert re.findall(r"BAR\.SYNC\.DEFER_BLOCKING [^\n;]*", sass) == ["BAR.SYNC.DEFER_BLOCKING 0x0 ",
                                                                       "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100 "]
    assert not re.findall(r"(LDL|STL)", sass)                                      # no spills
    budgets = sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == sorted([spec.regs_producer, spec.regs_consumer])
    assert 128 * (spec.regs_producer + 2 * spec.regs_consumer) <= 384 * ck.record["regcount"]


def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """dense_host's batch flattening, head padding (lse = +inf), offsets and buffers, with a stand-in for the kernel
    that computes its contract (dense_sm90's docstring) in torch, against the reference op: BSHD B 2, 16 heads
    padded to 64, ratio 2, offsets that empty rows and pass every key."""
    import torch

    import dsagen
    from dsagen.kernels.attn_score_recompute import dense_host

    class Kernel:
        def launch(self, q, keys, lse, out, denom, q_off, rows, T, S, ratio, has_off, ld_q, ld_out, scale, n_ctas):
            flat = torch.as_strided(out, (rows, S), (ld_out, 1), out.storage_offset())   # rows ld_out apart
            den = denom.view(rows)
            for tok in range(rows):
                b, t = divmod(tok, T)
                off = int(q_off[b]) if has_off else 0
                hi = min(max((off + t + 1) // ratio, 0), S) if off + t + 1 > 0 else 0
                s = torch.einsum("hd,sd->hs", q[tok].float(), keys[b * S:b * S + hi].float()) * scale
                p = torch.exp(s - lse[tok].view(-1, 1)).sum(0)
                flat[tok, :hi] = p
                flat[tok, hi:S] = -math.inf
                den[tok] = p.sum()

    spec = DenseAttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512)
    monkeypatch.setattr(dense_host, "_launch_plan", lambda *a, **k: (spec, Kernel(), 3))
    gen = torch.Generator().manual_seed(4)
    b, s_q, h, d, s_k = 2, 5, 16, 512, 7
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    k = torch.randn(b, s_k, d, generator=gen).bfloat16()
    lse = torch.randn(b, s_q, h, generator=gen) + 20.0
    off = torch.tensor([-3, 40], dtype=torch.int32)
    got, den = dense_host.dense_attn_score_recompute(q, k, lse, 0.05, ratio=2, q_causal_offsets=off)
    want, want_den = dsagen.dense_attn_score_recompute(q, k, lse, 0.05, ratio=2, q_causal_offsets=off,
                                                       impl="reference")
    assert got.shape == want.shape and den.shape == want_den.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = ~torch.isneginf(want)
    assert torch.allclose(got[fin], want[fin].float(), rtol=1e-4, atol=1e-6)
    assert torch.allclose(den, want_den.float(), rtol=1e-4, atol=1e-6)
    assert torch.isneginf(got[0, :2]).all() and (den[0, :2] == 0).all()          # rows before the keys


def test_unsupported_inputs_say_why():
    import torch

    from dsagen.kernels.attn_score_recompute import dense_host

    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert "D=128" in dense_host.supported_reason(q, torch.zeros(1, 3, 128, dtype=torch.bfloat16))
    q = torch.zeros(1, 2, 64, 576, dtype=torch.bfloat16)
    assert "MQA" in dense_host.supported_reason(q, torch.zeros(1, 3, 2, 576, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="float32"):
        dense_host.dense_attn_score_recompute(q.float(), torch.zeros(1, 3, 576), torch.zeros(1, 2, 64), 0.1)


def test_caller_buffers_of_another_shape_dtype_or_layout_are_refused():
    """A ValueError naming the buffer, raised before any launch (the kernel writes rows of ld_out = S_k floats)."""
    import torch

    from dsagen.kernels.attn_score_recompute import dense_host

    q = torch.zeros(1, 3, 64, 576, dtype=torch.bfloat16)
    k, lse = torch.zeros(1, 5, 576, dtype=torch.bfloat16), torch.zeros(1, 3, 64)
    for kw, name in ((dict(out=torch.zeros(1, 3, 6)), "out"), (dict(out=torch.zeros(1, 5, 3).transpose(1, 2)), "out"),
                     (dict(denom=torch.zeros(1, 3, dtype=torch.float64)), "denom")):
        with pytest.raises(ValueError, match=name):
            dense_host.dense_attn_score_recompute(q, k, lse, 0.1, **kw)


def test_packed_segments_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """THD: one launch per segment with rows of keys, on views of the (total_q, max_seqlen_k) output (rows W apart);
    an empty segment, one without keys, rows after the last segment; against the reference's THD form."""
    import math

    import torch

    import dsagen
    from dsagen.kernels.attn_score_recompute import dense_host

    launches = []

    class Kernel:
        def launch(self, q, keys, lse, out, denom, q_off, rows, T, S, ratio, has_off, ld_q, ld_out, scale, n_ctas):
            launches.append((rows, S, ld_out))
            flat = torch.as_strided(out, (rows, S), (ld_out, 1), out.storage_offset())
            for tok in range(rows):
                off = int(q_off[0]) if has_off else 0
                hi = min(max((off + tok + 1) // ratio, 0), S) if off + tok + 1 > 0 else 0
                s = torch.einsum("hd,sd->hs", q[tok].float(), keys[:hi].float()) * scale
                p = torch.exp(s - lse[tok].view(-1, 1)).sum(0)
                flat[tok, :hi] = p
                flat[tok, hi:S] = -math.inf
                denom.view(rows)[tok] = p.sum()

    spec = DenseAttnScoreRecomputeSpec(arch="sm_90a", num_heads=64, d_qk=512)
    monkeypatch.setattr(dense_host, "_launch_plan", lambda *a, **k: (spec, Kernel(), 3))
    gen = torch.Generator().manual_seed(6)
    cu_q = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 8, 13], dtype=torch.int32)
    q = torch.randn(14, 16, 512, generator=gen).bfloat16()
    k = torch.randn(13, 512, generator=gen).bfloat16()
    lse = torch.randn(14, 16, generator=gen) + 20.0
    off = torch.tensor([2, 0, 5, -1], dtype=torch.int32)
    kw = dict(ratio=2, q_causal_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got, den = dense_host.dense_attn_score_recompute_packed(q, k, lse, 0.05, **kw)
    want, want_den = dsagen.dense_attn_score_recompute(q, k, lse, 0.05, impl="reference", **kw)
    assert launches == [(4, 6, 6), (3, 5, 6)]                   # segments 1 (no rows) and 2 (no keys) launch nothing
    assert got.shape == want.shape == (14, 6) and den.shape == want_den.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = ~torch.isneginf(want)
    assert torch.allclose(got[fin], want[fin].float(), rtol=1e-4, atol=1e-6)
    assert torch.allclose(den, want_den.float(), rtol=1e-4, atol=1e-6)
    assert torch.isneginf(got[12:]).all() and (den[12:] == 0).all()              # rows after the last segment
