"""Reference sparse attention (cuDNN frontend DSA §1/§2/§7/§8, DeepSeek-V4 inference kernel): values against hand-computed cases and
brute-force per-row loops, edge cases, the explicit backward against autograd and gradcheck, and
every validation error."""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.reference import sparse_attention as ref

INF = float("inf")


# ----------------------------------------------------------------------------------------------------
# independent oracles


def brute_force(q, kv, idx, sink=None, length=None, scale=None, d_v=None):
    """Per-row, per-head Python loops in FP64: (out, lse, max_logits)."""
    s_q, h, d = q.shape
    d_v = d_v or (512 if d == 576 else d)
    scale = scale if scale is not None else 1 / math.sqrt(d)
    qd, kvd = q.double(), kv.double()
    out = torch.zeros(s_q, h, d_v, dtype=torch.float64)
    lse = torch.full((s_q, h), INF, dtype=torch.float64)
    mx = torch.full((s_q, h), -INF, dtype=torch.float64)
    k = idx.shape[1]
    for t in range(s_q):
        n = k if length is None else min(max(int(length[t]), 0), k)
        ids = [int(i) for i in idx[t, :n] if 0 <= int(i) < kv.shape[0]]
        if not ids:
            continue
        for hh in range(h):
            s = [scale * float(qd[t, hh] @ kvd[i]) for i in ids]
            m = max(s)
            z = sum(math.exp(x - m) for x in s)
            lse[t, hh] = m + math.log(z)
            mx[t, hh] = m
            total = lse[t, hh].item()
            if sink is not None:
                total = float(torch.logaddexp(torch.tensor(total), sink[hh].double()))
            for x, i in zip(s, ids):
                out[t, hh] += math.exp(x - total) * kvd[i, :d_v]
    return out, lse, mx


def plain_attention(q, kv, idx, sink=None, length=None, scale=None, d_v=None):
    """A plain differentiable formulation (dense gather + softmax with the sink as an extra column)."""
    s_q, h, d = q.shape
    d_v = d_v or (512 if d == 576 else d)
    scale = scale if scale is not None else 1 / math.sqrt(d)
    k = idx.shape[1]
    ids = idx.long()
    valid = (ids >= 0) & (ids < kv.shape[0])
    if length is not None:
        valid &= torch.arange(k) < length.long().clamp(0, k)[:, None]
    rows = kv[torch.where(valid, ids, 0)]                                   # (S_q, K, D)
    rows = torch.where(valid[..., None], rows, torch.zeros_like(rows))
    s = torch.einsum("thd,tkd->thk", q, rows) * scale
    s = torch.where(valid[:, None, :], s, torch.full_like(s, -INF))
    sink_col = (sink if sink is not None else torch.full((h,), -INF, dtype=q.dtype)).expand(s_q, h)
    logits = torch.cat([s, sink_col[..., None]], dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :k]
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("thk,tkv->thv", p, rows[..., :d_v])


def random_case(s_q=6, s_kv=9, h=3, d=8, k=7, dtype=torch.float64, seed=0, sink=True, length=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g, dtype=torch.float64).to(dtype)
    kv = torch.randn(s_kv, d, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.randint(-1, s_kv, (s_q, k), generator=g, dtype=torch.int32)
    if k >= 3 and s_q >= 3:
        idx[0, :2] = s_kv + 3          # out of range
        idx[0, 2] = -7                 # negative, not -1
        idx[1, :] = 2                  # duplicates
        idx[2, :] = -1                 # all invalid
    sk = torch.randn(h, generator=g, dtype=torch.float64).float() if sink else None
    ln = torch.randint(0, k + 2, (s_q,), generator=g, dtype=torch.int32) if length else None
    return q, kv, idx, sk, ln


def sa(*args, **kw):
    kw.setdefault("impl", "reference")
    return dsagen.sparse_attention(*args, **kw)


# ----------------------------------------------------------------------------------------------------
# forward values


def test_hand_computed_case():
    q = torch.tensor([[[1.0, 0.0]]])
    kv = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    idx = torch.tensor([[0, 2]], dtype=torch.int32)
    e1, e2 = math.e, math.e ** 2
    out, lse, mx = sa(q, kv, idx, softmax_scale=1.0)
    assert torch.allclose(out, torch.tensor([[[(e1 * 1 + e2 * 2) / (e1 + e2), 0.0]]]))
    assert lse.item() == pytest.approx(math.log(e1 + e2))
    assert mx.item() == pytest.approx(2.0)
    # A sink of 0 adds exp(0) = 1 to the denominator only; lse and max_logits do not change.
    out, lse, mx = sa(q, kv, idx, softmax_scale=1.0, attn_sink=torch.zeros(1))
    assert torch.allclose(out, torch.tensor([[[(e1 * 1 + e2 * 2) / (e1 + e2 + 1), 0.0]]]))
    assert lse.item() == pytest.approx(math.log(e1 + e2))
    assert mx.item() == pytest.approx(2.0)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("length", [False, True])
@pytest.mark.parametrize("d,d_v", [(8, None), (8, 5), (12, 1)])
def test_matches_brute_force(sink, length, d, d_v):
    q, kv, idx, sk, ln = random_case(d=d, sink=sink, length=length, seed=d + 10 * sink + 100 * length)
    out, lse, mx = sa(q, kv, idx, attn_sink=sk, topk_length=ln, softmax_scale=0.37, d_v=d_v)
    e_out, e_lse, e_mx = brute_force(q, kv, idx, sk, ln, 0.37, d_v)
    assert out.shape == e_out.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, e_out)
    torch.testing.assert_close(lse, e_lse)
    torch.testing.assert_close(mx, e_mx)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_against_fp64(dtype, tol):
    q, kv, idx, sk, ln = random_case(s_q=9, s_kv=20, h=4, d=16, k=11, dtype=dtype, seed=3)
    out, lse, mx = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    assert out.dtype == dtype and lse.dtype == torch.float32 and mx.dtype == torch.float32
    e_out, e_lse, e_mx = sa(q.double(), kv.double(), idx, attn_sink=sk, topk_length=ln)
    torch.testing.assert_close(out.double(), e_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), e_lse, atol=1e-5, rtol=1e-5)   # FP32 accumulation
    torch.testing.assert_close(mx.double(), e_mx, atol=1e-5, rtol=1e-5)


def test_empty_rows_and_padding_semantics():
    q, kv, idx, sk, _ = random_case(seed=5)
    ln = torch.tensor([7, 7, 7, 0, -3, 100], dtype=torch.int32)  # 0 and negative: empty rows; 100 clamps
    out, lse, mx = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    for row in (2, 3, 4):  # row 2 holds only -1
        assert torch.all(out[row] == 0)
        assert torch.all(lse[row] == INF) and torch.all(mx[row] == -INF)
    e_out, e_lse, _ = brute_force(q, kv, idx, sk, ln)
    torch.testing.assert_close(out, e_out)
    torch.testing.assert_close(lse, e_lse)
    # duplicates are distinct slots: row 1 holds id 2 seven times -> lse = s + log 7
    s = (q[1].double() @ kv[2].double()) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse[1], s + math.log(7))


def test_topk_length_ignores_valid_ids_after_it():
    q, kv, _, sk, _ = random_case(seed=6)
    idx = torch.arange(7, dtype=torch.int32).repeat(6, 1)
    ln = torch.tensor([3] * 6, dtype=torch.int32)
    out, lse, _ = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    e_out, e_lse, _ = sa(q, kv, idx[:, :3], attn_sink=sk)
    torch.testing.assert_close(out, e_out)
    torch.testing.assert_close(lse, e_lse)


def test_nonfinite_kv_behind_invalid_slots_does_not_leak():
    # Invalid slots must never be read: not the row they would clamp to (0), not a row past topk_length.
    q, kv, _, sk, _ = random_case(seed=7, length=False)
    kv = kv.clone()
    kv[0] = float("nan")
    kv[4] = float("inf")
    idx = torch.tensor([[1, 2, -1, 3, 4]] * 6, dtype=torch.int32)
    idx[1, 2] = 99                                             # out of range
    ln = torch.full((6,), 4, dtype=torch.int32)                # slot 4 (id 4, an inf row) is ignored
    out, lse, mx = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and torch.isfinite(mx).all()
    torch.testing.assert_close(out, brute_force(q, kv, idx, sk, ln)[0])
    dq, dkv, ds = ref.sparse_attention_backward(q, kv, out, torch.ones_like(out), lse, sk.double(), idx,
                                                topk_length=ln)
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all() and torch.isfinite(ds).all()


def test_k_zero_single_row_and_empty_kv():
    q = torch.randn(1, 2, 4)
    out, lse, mx = sa(q, torch.randn(5, 4), torch.zeros(1, 0, dtype=torch.int32), attn_sink=torch.zeros(2))
    assert out.shape == (1, 2, 4) and torch.all(out == 0)
    assert torch.all(lse == INF) and torch.all(mx == -INF)
    out, lse, mx = sa(q, torch.randn(0, 4), torch.tensor([[0, -1, 3]], dtype=torch.int32))
    assert torch.all(out == 0) and torch.all(lse == INF)
    out, lse, mx = sa(torch.randn(0, 2, 4), torch.randn(5, 4), torch.zeros(0, 3, dtype=torch.int32))
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)


def test_defaults_d_v_and_scale():
    q, kv, idx, sk, _ = random_case(s_q=3, s_kv=5, h=2, d=576, k=4, dtype=torch.float32, seed=8)
    out, lse, _ = sa(q, kv, idx, attn_sink=sk)
    assert out.shape == (3, 2, 512)
    e_out, e_lse, _ = brute_force(q, kv, idx, sk, None, 1 / math.sqrt(576), 512)
    torch.testing.assert_close(out.double(), e_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), e_lse, atol=1e-5, rtol=1e-5)
    q, kv, idx, _, _ = random_case(d=6, seed=9)
    assert sa(q, kv, idx)[0].shape[-1] == 6


def test_chunking_gives_the_same_result(monkeypatch):
    q, kv, idx, sk, ln = random_case(s_q=13, seed=10)
    full = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 1)  # one row per chunk
    chunked = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    for a, b in zip(full, chunked):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V4 inference kernel's batched layout


def test_batched_layout_matches_flat_per_batch():
    g = torch.Generator().manual_seed(11)
    b, t, h, d, n, k = 3, 4, 2, 8, 5, 6
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, n + 3, (b, t, k), generator=g, dtype=torch.int32)  # ids >= n must not alias
    sk = torch.randn(h, generator=g)
    ln = torch.randint(0, k + 1, (b, t), generator=g, dtype=torch.int32)
    out, lse, mx = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    assert out.shape == (b, t, h, d) and lse.shape == (b, t, h) and mx.shape == (b, t, h)
    for bi in range(b):
        e_out, e_lse, e_mx = brute_force(q[bi], kv[bi], idx[bi], sk, ln[bi])
        torch.testing.assert_close(out[bi], e_out)
        torch.testing.assert_close(lse[bi], e_lse)
        torch.testing.assert_close(mx[bi], e_mx)


def test_batched_gradcheck():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    sk = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 5, (2, 3, 3), generator=g, dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b, c: sa(a, b, idx, attn_sink=c, d_v=3)[0], (q, kv, sk))


# ----------------------------------------------------------------------------------------------------
# backward


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("length", [False, True])
def test_backward_matches_autograd_of_plain_formulation(sink, length):
    q, kv, idx, sk, ln = random_case(s_q=7, s_kv=10, h=3, d=9, k=8, sink=sink, length=length, seed=13)
    sk = None if sk is None else sk.double()
    d_v = 6
    inputs = [q.clone().requires_grad_(), kv.clone().requires_grad_()]
    if sk is not None:
        inputs.append(sk.clone().requires_grad_())
    dout = torch.randn(7, 3, d_v, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = sa(inputs[0], inputs[1], idx, attn_sink=inputs[2] if sk is not None else None,
             topk_length=ln, softmax_scale=0.41, d_v=d_v)[0]
    grads = torch.autograd.grad(out, inputs, dout)
    plain_in = [x.detach().clone().requires_grad_() for x in inputs]
    e_out = plain_attention(plain_in[0], plain_in[1], idx, plain_in[2] if sk is not None else None,
                            ln, 0.41, d_v)
    torch.testing.assert_close(out, e_out)
    e_grads = torch.autograd.grad(e_out, plain_in, dout)
    for got, want in zip(grads, e_grads):
        torch.testing.assert_close(got, want)


def test_gradcheck_fp64_with_sink_lengths_duplicates_and_empty_rows():
    q, kv, idx, sk, ln = random_case(s_q=5, s_kv=6, h=2, d=5, k=5, seed=14)
    args = (q.requires_grad_(), kv.requires_grad_(), sk.double().requires_grad_())
    fn = lambda a, b, c: sa(a, b, idx, attn_sink=c, topk_length=ln, softmax_scale=0.6, d_v=4)[0]
    assert torch.autograd.gradcheck(fn, args)


def test_d_sink_formula_directly():
    """d_sink = -sum_t p_sink * delta, checked against a finite difference of <out, dout>."""
    q, kv, idx, sk, _ = random_case(s_q=4, s_kv=6, h=2, d=4, k=4, seed=15)
    sk = sk.double()
    dout = torch.randn(4, 2, 4, dtype=torch.float64)
    out, lse, _ = ref.sparse_attention_forward(q, kv, idx, attn_sink=sk)
    _, _, d_sink = ref.sparse_attention_backward(q, kv, out, dout, lse, sk, idx)
    eps = 1e-6
    for hh in range(2):
        bump = torch.zeros(2, dtype=torch.float64)
        bump[hh] = eps
        up = (ref.sparse_attention_forward(q, kv, idx, attn_sink=sk + bump)[0] * dout).sum()
        down = (ref.sparse_attention_forward(q, kv, idx, attn_sink=sk - bump)[0] * dout).sum()
        assert d_sink[hh].item() == pytest.approx(((up - down) / (2 * eps)).item(), rel=1e-6, abs=1e-9)


def test_backward_dtypes_low_precision_and_no_grad_to_invalid_rows():
    q, kv, idx, sk, ln = random_case(s_q=6, s_kv=12, h=2, d=8, k=5, dtype=torch.bfloat16, seed=16)
    q.requires_grad_()
    kv.requires_grad_()
    sk.requires_grad_()
    out, _, _ = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and kv.grad.dtype == torch.bfloat16 and sk.grad.dtype == torch.float32
    n = torch.arange(5)[None, :] < ln.long().clamp(0, 5)[:, None]
    used = set(int(i) for i in idx[n & (idx >= 0) & (idx < 12)])
    for row in range(12):
        if row not in used:
            assert torch.all(kv.grad[row] == 0), row
    # against the FP64 explicit backward
    q64, kv64, sk64 = (x.detach().double().requires_grad_() for x in (q, kv, sk))
    sa(q64, kv64, idx, attn_sink=sk64, topk_length=ln)[0].sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(kv.grad.double(), kv64.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(sk.grad.double(), sk64.grad, atol=1e-2, rtol=1e-2)


def test_lse_and_max_logits_are_not_differentiable():
    q, kv, idx, _, _ = random_case(seed=17)
    q.requires_grad_()
    out, lse, mx = sa(q, kv, idx)
    assert out.requires_grad and not lse.requires_grad and not mx.requires_grad


# ----------------------------------------------------------------------------------------------------
# score recompute


def brute_sparse_target(q, k, lse, ids, scale, length=None, global_ids=False):
    b, s_q, h, d = q.shape
    s_k, topk = k.shape[1], ids.shape[-1]
    out = torch.zeros(b, s_q, topk, dtype=torch.float64)
    kf = k.double().reshape(b * s_k, d)
    for bi in range(b):
        for t in range(s_q):
            n = topk if length is None else min(max(int(length[bi, t]), 0), topk)
            row = []
            for i in range(topk):
                j = int(ids[bi, t, i])
                ok = i < n and (0 <= j < b * s_k if global_ids else 0 <= j < s_k)
                flat = j if global_ids else bi * s_k + j
                row.append(sum(math.exp(scale * float(q[bi, t, hh].double() @ kf[flat]) - float(lse[bi, t, hh]))
                               for hh in range(h)) if ok else 0.0)
            z = sum(row)
            if z > 0:
                out[bi, t] = torch.tensor(row) / z
    return out


def recompute_case(seed=20, b=2, s_q=4, s_k=6, h=3, d=5, topk=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s_k, d, generator=g, dtype=torch.float64)
    lse = torch.randn(b, s_q, h, generator=g, dtype=torch.float64)
    ids = torch.randint(-1, s_k + 2, (b, s_q, topk), generator=g, dtype=torch.int32)
    ids[0, 0] = -1
    ln = torch.randint(0, topk + 1, (b, s_q), generator=g, dtype=torch.int32)
    return q, k, lse, ids, ln


@pytest.mark.parametrize("use_length", [False, True])
def test_sparse_attn_score_recompute_brute_force(use_length):
    q, k, lse, ids, ln = recompute_case()
    ln = ln if use_length else None
    got = dsagen.sparse_attn_score_recompute(q, k, lse, ids, 0.7, topk_length=ln, impl="reference")
    torch.testing.assert_close(got, brute_sparse_target(q, k, lse, ids, 0.7, ln))
    assert torch.all(got[0, 0] == 0)  # all -1 row
    # global ids b * S_k + local give the same result; local ids >= S_k never alias the next batch
    glob = torch.where((ids >= 0) & (ids < 6), ids + torch.arange(2).view(2, 1, 1) * 6, -1).int()
    got_g = dsagen.sparse_attn_score_recompute(q, k, lse, glob, 0.7, topk_length=ln, topk_indices_global=True,
                                               impl="reference")
    torch.testing.assert_close(got_g, got)
    cross = torch.full_like(ids, -1)
    cross[0, :, 0] = 7  # a valid *global* id into batch 1
    got_c = dsagen.sparse_attn_score_recompute(q, k, lse, cross, 0.7, topk_indices_global=True, impl="reference")
    torch.testing.assert_close(got_c, brute_sparse_target(q, k, lse, cross, 0.7, global_ids=True))
    assert torch.all(dsagen.sparse_attn_score_recompute(q, k, lse, cross, 0.7, impl="reference") == 0)


def test_sparse_attn_score_recompute_consistent_with_forward_lse():
    """With the forward's KV-only lse, each head's probabilities sum to 1: target = head mean of P."""
    q, kv, idx, _, _ = random_case(s_q=5, s_kv=8, h=3, d=6, k=6, sink=False, length=False, seed=21)
    idx[:3, 0] = 1  # keep every row non-empty
    _, lse, _ = sa(q, kv, idx)
    target = dsagen.sparse_attn_score_recompute(q[None], kv[None], lse[None], idx[None], impl="reference")[0]
    ok = (idx >= 0) & (idx < 8)
    s = torch.einsum("thd,tkd->thk", q, kv[torch.where(ok, idx, 0).long()]) / math.sqrt(6)
    p = torch.where(ok[:, None, :], torch.exp(s - lse[..., None]), 0)
    torch.testing.assert_close(target, p.sum(1) / 3)
    torch.testing.assert_close(target.sum(-1), torch.ones(5, dtype=torch.float64))


def brute_dense(q, k4, lse, scale, ratio, offsets):
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k4.shape[1], k4.shape[2]
    g = h_q // h_kv
    out = torch.full((b, s_q, s_k), -INF, dtype=torch.float64)
    for bi in range(b):
        for t in range(s_q):
            off = 0 if offsets is None else int(offsets[bi])
            lim = min(max((off + t + 1) // ratio, 0), s_k)
            for s in range(lim):
                out[bi, t, s] = sum(math.exp(scale * float(q[bi, t, hh] @ k4[bi, s, hh // g]) - float(lse[bi, t, hh]))
                                    for hh in range(h_q))
    denom = torch.where(torch.isfinite(out), out, 0).sum(-1)
    return out, denom


@pytest.mark.parametrize("ratio,offsets", [(1, None), (2, [0, 3]), (3, [5, -4])])
def test_dense_attn_score_recompute_brute_force(ratio, offsets):
    g = torch.Generator().manual_seed(22)
    q = torch.randn(2, 5, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(2, 4, 2, 3, generator=g, dtype=torch.float64)
    lse = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    off = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    out, denom = dsagen.dense_attn_score_recompute(q, k, lse, 0.5, ratio=ratio, q_causal_offsets=off,
                                                   impl="reference")
    e_out, e_denom = brute_dense(q, k, lse, 0.5, ratio, off)
    torch.testing.assert_close(out, e_out)
    torch.testing.assert_close(denom, e_denom)


def test_dense_attn_score_recompute_mqa_3d_key_and_fp32():
    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 6, 2, 4, generator=g)
    k = torch.randn(1, 6, 4, generator=g)
    lse = torch.randn(1, 6, 2, generator=g)
    out, denom = dsagen.dense_attn_score_recompute(q, k, lse, impl="reference")
    assert out.dtype == torch.float32 and denom.shape == (1, 6)
    e_out, e_denom = brute_dense(q.double(), k.double()[:, :, None], lse.double(), 0.5, 1, None)
    torch.testing.assert_close(out.double(), e_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(denom.double(), e_denom, atol=1e-5, rtol=1e-5)
    assert out[0, 0, 1] == -INF and torch.isfinite(out[0, 5]).all()


# ----------------------------------------------------------------------------------------------------
# dispatch and validation


def _inputs():
    q, kv, idx, sk, ln = random_case(dtype=torch.float32, seed=30)
    return dict(q=q, kv=kv, idx=idx, sk=sk, ln=ln)


def test_fused_on_cpu_raises_value_error_and_is_the_default():
    x = _inputs()
    with pytest.raises(ValueError, match="sparse_attention"):
        dsagen.sparse_attention(x["q"], x["kv"], x["idx"], impl="fused")
    with pytest.raises(ValueError, match="impl='fused'"):
        dsagen.sparse_attention(x["q"], x["kv"], x["idx"])  # default impl is "fused"
    q, k, lse, ids, _ = recompute_case()
    with pytest.raises(ValueError, match="sparse_attn_score_recompute"):
        dsagen.sparse_attn_score_recompute(q, k, lse, ids)
    with pytest.raises(ValueError, match="dense_attn_score_recompute"):
        dsagen.dense_attn_score_recompute(q, k, lse)


def _bad(name):
    x = _inputs()
    q, kv, idx, sk, ln = x["q"], x["kv"], x["idx"], x["sk"], x["ln"]
    cases = {
        "impl": (lambda: sa(q, kv, idx, impl="cuda"), ValueError),
        "q": (lambda: sa(q[0], kv, idx), ValueError),
        "q-type": (lambda: sa(q.tolist(), kv, idx), TypeError),
        "q-dtype": (lambda: sa(q.int(), kv, idx), TypeError),
        "kv": (lambda: sa(q, kv.double(), idx), TypeError),
        "kv-shape": (lambda: sa(q, kv[:, :3], idx), ValueError),
        "kv-batch": (lambda: sa(q[None].expand(2, -1, -1, -1), kv[None].expand(3, -1, -1), idx[None].expand(2, -1, -1)), ValueError),
        "topk_idxs": (lambda: sa(q, kv, idx.long()), TypeError),
        "topk_idxs-shape": (lambda: sa(q, kv, idx[:3]), ValueError),
        "attn_sink": (lambda: sa(q, kv, idx, attn_sink=sk[:2]), ValueError),
        "attn_sink-dtype": (lambda: sa(q, kv, idx, attn_sink=sk.half()), TypeError),
        "topk_length": (lambda: sa(q, kv, idx, topk_length=ln[:2]), ValueError),
        "topk_length-dtype": (lambda: sa(q, kv, idx, topk_length=ln.long()), TypeError),
        "softmax_scale": (lambda: sa(q, kv, idx, softmax_scale=float("nan")), ValueError),
        "softmax_scale-type": (lambda: sa(q, kv, idx, softmax_scale="1"), TypeError),
        "d_v": (lambda: sa(q, kv, idx, d_v=9), ValueError),
        "d_v-type": (lambda: sa(q, kv, idx, d_v=2.0), TypeError),
    }
    return cases[name]


@pytest.mark.parametrize("case", ["impl", "q", "q-type", "q-dtype", "kv", "kv-shape", "kv-batch", "topk_idxs",
                                  "topk_idxs-shape", "attn_sink", "attn_sink-dtype", "topk_length",
                                  "topk_length-dtype", "softmax_scale", "softmax_scale-type", "d_v", "d_v-type"])
def test_sparse_attention_validation_names_the_argument(case):
    fn, exc = _bad(case)
    with pytest.raises(exc, match=case.split("-")[0]):
        fn()


def test_recompute_validation_names_the_argument():
    q, k, lse, ids, ln = recompute_case()
    r = dict(impl="reference")
    checks = [
        (lambda: dsagen.sparse_attn_score_recompute(q[0], k, lse, ids, **r), ValueError, "q_attn"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k.float(), lse, ids, **r), TypeError, "k_attn"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k[:1], lse, ids, **r), ValueError, "k_attn"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse[..., :2], ids, **r), ValueError, "lse"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse, ids.long(), **r), TypeError, "topk_indices"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse, ids[:, :2], **r), ValueError, "topk_indices"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse, ids, topk_length=ln[0], **r), ValueError,
         "topk_length"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse, ids, topk_indices_global=1, **r), TypeError,
         "topk_indices_global"),
        (lambda: dsagen.sparse_attn_score_recompute(q, k, lse, ids, float("inf"), **r), ValueError, "softmax_scale"),
        (lambda: dsagen.dense_attn_score_recompute(q, k[:, :, None].expand(-1, -1, 2, -1), lse, **r), ValueError,
         "k"),
        (lambda: dsagen.dense_attn_score_recompute(q, k, lse.float(), ratio=0, **r), ValueError, "ratio"),
        (lambda: dsagen.dense_attn_score_recompute(q, k, lse, q_causal_offsets=torch.zeros(3, dtype=torch.int32),
                                                   **r), ValueError, "q_causal_offsets"),
        (lambda: dsagen.dense_attn_score_recompute(q, k, lse[:, :1], **r), ValueError, "lse"),
        (lambda: dsagen.dense_attn_score_recompute(q, k, lse, impl="nope"), ValueError, "impl"),
    ]
    for fn, exc, name in checks:
        with pytest.raises(exc, match=name):
            fn()


@pytest.mark.parametrize("grad_input", ["none", "q", "kv", "sink", "no_grad_mode"])
def test_autograd_only_when_a_gradient_can_flow(grad_input):
    """The op runs its autograd Function only when grad mode is on and q, kv or attn_sink requires grad (else the
    forward alone: no grad_fn, the same outputs); sink-only gradients still flow."""
    q, kv, idx, sk, ln = random_case(s_q=5, s_kv=9, h=2, d=6, k=4, seed=17)
    sk = sk.double()
    want = sa(q, kv, idx, attn_sink=sk, topk_length=ln, d_v=4)
    args = {"q": q.clone(), "kv": kv.clone(), "sink": sk.clone()}
    if grad_input in args:
        args[grad_input].requires_grad_()
    if grad_input == "no_grad_mode":
        for t in args.values():
            t.requires_grad_()
        with torch.no_grad():
            got = sa(args["q"], args["kv"], idx, attn_sink=args["sink"], topk_length=ln, d_v=4)
    else:
        got = sa(args["q"], args["kv"], idx, attn_sink=args["sink"], topk_length=ln, d_v=4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert (got[0].grad_fn is not None) == (grad_input in args)
    if grad_input in args:
        (grad,) = torch.autograd.grad(got[0].sum(), [args[grad_input]])
        assert grad.shape == args[grad_input].shape and torch.isfinite(grad).all()
