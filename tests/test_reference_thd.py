"""Packed THD layout (cu_seqlens_q / cu_seqlens_k, cuDNN frontend DSA §3/§4/§8/§10) of the cuDNN frontend DSA ops, impl="reference".

Oracle: every THD result equals the BSHD op run on each segment on its own (B = 1 tensors cut from the packed
ones), or on all segments zero-padded and stacked into one BSHD batch; gradients (autograd, and the analytic
dense indexer backward) likewise. Segments include an empty one, length-1 ones, a query segment without keys,
keys without queries, lengths not divisible by the ratio, and rows after the last offset.
"""

from __future__ import annotations

import pytest
import torch

import dsagen.ops._fused
from dsagen.ops.indexer import indexer_forward_topk, indexer_scores
from dsagen.ops.indexer_training import dense_indexer_backward, dense_indexer_score_recompute
from dsagen.ops.sparse_attention import dense_attn_score_recompute

REF = dict(impl="reference")
I32 = dict(dtype=torch.int32)
F64 = torch.float64
INF = float("-inf")

# Segment lengths: 6 queries / 5 keys, an empty segment, 1 / 1, 9 queries / 7 keys, 0 queries / 3 keys,
# 3 queries / 0 keys; then 2 query rows and 1 key row after the last offset.
LENS_Q = (6, 0, 1, 9, 0, 3)
LENS_K = (5, 0, 1, 7, 3, 0)
TAIL_Q, TAIL_K = 2, 1
OFFSETS = (-3, 4, 7, 5, 1, 5)  # q_causal_offsets: global token index of each segment's q[0]


def cu(lens, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)


CU_Q, CU_K = cu(LENS_Q), cu(LENS_K)
TOTAL_Q, TOTAL_K = sum(LENS_Q) + TAIL_Q, sum(LENS_K) + TAIL_K
MAX_K = max(LENS_K)


def segments():
    """(i, q0, q1, k0, k1) of each segment."""
    q, k = CU_Q.tolist(), CU_K.tolist()
    return [(i, q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(LENS_Q))]


def offsets(use):
    return torch.tensor(OFFSETS, **I32) if use else None


def seg_off(off, i):
    return None if off is None else off[i:i + 1]


def packed(h=4, d=5, seed=0, dtype=F64):
    """THD indexer triple q [total_q, H, D], k [total_k, D], w [total_q, H]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)  # noqa: E731
    return r(TOTAL_Q, h, d), r(TOTAL_K, d), r(TOTAL_Q, h)


def check_rows(thd, pieces, tail_fill, width=None, tol=0.0):
    """thd rows of segment i equal pieces[i] (on its first columns; the rest is tail_fill), and the rows
    after the last offset are all tail_fill."""
    for (i, q0, q1, k0, k1), want in zip(segments(), pieces):
        got = thd[q0:q1]
        if width is not None:
            torch.testing.assert_close(got[:, :k1 - k0], want, rtol=tol, atol=tol)
            assert (got[:, k1 - k0:] == tail_fill).all()
        else:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert (thd[CU_Q[-1]:] == tail_fill).all()


def stacked(t, cu_lens, width):
    """Packed rows -> [B, width, ...] zero-padded BSHD batch (segments stacked)."""
    out = t.new_zeros((len(cu_lens) - 1, width, *t.shape[1:]))
    for i in range(len(cu_lens) - 1):
        a, b = int(cu_lens[i]), int(cu_lens[i + 1])
        out[i, :b - a] = t[a:b]
    return out


def grads(fn, leaves):
    out = fn()
    return torch.autograd.grad(out, leaves, allow_unused=True)


def finite(t):
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype))


# --- indexer_scores (§3) ------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,use_off", [(1, False), (4, True), (3, True), (4, False)])
def test_indexer_scores_thd_equals_per_segment_bshd(ratio, use_off):
    q, k, w = packed(seed=ratio)
    off = offsets(use_off)
    thd = indexer_scores(q, k, w, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    assert thd.shape == (TOTAL_Q, MAX_K) and thd.dtype == F64
    pieces = [indexer_scores(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=ratio,
                             q_causal_offsets=seg_off(off, i), **REF)[0] for i, q0, q1, k0, k1 in segments()]
    check_rows(thd, pieces, INF, width=MAX_K)
    # Some rows must see keys, some must be fully masked, or the test proves little.
    assert torch.isfinite(thd).any() and (~torch.isfinite(thd[:CU_Q[-1]])).all(dim=1).any()


def test_indexer_scores_thd_equals_padded_stacked_bshd_batch():
    q, k, w = packed(seed=7)
    off = offsets(True)
    thd = indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    max_q = max(LENS_Q)
    bshd = indexer_scores(stacked(q, CU_Q, max_q), stacked(k, CU_K, MAX_K), stacked(w, CU_Q, max_q), ratio=4,
                          q_causal_offsets=off, **REF)
    # One batched GEMM instead of one per segment: equal up to summation order.
    check_rows(thd, [bshd[i, :q1 - q0, :k1 - k0] for i, q0, q1, k0, k1 in segments()], INF, width=MAX_K,
               tol=1e-12)


def test_indexer_scores_thd_mqa_3d_keys_int64_offsets_and_low_precision():
    q, k, w = packed(seed=3, dtype=torch.bfloat16)
    kw = dict(ratio=2, cu_seqlens_q=cu(LENS_Q, torch.int64), cu_seqlens_k=cu(LENS_K, torch.int64), **REF)
    a = indexer_scores(q, k, w, **kw)
    b = indexer_scores(q, k[:, None], w, **kw)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = indexer_scores(q, k, w, ratio=2, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_indexer_scores_thd_gradients_match_per_segment_bshd():
    q, k, w = (t.requires_grad_() for t in packed(seed=11))
    off = offsets(True)
    cot = torch.randn(TOTAL_Q, MAX_K, generator=torch.Generator().manual_seed(1), dtype=F64)

    def thd_loss():
        s = indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
        return (finite(s) * cot).sum()

    def seg_loss():
        total = 0
        for i, q0, q1, k0, k1 in segments():
            s = indexer_scores(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=4,
                               q_causal_offsets=seg_off(off, i), **REF)[0]
            total = total + (finite(s) * cot[q0:q1, :k1 - k0]).sum()
        return total

    for a, b in zip(grads(thd_loss, (q, k, w)), grads(seg_loss, (q, k, w))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_indexer_scores_thd_without_segments():
    q, k, w = packed()
    zero = torch.zeros(1, **I32)
    out = indexer_scores(q, k, w, cu_seqlens_q=zero, cu_seqlens_k=zero, **REF)
    assert out.shape == (TOTAL_Q, 0)


# --- indexer_forward_topk (§4) ------------------------------------------------------------------------

@pytest.mark.parametrize("global_ids", [True, False])
@pytest.mark.parametrize("ratio,use_off,top_k", [(1, False, 3), (4, True, 2), (2, True, 9), (1, True, 0)])
def test_indexer_forward_topk_thd_equals_per_segment_bshd(global_ids, ratio, use_off, top_k):
    q, k, w = packed(seed=20 + ratio)
    off = offsets(use_off)
    flags = dict(return_softmax=True, return_lse=True, topk_indices_global=global_ids)
    thd = indexer_forward_topk(q, k, w, top_k, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=CU_Q,
                               cu_seqlens_k=CU_K, **flags, **REF)
    assert thd.indices.shape == thd.logits.shape == thd.softmax.shape == (TOTAL_Q, top_k)
    assert thd.lse.shape == (TOTAL_Q,) and thd.indices.dtype == torch.int32
    pieces = {name: [] for name in thd._fields}
    for i, q0, q1, k0, k1 in segments():
        r = indexer_forward_topk(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], top_k, ratio=ratio,
                                 q_causal_offsets=seg_off(off, i), return_softmax=True, return_lse=True,
                                 topk_indices_global=False, **REF)
        ids = r.indices[0]
        # Global THD ids are packed key rows: cu_seqlens_k[b] + local.
        pieces["indices"].append(torch.where(ids >= 0, ids + k0, ids) if global_ids else ids)
        for name in ("logits", "softmax", "lse"):
            pieces[name].append(getattr(r, name)[0])
    for name, fill in (("indices", -1), ("logits", INF), ("softmax", 0.0), ("lse", INF)):
        check_rows(getattr(thd, name), pieces[name], fill)
    if top_k:
        assert (thd.indices >= 0).any()
        valid = thd.indices >= 0
        seg_of_row = torch.repeat_interleave(torch.arange(len(LENS_Q)), torch.tensor(LENS_Q))
        lo = CU_K[seg_of_row] if global_ids else torch.zeros_like(seg_of_row)
        hi = lo + torch.tensor(LENS_K)[seg_of_row]
        ids = thd.indices[:CU_Q[-1]].long()
        ok = (ids >= lo[:, None]) & (ids < hi[:, None])
        assert ok[valid[:CU_Q[-1]]].all()  # every id stays inside its own segment


def test_indexer_forward_topk_thd_optional_outputs_off():
    q, k, w = packed(seed=5)
    r = indexer_forward_topk(q, k, w, 4, ratio=4, return_softmax=False, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                             **REF)
    assert r.softmax is None and r.lse is None and r.indices.shape == (TOTAL_Q, 4)


def test_indexer_forward_topk_thd_gradients_match_per_segment_bshd():
    q, k, w = (t.requires_grad_() for t in packed(seed=12))
    off = offsets(True)
    g = torch.Generator().manual_seed(2)
    cot_l, cot_s, cot_e = (torch.randn(*s, generator=g, dtype=F64) for s in ((TOTAL_Q, 3), (TOTAL_Q, 3), (TOTAL_Q,)))

    def loss(r, rows):
        return (finite(r.logits) * cot_l[rows]).sum() + (r.softmax * cot_s[rows]).sum() + \
            (finite(r.lse) * cot_e[rows]).sum()

    def thd_loss():
        r = indexer_forward_topk(q, k, w, 3, ratio=4, q_causal_offsets=off, return_lse=True, cu_seqlens_q=CU_Q,
                                 cu_seqlens_k=CU_K, **REF)
        return loss(r, slice(None))

    def seg_loss():
        total = 0
        for i, q0, q1, k0, k1 in segments():
            r = indexer_forward_topk(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], 3, ratio=4,
                                     q_causal_offsets=seg_off(off, i), return_lse=True, **REF)
            total = total + loss(type(r)(*(t[0] for t in r)), slice(q0, q1))
        return total

    for a, b in zip(grads(thd_loss, (q, k, w)), grads(seg_loss, (q, k, w))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --- dense_indexer_score_recompute / dense_attn_score_recompute (§8) ----------------------------------

@pytest.mark.parametrize("ratio,use_off", [(1, False), (4, True)])
def test_dense_indexer_score_recompute_thd_equals_per_segment_bshd(ratio, use_off):
    q, k, w = packed(seed=30 + ratio)
    off = offsets(use_off)
    thd = dense_indexer_score_recompute(q, k, w, ratio=ratio, q_causal_offsets=off, sm_scale=0.7,
                                        cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    assert thd.out.shape == (TOTAL_Q, MAX_K) and thd.denom.shape == (TOTAL_Q,)
    outs, denoms = [], []
    for i, q0, q1, k0, k1 in segments():
        r = dense_indexer_score_recompute(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=ratio,
                                          q_causal_offsets=seg_off(off, i), sm_scale=0.7, **REF)
        outs.append(r.out[0])
        denoms.append(r.denom[0])
    check_rows(thd.out, outs, INF, width=MAX_K)
    check_rows(thd.denom, denoms, INF)


def test_dense_indexer_score_recompute_thd_gradients_match_per_segment_bshd():
    q, k, w = (t.requires_grad_() for t in packed(seed=13))
    off = offsets(True)
    g = torch.Generator().manual_seed(3)
    cot_o, cot_d = torch.randn(TOTAL_Q, MAX_K, generator=g, dtype=F64), torch.randn(TOTAL_Q, generator=g, dtype=F64)

    def thd_loss():
        r = dense_indexer_score_recompute(q, k, w, ratio=4, q_causal_offsets=off, cu_seqlens_q=CU_Q,
                                          cu_seqlens_k=CU_K, **REF)
        return (finite(r.out) * cot_o).sum() + (finite(r.denom) * cot_d).sum()

    def seg_loss():
        total = 0
        for i, q0, q1, k0, k1 in segments():
            r = dense_indexer_score_recompute(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=4,
                                              q_causal_offsets=seg_off(off, i), **REF)
            total = total + (finite(r.out[0]) * cot_o[q0:q1, :k1 - k0]).sum() + \
                (finite(r.denom[0]) * cot_d[q0:q1]).sum()
        return total

    for a, b in zip(grads(thd_loss, (q, k, w)), grads(seg_loss, (q, k, w))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def attn_packed(h_q=4, h_kv=2, d=6, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return r(TOTAL_Q, h_q, d).to(dtype), r(TOTAL_K, h_kv, d).to(dtype), r(TOTAL_Q, h_q).abs() + 1.0


@pytest.mark.parametrize("h_kv,ratio,use_off", [(2, 1, False), (2, 4, True), (1, 3, True)])
def test_dense_attn_score_recompute_thd_equals_per_segment_bshd(h_kv, ratio, use_off):
    q, k, lse = attn_packed(h_kv=h_kv, seed=40 + ratio)
    off = offsets(use_off)
    out, denom = dense_attn_score_recompute(q, k, lse, 0.4, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=CU_Q,
                                            cu_seqlens_k=CU_K, **REF)
    assert out.shape == (TOTAL_Q, MAX_K) and denom.shape == (TOTAL_Q,) and out.dtype == F64
    outs, denoms = [], []
    for i, q0, q1, k0, k1 in segments():
        o, dn = dense_attn_score_recompute(q[None, q0:q1], k[None, k0:k1], lse[None, q0:q1], 0.4, ratio=ratio,
                                           q_causal_offsets=seg_off(off, i), **REF)
        outs.append(o[0])
        denoms.append(dn[0])
    check_rows(out, outs, INF, width=MAX_K)
    check_rows(denom, denoms, 0.0)


def test_dense_attn_score_recompute_thd_mqa_2d_keys_and_padded_batch():
    q, k, lse = attn_packed(h_kv=1, seed=9)
    off = offsets(True)
    kw = dict(ratio=4, q_causal_offsets=off, **REF)
    a = dense_attn_score_recompute(q, k[:, 0], lse, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **kw)
    b = dense_attn_score_recompute(q, k, lse, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **kw)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    max_q = max(LENS_Q)
    out, _ = dense_attn_score_recompute(stacked(q, CU_Q, max_q), stacked(k, CU_K, MAX_K), stacked(lse, CU_Q, max_q),
                                        **kw)
    check_rows(a[0], [out[i, :q1 - q0, :k1 - k0] for i, q0, q1, k0, k1 in segments()], INF, width=MAX_K,
               tol=1e-12)


# --- dense_indexer_backward (§10) ---------------------------------------------------------------------

@pytest.mark.parametrize("ratio,use_off,grad_loss", [(1, False, None), (4, True, 0.6)])
def test_dense_indexer_backward_thd_equals_per_segment_bshd(ratio, use_off, grad_loss):
    q, k, w = packed(seed=50 + ratio)
    off = offsets(use_off)
    gl = None if grad_loss is None else torch.tensor([grad_loss], dtype=F64)
    thd_kw = dict(ratio=ratio, q_causal_offsets=off, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    # The THD score pipeline feeds the THD backward directly.
    attn_q, attn_k, attn_lse = attn_packed(h_kv=1, seed=60 + ratio)
    attn, l1 = dense_attn_score_recompute(attn_q, attn_k, attn_lse, 0.5, **thd_kw)
    index = dense_indexer_score_recompute(q, k, w, sm_scale=0.8, **thd_kw)
    thd = dense_indexer_backward(q, w, k, attn, l1, index.out, index.denom, grad_loss=gl, sm_scale=0.8,
                                 loss_coeff=2.0, **thd_kw)
    assert thd.d_index_q.shape == q.shape and thd.d_weights.shape == w.shape and thd.d_index_k.shape == k.shape
    assert thd.d_index_q.abs().sum() > 0
    d_q, d_w, d_k = torch.zeros_like(q), torch.zeros_like(w), torch.zeros_like(k)
    for i, q0, q1, k0, k1 in segments():
        if q1 == q0:
            continue
        kl = k1 - k0
        # BSHD averages over its own B * S_q = q1 - q0 rows; THD over all TOTAL_Q packed rows.
        g = dense_indexer_backward(q[None, q0:q1], w[None, q0:q1], k[None, k0:k1], attn[None, q0:q1, :kl],
                                   l1[None, q0:q1], index.out[None, q0:q1, :kl], index.denom[None, q0:q1],
                                   grad_loss=gl, sm_scale=0.8, loss_coeff=2.0 * (q1 - q0) / TOTAL_Q, ratio=ratio,
                                   q_causal_offsets=seg_off(off, i), **REF)
        d_q[q0:q1], d_w[q0:q1], d_k[k0:k1] = g.d_index_q[0], g.d_weights[0], g.d_index_k[0]
    for a, b in zip(thd, (d_q, d_w, d_k)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    # Rows outside every segment, and keys no query segment reads, get no gradient.
    assert (thd.d_index_q[CU_Q[-1]:] == 0).all() and (thd.d_index_k[CU_K[-1]:] == 0).all()
    assert (thd.d_index_k[CU_K[4]:CU_K[5]] == 0).all()


def test_dense_indexer_backward_thd_ignores_wider_score_columns():
    q, k, w = packed(seed=70)
    kw = dict(ratio=4, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **REF)
    attn, l1 = dense_attn_score_recompute(*attn_packed(h_kv=1, seed=71), **kw)
    index = dense_indexer_score_recompute(q, k, w, **kw)
    a = dense_indexer_backward(q, w, k, attn, l1, index.out, index.denom, **kw)
    junk = torch.full((TOTAL_Q, 3), 5.0, dtype=F64)
    b = dense_indexer_backward(q, w, k, torch.cat([attn, junk], 1), l1, torch.cat([index.out, junk], 1),
                               index.denom, **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# --- validation -----------------------------------------------------------------------------------------

def _valid_calls():
    """op name -> (function, args, THD kwargs) for a small valid THD call."""
    q, k, w = packed(seed=1, dtype=torch.float32)
    aq, ak, alse = attn_packed(seed=2, dtype=torch.float32)
    alse = alse.float()
    scores = torch.zeros(TOTAL_Q, MAX_K)
    norm = torch.ones(TOTAL_Q)
    thd = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    return {
        "indexer_scores": (indexer_scores, (q, k, w), thd),
        "indexer_forward_topk": (indexer_forward_topk, (q, k, w, 2), thd),
        "dense_indexer_score_recompute": (dense_indexer_score_recompute, (q, k, w), thd),
        "dense_attn_score_recompute": (dense_attn_score_recompute, (aq, ak, alse), thd),
        "dense_indexer_backward": (dense_indexer_backward, (q, w, k, scores, norm, scores, norm), thd),
    }


OPS = list(_valid_calls())


def _cu_cases():
    """(kwarg, bad value, error type, text the message must contain)."""
    return [
        ("cu_seqlens_q", CU_Q.float(), TypeError, "cu_seqlens_q must have dtype"),
        ("cu_seqlens_k", CU_K.to(torch.int16), TypeError, "cu_seqlens_k must have dtype"),
        ("cu_seqlens_q", CU_Q[None], ValueError, "cu_seqlens_q must have 1 dimensions"),
        ("cu_seqlens_k", CU_K[:0], ValueError, "cu_seqlens_k must have B \\+ 1 >= 1 entries"),
        ("cu_seqlens_q", CU_Q + 1, ValueError, "cu_seqlens_q must start at 0"),
        ("cu_seqlens_k", torch.tensor([0, 3, 2, 5, 6, 7, 8], **I32), ValueError, "cu_seqlens_k must be non-decreasing"),
        ("cu_seqlens_q", torch.tensor([0, 6, 6, 7, 16, 16, TOTAL_Q + 1], **I32), ValueError,
         "cu_seqlens_q must end at or before total_q"),
        ("cu_seqlens_k", torch.tensor([0, 5, 5, 6, 13, 16, TOTAL_K + 1], **I32), ValueError,
         "cu_seqlens_k must end at or before total_k"),
        ("cu_seqlens_k", CU_K[:-1], ValueError, "cu_seqlens_k must have as many entries as cu_seqlens_q"),
        ("cu_seqlens_q", None, ValueError, "cu_seqlens_q is missing"),
        ("cu_seqlens_k", None, ValueError, "cu_seqlens_k is missing"),
        ("cu_seqlens_q", CU_Q.to("meta"), ValueError, "cu_seqlens_q must be on"),
        ("q_causal_offsets", torch.zeros(len(LENS_Q) + 1, **I32), ValueError, "q_causal_offsets"),
    ]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kwarg,bad,err,text", _cu_cases())
def test_thd_validation_errors_name_the_argument(op, kwarg, bad, err, text):
    fn, args, kw = _valid_calls()[op]
    kw = dict(kw, **{kwarg: bad})
    with pytest.raises(err, match=text):
        fn(*args, **kw, **REF)


@pytest.mark.parametrize("op", OPS)
def test_thd_valid_calls_run(op):
    fn, args, kw = _valid_calls()[op]
    fn(*args, **kw, **REF)


@pytest.mark.parametrize("op,arg,bad,text", [
    ("indexer_scores", 0, lambda a: a[0][None], "q_indexer must have 3 dimensions"),
    ("indexer_scores", 1, lambda a: a[1][:, None].expand(-1, 2, -1), "k_indexer must have H_kv = 1"),
    ("indexer_forward_topk", 2, lambda a: a[2][:-1], "weights must have shape"),
    ("dense_indexer_score_recompute", 1, lambda a: a[1][:, :-1], "k_indexer must have shape"),
    ("dense_attn_score_recompute", 0, lambda a: a[0][None], "q must have 3 dimensions"),
    ("dense_attn_score_recompute", 1, lambda a: a[1][:, :, :-1], "k must have shape"),
    ("dense_attn_score_recompute", 2, lambda a: a[2][:-1], "lse must have shape"),
    ("dense_indexer_backward", 2, lambda a: a[2][:, None], "index_k must have 2 dimensions"),
    ("dense_indexer_backward", 3, lambda a: a[3][:, :-1], "attn_score must have shape \\[total_q, W\\]"),
    ("dense_indexer_backward", 5, lambda a: a[5][:-1], "index_score must have shape \\[total_q, W\\]"),
    ("dense_indexer_backward", 4, lambda a: a[4][None], "attn_l1norm must have"),
    ("dense_indexer_backward", 6, lambda a: a[6][:-1], "index_lse must have shape"),
])
def test_thd_tensor_shape_errors_name_the_argument(op, arg, bad, text):
    fn, args, kw = _valid_calls()[op]
    args = list(args)
    args[arg] = bad(args)
    with pytest.raises(ValueError, match=text):
        fn(*args, **kw, **REF)


@pytest.mark.parametrize("op", OPS)
def test_thd_fused(op, monkeypatch):
    fn, args, kw = _valid_calls()[op]
    with pytest.raises(ValueError, match="fused"):  # CPU tensors: no fused kernel on the CPU
        fn(*args, **kw)
    if op == "indexer_scores":
        # Its fused kernels take THD: the call reaches them with int32 offsets and the [total_q, max_seqlen_k] shapes.
        seen = {}

        def fake(*a, **k):
            seen.update(k)
            return "scores", None

        monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda op, device: fake)
        assert fn(*args, **kw) == "scores"
        assert seen["cu_seqlens_q"].dtype == seen["cu_seqlens_k"].dtype == torch.int32
        assert torch.equal(seen["cu_seqlens_q"], kw["cu_seqlens_q"].int())
        ck = kw["cu_seqlens_k"]
        assert seen["shapes"] == ((args[0].shape[0], int((ck[1:] - ck[:-1]).max())), (args[0].shape[0],))
        return
    if op == "dense_indexer_score_recompute":
        # indexer_scores' kernels: int32 offsets, its output shapes, sm_scale passed through.
        seen = {}

        def fake_dense(*a, **k):
            seen.update(k)
            return "out", "denom"

        monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda op, device: fake_dense)
        assert tuple(fn(*args, **kw)) == ("out", "denom")
        assert seen["cu_seqlens_q"].dtype == seen["cu_seqlens_k"].dtype == torch.int32
        ck = kw["cu_seqlens_k"]
        assert seen["shapes"] == ((args[0].shape[0], int((ck[1:] - ck[:-1]).max())), (args[0].shape[0],))
        assert seen["sm_scale"] == kw.get("sm_scale", 1.0)
        return
    if op in ("dense_attn_score_recompute", "dense_indexer_backward"):
        # Their fused hosts take THD (one launch per segment): the call reaches them with the offsets.
        seen = {}

        def fake_host(*a, **k):
            seen.update(k)
            return ("out", "denom") if op == "dense_attn_score_recompute" else ("dq", "dw", "dk")

        monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda name, device: fake_host)
        assert tuple(fn(*args, **kw)) in (("out", "denom"), ("dq", "dw", "dk"))
        assert seen["cu_seqlens_q"] is kw["cu_seqlens_q"] and seen["cu_seqlens_k"] is kw["cu_seqlens_k"]
        return
    if op == "indexer_forward_topk":
        # Its fused kernels take THD too: int32 offsets and the longest segment's key count as the slab width.
        seen = {}

        def fake_topk(*a, **k):
            seen.update(k)
            return "ids", "logits", None, None

        monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda op, device: fake_topk)
        assert tuple(fn(*args, **kw)) == ("ids", "logits", None, None)
        assert seen["cu_seqlens_q"].dtype == seen["cu_seqlens_k"].dtype == torch.int32
        ck = kw["cu_seqlens_k"]
        assert seen["width"] == int((ck[1:] - ck[:-1]).max())
        return
    # Where a fused kernel exists, THD is refused explicitly rather than passed to a BSHD kernel.
    monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda op, device: lambda *a, **k: None)
    with pytest.raises(NotImplementedError, match="THD"):
        fn(*args, **kw)
