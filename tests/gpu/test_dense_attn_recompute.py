"""GPU tests of the fused dense attention score recompute kernel (attn_score_recompute.dense_host, the sm_90a kernel
of DenseAttnScoreRecomputeSpec) against the plain-PyTorch reference of dsagen.dense_attn_score_recompute in FP64 on
the same bf16 / fp16 values: H 64 / 128 natively and 16 padded, D 512 / 576, odd lengths, ratio 1 and 4, causal
offsets that empty rows or put them past the keys, B > 1, caller buffers, bitwise reruns.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.attn_score_recompute import dense_host
from dsagen.kernels.attn_score_recompute.spec import DenseAttnScoreRecomputeConfig, dense_config_for

ARCH = "sm_90a"
ONE_ROW = DenseAttnScoreRecomputeConfig(row_pairs=False)
REQUIRED_SPECS = [dense_config_for(h, d, dt, ARCH, None).spec(h, d, dt, ARCH)
                  for h, d, dt in [(64, 512, "bfloat16"), (64, 576, "bfloat16"), (128, 512, "bfloat16"),
                                   (128, 576, "bfloat16"), (64, 576, "float16")]] + [
    ONE_ROW.spec(64, d, "bfloat16", ARCH) for d in (512, 576)]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def visible(s_q, s_k, ratio, off):
    """[S_q, S_k] bool: key s visible from query t (s < clamp((off + t + 1) // ratio, 0, S_k))."""
    t = torch.arange(s_q, dtype=torch.int64)
    lim = torch.clamp(torch.div(off + t + 1, ratio, rounding_mode="floor"), 0, s_k)
    return torch.arange(s_k)[None, :] < lim[:, None]


def make_case(b, s_q, s_k, h, d, *, ratio=1, offsets=None, seed=0, dtype=torch.bfloat16):
    """Random q / k and the true dense per-head LSE over each row's visible keys (FP64; -inf for none)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn((b, s_q, h, d), generator=gen) * 0.5).to(dtype)
    k = (torch.randn((b, s_k, d), generator=gen) * 0.5).to(dtype)
    scale = d ** -0.5
    lse = torch.empty((b, s_q, h), dtype=torch.float64)
    for i in range(b):
        off = 0 if offsets is None else int(offsets[i])
        sc = torch.einsum("thd,sd->ths", q[i].double(), k[i].double()) * scale
        sc = sc.masked_fill(~visible(s_q, s_k, ratio, off)[:, None, :], -math.inf)
        lse[i] = torch.logsumexp(sc, dim=-1)
    off_t = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=DEV)
    return q.to(DEV), k.to(DEV), lse.float().to(DEV), scale, ratio, off_t


def check(q, k, lse, scale, ratio, off, out=None, denom=None, config=None):
    got, got_den = dense_host.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off,
                                                         out=out, denom=denom, config=config)
    want, want_den = dsagen.dense_attn_score_recompute(q.double(), k.double(), lse.double(), scale, ratio=ratio,
                                                       q_causal_offsets=off, impl="reference")
    assert got.shape == want.shape and got.dtype == torch.float32 and got_den.shape == want_den.shape
    masked = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), masked), "the -inf pattern differs from the mask"
    assert torch.isfinite(got[~masked]).all()
    err = (got.double() - want).masked_fill(masked, 0).abs().max().item() if got.numel() else 0.0
    assert err <= 2e-3 * max(want.masked_fill(masked, 0).abs().max().item() if got.numel() else 0.0, 1e-6), err
    den_err = (got_den.double() - want_den).abs()
    assert (den_err <= 1e-3 * want_den.abs() + 1e-5).all(), den_err.max().item()
    return got, got_den


@pytest.mark.parametrize("h,d", [(64, 512), (64, 576), (128, 512), (128, 576)])
def test_matches_reference(h, d):
    check(*make_case(1, 301, 301, h, d, seed=h + d))


@pytest.mark.parametrize("h", [64, 128])
def test_ratio_offsets_batches(h):
    """ratio 4, B 3: offsets that empty the first rows (-40), put rows past every key (5000) and a plain one."""
    check(*make_case(3, 97, 150, h, 576, ratio=4, offsets=[-40, 5000, 7], seed=h))


def test_empty_and_short_rows():
    """S_k smaller than one tile, rows with no visible key (offset -20): out all -inf, denom 0."""
    q, k, lse, scale, ratio, off = make_case(2, 33, 5, 64, 512, offsets=[-20, 0], seed=3)
    got, den = check(q, k, lse, scale, ratio, off)
    assert torch.isneginf(got[0, :19]).all() and (den[0, :19] == 0).all()


def test_padded_heads_and_fp16():
    check(*make_case(1, 70, 130, 16, 576, seed=5))
    check(*make_case(1, 70, 130, 64, 576, seed=6, dtype=torch.float16))


@pytest.mark.parametrize("d", [512, 576])
def test_row_pairs_against_one_row(d):
    """The 64-head default, row_pairs (two query rows per item, 64 heads each), against the reference and the
    one-row kernel: odd T (the last row alone), B 3 with offsets that empty rows, reach past every key and differ
    between batch elements, ratio 1 and 4, 16 heads padded to 64; the same -inf pattern as the one-row kernel and
    values within 1e-6 of its (each row's head sums run over the same columns in the same order; the denominators'
    partial sums may fall to the other consumer)."""
    for b, t, s_k, h, ratio, offs, seed in ((1, 301, 301, 64, 1, None, 31), (3, 97, 150, 64, 4, [-40, 5000, 7], 32),
                                           (2, 33, 5, 16, 1, [-20, 0], 33)):
        q, k, lse, scale, ratio, off = make_case(b, t, s_k, h, d, ratio=ratio, offsets=offs, seed=seed + d)
        got, den = check(q, k, lse, scale, ratio, off)
        one, one_den = dense_host.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off,
                                                             config=ONE_ROW)
        assert torch.equal(torch.isneginf(got), torch.isneginf(one))
        fin = ~torch.isneginf(one)
        assert torch.allclose(got[fin], one[fin], rtol=1e-6, atol=0) and torch.allclose(den, one_den, rtol=1e-6)


def test_caller_buffers_and_bitwise_reruns():
    q, k, lse, scale, ratio, off = make_case(2, 200, 260, 128, 576, ratio=1, offsets=[0, 60], seed=9)
    out = torch.full((2, 200, 260), 7.0, device=DEV)
    den = torch.full((2, 200), 7.0, device=DEV)
    a, ad = check(q, k, lse, scale, ratio, off, out=out, denom=den)
    assert a.data_ptr() == out.data_ptr() and ad.data_ptr() == den.data_ptr()
    b, bd = dense_host.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off)
    assert torch.equal(a, b) and torch.equal(ad, bd)


def test_public_op_compile_graph_and_out_variant():
    """dsagen.dense_attn_score_recompute (impl="fused", the default) runs this kernel: equal to the host's result,
    under torch.compile(fullgraph=True), in a captured CUDA graph, and through torch.ops.dsagen's _out variant."""
    q, k, lse, scale, ratio, off = make_case(2, 77, 90, 64, 576, ratio=4, offsets=[30, 300], seed=21)
    want, want_den = dense_host.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off)
    got, got_den = dsagen.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off)
    assert torch.equal(got, want) and torch.equal(got_den, want_den)
    compiled = torch.compile(lambda *a: dsagen.dense_attn_score_recompute(*a, scale, ratio=ratio, q_causal_offsets=off),
                             fullgraph=True)
    c_out, c_den = compiled(q, k, lse)
    assert torch.equal(c_out, want) and torch.equal(c_den, want_den)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_den = dsagen.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=off)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, want) and torch.equal(g_den, want_den)
    o_out, o_den = torch.full_like(want, 3.0), torch.full_like(want_den, 3.0)
    torch.ops.dsagen.dense_attn_score_recompute_out(q, k, lse, scale, ratio, off, out_out=o_out, out_denom=o_den)
    assert torch.equal(o_out, want) and torch.equal(o_den, want_den)


def test_packed_segments():
    """The THD layout through dsagen.dense_attn_score_recompute (one launch per segment on views of the
    (total_q, max_seqlen_k) output): segments without rows or keys, per-segment offsets, ratio 4, rows after the last
    segment, against the FP64 reference's THD form."""
    gen = torch.Generator().manual_seed(41)
    cu_q = torch.tensor([0, 70, 70, 131, 200], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 90, 150, 150, 290], dtype=torch.int32, device=DEV)
    q = (torch.randn((205, 64, 576), generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn((290, 576), generator=gen) * 0.5).bfloat16().to(DEV)
    lse = (torch.rand((205, 64), generator=gen) * 4 + 6).to(DEV)
    kw = dict(ratio=4, q_causal_offsets=torch.tensor([30, 0, 7, 400], dtype=torch.int32, device=DEV),
              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got, den = dsagen.dense_attn_score_recompute(q, k, lse, 576 ** -0.5, **kw)
    want, want_den = dsagen.dense_attn_score_recompute(q.double(), k.double(), lse.double(), 576 ** -0.5,
                                                       impl="reference", **kw)
    assert got.shape == want.shape == (205, 140) and den.shape == want_den.shape
    masked = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), masked)
    err = (got.double() - want).masked_fill(masked, 0).abs().max().item()
    assert err <= 2e-3 * want.masked_fill(masked, 0).abs().max().item(), err
    assert ((den.double() - want_den).abs() <= 1e-3 * want_den.abs() + 1e-5).all()
    assert torch.isneginf(got[200:]).all() and (den[200:] == 0).all()
