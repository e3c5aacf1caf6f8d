"""cuDNN frontend DSA indexer ops, impl="reference": indexer_scores, indexer_topk, indexer_forward_topk,
sparse/dense indexer score recompute, and the two backward ops checked against autograd (and finite
differences) of the indexer KL loss written out independently here."""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.ops.indexer import indexer_forward_topk, indexer_scores, indexer_topk
from dsagen.ops.indexer_training import (dense_indexer_backward, dense_indexer_score_recompute, indexer_backward,
                                         sparse_indexer_score_recompute)

REF = dict(impl="reference")
F64 = dict(dtype=torch.float64)
I32 = dict(dtype=torch.int32)


def randn(*shape, g, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def inputs(b=2, sq=7, sk=7, h=3, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return randn(b, sq, h, d, g=g, dtype=dtype), randn(b, sk, d, g=g, dtype=dtype), randn(b, sq, h, g=g, dtype=dtype)


# --- independent brute force ---------------------------------------------------------------------------

def brute_score(q, k, w, b, t, s):
    """sum_h w * relu(q . k) for one pair, in float64 Python arithmetic."""
    return sum(float(w[b, t, h]) * max(0.0, float(torch.dot(q[b, t, h].double(), k[b, s].double())))
               for h in range(q.shape[2]))


def brute_limit(t, s_k, ratio, offset=0):
    return min(max((offset + t + 1) // ratio, 0), s_k)


def ranked(vals, cols, top_k):
    """cols sorted by descending value, ties toward the lower col, -1 padded to top_k."""
    ids = sorted(cols, key=lambda c: (-vals[c], c))[:top_k]
    return ids + [-1] * (top_k - len(ids))


# --- indexer_scores -------------------------------------------------------------------------------------

def test_indexer_scores_hand_computed():
    # H = 2, D = 1: row 0 = [1, 1, 2], row 1 = [0, 0, 0], row 2 = [1, 2, 2] before masking (ratio 1).
    q = torch.tensor([[[1.0], [-1.0]], [[1.0], [1.0]], [[-1.0], [1.0]]], **F64)[None]
    k = torch.tensor([[1.0], [-1.0], [2.0]], **F64)[None]
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0], [2.0, 1.0]], **F64)[None]
    inf = float("-inf")
    assert indexer_scores(q, k, w, **REF)[0].tolist() == [[1, inf, inf], [0, 0, inf], [1, 2, 2]]
    # ratio 2, offset 3: row t sees k < (3 + t + 1) // 2 = 2, 2, 3
    off = torch.tensor([3], **I32)
    assert indexer_scores(q, k, w, ratio=2, q_causal_offsets=off, **REF)[0].tolist() == \
        [[1, 1, inf], [0, 0, inf], [1, 2, 2]]


@pytest.mark.parametrize("ratio,offsets", [(1, None), (2, None), (4, [0, 5]), (3, [-4, 20])])
def test_indexer_scores_random_matches_brute_force(ratio, offsets):
    q, k, w = inputs(sq=9, sk=5, seed=ratio)
    off = None if offsets is None else torch.tensor(offsets, **I32)
    out = indexer_scores(q, k, w, ratio=ratio, q_causal_offsets=off, **REF)
    assert out.shape == (2, 9, 5) and out.dtype == torch.float64
    for b in range(2):
        for t in range(9):
            lim = brute_limit(t, 5, ratio, 0 if offsets is None else offsets[b])
            for s in range(5):
                if s < lim:
                    assert out[b, t, s].item() == pytest.approx(brute_score(q, k, w, b, t, s), abs=1e-12)
                else:
                    assert out[b, t, s].item() == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_indexer_scores_low_precision_is_fp32_and_matches_fp64(dtype):
    q, k, w = inputs(sq=6, sk=6, h=4, d=8, seed=2, dtype=dtype)
    out = indexer_scores(q, k, w, **REF)
    assert out.dtype == torch.float32
    ref = indexer_scores(q.double(), k.double(), w.double(), **REF)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_indexer_scores_accepts_4d_mqa_keys():
    q, k, w = inputs(seed=3)
    assert torch.equal(indexer_scores(q, k.unsqueeze(2), w, **REF), indexer_scores(q, k, w, **REF))


def test_indexer_scores_gradcheck():
    q, k, w = inputs(b=1, sq=4, sk=4, h=2, d=3, seed=4)
    valid = torch.isfinite(indexer_scores(q, k, w, **REF))
    q, k, w = (x.requires_grad_() for x in (q, k, w))
    assert torch.autograd.gradcheck(lambda q, k, w: indexer_scores(q, k, w, **REF)[valid], (q, k, w))


# --- indexer_topk ---------------------------------------------------------------------------------------

def test_indexer_topk_hand_computed():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 9.0, 8.0, 7.0]])
    res = indexer_topk(x, torch.tensor([5, 3, 2], **I32), 3, **REF)
    assert res.indices.tolist() == [[1, 3, 2], [0, 1, 2], [0, 1, -1]]
    assert res.values.tolist() == [[3.0, 3.0, 2.0], [5.0, 5.0, 5.0], [0.0, -1.0, float("-inf")]]
    assert res.indices.dtype == torch.int32 and res.values.dtype == torch.float32


def test_indexer_topk_groups_lengths_and_widths():
    g = torch.Generator().manual_seed(6)
    x = randn(6, 10, g=g, dtype=torch.float32)
    lens = torch.tensor([4, -2, 30], **I32)        # groups of 2 rows; negative -> 0, > cols -> cols
    res = indexer_topk(x, lens, 12, **REF)
    for r in range(6):
        n = [4, 0, 10][r // 2]
        want = ranked(x[r].tolist(), range(n), 12)
        assert res.indices[r].tolist() == want
    assert indexer_topk(x, lens, 3, return_values=False, **REF).values is None
    assert indexer_topk(x, lens, 0, **REF).indices.shape == (6, 0)
    assert indexer_topk(x[:0], torch.zeros(0, **I32), 2, **REF).indices.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_indexer_topk_random_matches_brute_force(dtype):
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-4, 5, (9, 13), generator=g).to(dtype)  # many exact ties
    lens = torch.randint(0, 14, (9,), generator=g, **I32)
    res = indexer_topk(x, lens, 5, **REF)
    assert res.values.dtype == dtype
    for r in range(9):
        want = ranked(x[r].tolist(), range(int(lens[r])), 5)
        assert res.indices[r].tolist() == want
        assert res.values[r].tolist() == [x[r, c].item() if c >= 0 else float("-inf") for c in want]


# --- indexer_forward_topk -------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,offsets,top_k", [(1, None, 3), (2, [1, 0], 4), (3, [-3, 7], 9), (1, None, 0)])
@pytest.mark.parametrize("global_ids", [True, False])
def test_indexer_forward_topk_matches_brute_force(ratio, offsets, top_k, global_ids):
    b, sq, sk = 2, 8, 6
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=10 + ratio)
    off = None if offsets is None else torch.tensor(offsets, **I32)
    res = indexer_forward_topk(q, k, w, top_k, ratio=ratio, q_causal_offsets=off, return_lse=True,
                               topk_indices_global=global_ids, **REF)
    assert res.indices.shape == (b, sq, top_k) and res.indices.dtype == torch.int32
    for bb in range(b):
        for t in range(sq):
            lim = brute_limit(t, sk, ratio, 0 if offsets is None else offsets[bb])
            vals = {s: brute_score(q, k, w, bb, t, s) for s in range(lim)}
            want = ranked(vals, range(lim), top_k)
            base = bb * sk if global_ids else 0
            assert res.indices[bb, t].tolist() == [s + base if s >= 0 else -1 for s in want]
            chosen = [vals[s] for s in want if s >= 0]
            logits = res.logits[bb, t].tolist()
            assert logits[:len(chosen)] == pytest.approx(chosen, abs=1e-12)
            assert all(x == float("-inf") for x in logits[len(chosen):])
            if chosen:
                m = max(chosen)
                z = sum(math.exp(c - m) for c in chosen)
                assert res.softmax[bb, t, :len(chosen)].tolist() == pytest.approx([math.exp(c - m) / z for c in chosen])
                assert res.lse[bb, t].item() == pytest.approx(m + math.log(z))
            else:
                assert res.lse[bb, t].item() == float("-inf")
            assert (res.softmax[bb, t, len(chosen):] == 0).all()


def test_indexer_forward_topk_optional_outputs_and_fp32():
    q, k, w = inputs(seed=12, dtype=torch.bfloat16)
    res = indexer_forward_topk(q, k, w, 3, return_softmax=False, **REF)
    assert res.softmax is None and res.lse is None and res.logits.dtype == torch.float32
    ref = indexer_forward_topk(q.double(), k.double(), w.double(), 3, **REF)
    assert torch.equal(res.indices, ref.indices)
    torch.testing.assert_close(res.logits.double(), ref.logits, rtol=1e-5, atol=1e-5)


def test_indexer_forward_topk_gradcheck():
    q, k, w = inputs(b=1, sq=4, sk=4, h=2, d=3, seed=13)
    q, k, w = (x.requires_grad_() for x in (q, k, w))

    def fn(q, k, w):
        res = indexer_forward_topk(q, k, w, 2, return_lse=True, **REF)
        valid = res.indices >= 0
        return res.logits[valid], res.softmax, res.lse

    assert torch.autograd.gradcheck(fn, (q, k, w))


# --- sparse / dense indexer score recompute -------------------------------------------------------------

def test_sparse_recompute_matches_brute_force():
    b, sq, sk, kk = 2, 5, 6, 5
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=20)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(-2, sk + 2, (b, sq, kk), generator=g, **I32)   # includes -1, -2, >= S_k
    ids[0, 0] = torch.tensor([3, 3, 0, -1, 5])                          # duplicates are distinct slots
    length = torch.randint(0, kk + 2, (b, sq), generator=g, **I32)
    for scale in (1.0, 0.3):
        for use_len in (False, True):
            p = sparse_indexer_score_recompute(q, k, w, ids, topk_length=length if use_len else None,
                                               sm_scale=scale, **REF)
            for bb in range(b):
                for t in range(sq):
                    slots = [i for i in range(kk) if 0 <= ids[bb, t, i] < sk and (not use_len or i < length[bb, t])]
                    logit = {i: scale * brute_score(q, k, w, bb, t, int(ids[bb, t, i])) for i in slots}
                    z = sum(math.exp(v) for v in logit.values())
                    want = [math.exp(logit[i]) / z if i in logit else 0.0 for i in range(kk)]
                    assert p[bb, t].tolist() == pytest.approx(want, abs=1e-12)


def test_sparse_recompute_global_ids_never_alias_other_batches():
    b, sq, sk = 2, 3, 4
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=22)
    local = torch.tensor([[0, 2, -1], [1, 3, 0], [2, 2, 1]], **I32).expand(b, sq, 3).contiguous()
    glob = torch.where(local >= 0, local + torch.arange(b, **I32).view(b, 1, 1) * sk, local)
    p_local = sparse_indexer_score_recompute(q, k, w, local, **REF)
    assert torch.equal(sparse_indexer_score_recompute(q, k, w, glob, topk_indices_global=True, **REF), p_local)
    # batch 1 pointing at batch 0's global ids (local ids of batch 0) -> invalid slots
    cross = glob.clone()
    cross[1] = local[0]
    p = sparse_indexer_score_recompute(q, k, w, cross, topk_indices_global=True, **REF)
    assert (p[1] == 0).all() and torch.equal(p[0], p_local[0])


def test_sparse_recompute_low_precision_vs_fp64():
    q, k, w = inputs(seed=23, dtype=torch.bfloat16)
    ids = indexer_forward_topk(q, k, w, 4, topk_indices_global=False, **REF).indices
    p = sparse_indexer_score_recompute(q, k, w, ids, **REF)
    ref = sparse_indexer_score_recompute(q.double(), k.double(), w.double(), ids, **REF)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-6)
    # the combined forward's softmax is the same distribution over the same slots
    torch.testing.assert_close(indexer_forward_topk(q, k, w, 4, topk_indices_global=False, **REF).softmax, p)


def test_sparse_recompute_gradcheck():
    q, k, w = inputs(b=2, sq=3, sk=4, h=2, d=3, seed=24)
    ids = torch.tensor([[[0, 2, -1]], [[3, 1, 1]]], **I32).expand(2, 3, 3).contiguous()
    q, k, w = (x.requires_grad_() for x in (q, k, w))
    assert torch.autograd.gradcheck(
        lambda q, k, w: sparse_indexer_score_recompute(q, k, w, ids, sm_scale=0.5, **REF), (q, k, w))


@pytest.mark.parametrize("ratio,offsets", [(1, None), (2, [0, 3]), (4, [-8, 1])])
def test_dense_recompute_matches_scores_and_logsumexp(ratio, offsets):
    q, k, w = inputs(sq=6, sk=5, seed=30 + ratio)
    off = None if offsets is None else torch.tensor(offsets, **I32)
    res = dense_indexer_score_recompute(q, k, w, ratio=ratio, q_causal_offsets=off, sm_scale=0.25, **REF)
    raw = indexer_scores(q, k, w, ratio=ratio, q_causal_offsets=off, **REF)
    assert torch.equal(torch.isinf(res.out), torch.isinf(raw))
    for b in range(2):
        for t in range(6):
            lim = brute_limit(t, 5, ratio, 0 if offsets is None else offsets[b])
            vals = [0.25 * brute_score(q, k, w, b, t, s) for s in range(lim)]
            assert res.out[b, t, :lim].tolist() == pytest.approx(vals, abs=1e-12)
            want = math.log(sum(math.exp(v) for v in vals)) if vals else float("-inf")
            assert res.denom[b, t].item() == pytest.approx(want)


def test_dense_recompute_gradcheck():
    q, k, w = inputs(b=1, sq=4, sk=4, h=2, d=3, seed=33)
    valid = torch.isfinite(indexer_scores(q, k, w, ratio=2, **REF))
    q, k, w = (x.requires_grad_() for x in (q, k, w))

    def fn(q, k, w):
        res = dense_indexer_score_recompute(q, k, w, ratio=2, sm_scale=0.7, **REF)
        return res.out[valid], res.denom[valid.any(-1)]

    assert torch.autograd.gradcheck(fn, (q, k, w))


# --- the indexer KL loss, written independently ---------------------------------------------------------

def kl_loss(q, w, k, slot_keys, slot_valid, target, sm_scale, loss_coeff, grad_loss):
    """grad_loss * loss_coeff / (B * S_q) * sum_rows sum_valid tgt * (log tgt - log_softmax(sm_scale * I)).

    slot_keys [B, S_q, J] long: which key row each slot scores; slot_valid [B, S_q, J] bool.
    """
    b, sq = q.shape[:2]
    loss = q.new_zeros(())
    for bb in range(b):
        for t in range(sq):
            sel = slot_valid[bb, t].nonzero().flatten()
            if sel.numel() == 0:
                continue
            keys = k[bb, slot_keys[bb, t, sel]]                       # [n, D]
            logits = sm_scale * (w[bb, t, :, None] * torch.relu(q[bb, t] @ keys.T)).sum(0)
            logp = torch.log_softmax(logits, dim=0)
            tgt = target[bb, t, sel]
            nz = tgt > 0
            loss = loss + (tgt[nz] * (torch.log(tgt[nz]) - logp[nz])).sum()
    return grad_loss * loss_coeff / (b * sq) * loss


def assert_grads_match_loss(grads, q, w, k, loss_fn):
    """Analytic grads vs autograd of the loss, and vs a central finite difference along a random direction."""
    qq, ww, kk = (x.detach().clone().requires_grad_() for x in (q, w, k))
    auto = torch.autograd.grad(loss_fn(qq, ww, kk), (qq, ww, kk))
    for got, want in zip(grads, auto):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    g = torch.Generator().manual_seed(99)
    dirs = [torch.randn(x.shape, generator=g, **F64) for x in (q, w, k)]
    eps = 1e-6
    with torch.no_grad():
        plus = loss_fn(*(x + eps * v for x, v in zip((q, w, k), dirs)))
        minus = loss_fn(*(x - eps * v for x, v in zip((q, w, k), dirs)))
    fd = (plus - minus) / (2 * eps)
    analytic = sum((gr * v).sum() for gr, v in zip(grads, dirs))
    assert analytic.item() == pytest.approx(fd.item(), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("global_ids", [False, True])
@pytest.mark.parametrize("sm_scale,loss_coeff,grad_loss", [(1.0, 1.0, None), (0.7, 2.5, 0.3)])
def test_indexer_backward_matches_autograd_of_kl_loss(global_ids, sm_scale, loss_coeff, grad_loss):
    b, sq, sk, kk = 2, 4, 6, 4
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=40)
    g = torch.Generator().manual_seed(41)
    local = torch.stack([torch.stack([torch.randperm(sk, generator=g)[:kk] for _ in range(sq)]) for _ in range(b)])
    local = local.to(torch.int32)
    local[0, 1, 3] = -1                   # padding slot
    local[1, 2, 1:] = -1                  # mostly padding
    local[1, 3, :] = -1                   # empty row
    ids = torch.where(local >= 0, local + torch.arange(b, **I32).view(b, 1, 1) * sk, local) if global_ids else local
    valid = local >= 0
    target = torch.rand(b, sq, kk, generator=g, **F64) * valid
    target[0, 0, 2] = 0.0                 # a zero-probability target slot
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    target[0, 2] *= 0.6                   # an unnormalized row: the gradient uses sum(target)
    target = torch.where(valid, target, torch.full_like(target, 0.123))  # garbage in invalid slots is ignored
    predict = sparse_indexer_score_recompute(q, k, w, local, sm_scale=sm_scale, **REF)
    gl = None if grad_loss is None else torch.tensor(grad_loss, **F64)
    grads = indexer_backward(q, w, k, target, predict, ids, grad_loss=gl, sm_scale=sm_scale, loss_coeff=loss_coeff,
                             topk_indices_global=global_ids, **REF)
    assert [x.dtype for x in grads] == [torch.float64] * 3
    keys = local.long().clamp_min(0)

    def loss_fn(q_, w_, k_):
        return kl_loss(q_, w_, k_, keys, valid, target, sm_scale, loss_coeff, 1.0 if grad_loss is None else grad_loss)

    assert_grads_match_loss(grads, q, w, k, loss_fn)


def test_indexer_backward_low_precision_vs_fp64():
    q, k, w = inputs(seed=42, dtype=torch.bfloat16)
    res = indexer_forward_topk(q, k, w, 4, topk_indices_global=False, **REF)
    target = torch.softmax(torch.randn(res.softmax.shape, generator=torch.Generator().manual_seed(1)), -1)
    target = target * (res.indices >= 0)
    grads = indexer_backward(q, w, k, target, res.softmax, res.indices, **REF)
    ref = indexer_backward(q.double(), w.double(), k.double(), target.double(), res.softmax.double(), res.indices, **REF)
    assert [x.dtype for x in grads] == [torch.bfloat16] * 3
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-3)
    grads32 = indexer_backward(q.float(), w.float(), k.float(), target, res.softmax, res.indices, **REF)
    for got, want in zip(grads32, ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ratio,offsets", [(1, None), (2, [1, 4]), (3, [-2, 0])])
@pytest.mark.parametrize("sm_scale,loss_coeff,grad_loss", [(1.0, 1.0, None), (0.5, 3.0, 1.7)])
def test_dense_indexer_backward_matches_autograd_of_kl_loss(ratio, offsets, sm_scale, loss_coeff, grad_loss):
    b, sq, sk = 2, 6, 5
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=50 + ratio)
    off = None if offsets is None else torch.tensor(offsets, **I32)
    scores = dense_indexer_score_recompute(q, k, w, ratio=ratio, q_causal_offsets=off, sm_scale=sm_scale, **REF)
    valid = torch.isfinite(scores.out)
    g = torch.Generator().manual_seed(51)
    attn = torch.rand(b, sq, sk, generator=g, **F64) * 3 * valid
    attn[0, -1, 0] = 0.0
    l1 = attn.sum(-1)
    attn = torch.where(valid, attn, torch.full_like(attn, 7.0))   # masked columns are ignored
    gl = None if grad_loss is None else torch.tensor([grad_loss], **F64)
    grads = dense_indexer_backward(q, w, k, attn, l1, scores.out, scores.denom, grad_loss=gl, sm_scale=sm_scale,
                                   loss_coeff=loss_coeff, ratio=ratio, q_causal_offsets=off, **REF)
    target = torch.where(valid, attn / l1.clamp_min(1e-300)[..., None], torch.zeros_like(attn))
    keys = torch.arange(sk).expand(b, sq, sk)

    def loss_fn(q_, w_, k_):
        return kl_loss(q_, w_, k_, keys, valid, target, sm_scale, loss_coeff, 1.0 if grad_loss is None else grad_loss)

    assert_grads_match_loss(grads, q, w, k, loss_fn)


def test_dense_backward_equals_sparse_backward_over_all_columns():
    # With every valid column as a "top-k" slot, the two losses coincide.
    b, sq, sk = 1, 5, 5
    q, k, w = inputs(b=b, sq=sq, sk=sk, seed=60)
    scores = dense_indexer_score_recompute(q, k, w, **REF)
    valid = torch.isfinite(scores.out)
    attn = torch.rand(b, sq, sk, generator=torch.Generator().manual_seed(2), **F64) * valid
    dense = dense_indexer_backward(q, w, k, attn, attn.sum(-1), scores.out, scores.denom, **REF)
    ids = torch.where(valid, torch.arange(sk, **I32).expand(b, sq, sk), torch.full((), -1, **I32))
    predict = sparse_indexer_score_recompute(q, k, w, ids.contiguous(), **REF)
    sparse = indexer_backward(q, w, k, attn / attn.sum(-1, keepdim=True), predict, ids.contiguous(), **REF)
    for x, y in zip(dense, sparse):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-13)


def test_backward_does_not_modify_inputs():
    q, k, w = inputs(seed=61)
    res = indexer_forward_topk(q, k, w, 3, topk_indices_global=False, **REF)
    attn, pred = res.softmax.clone(), res.softmax.clone()
    indexer_backward(q, w, k, attn, pred, res.indices, **REF)
    assert torch.equal(attn, res.softmax) and torch.equal(pred, res.softmax)


# --- API ------------------------------------------------------------------------------------------------

OPS = ["indexer_scores", "indexer_topk", "indexer_forward_topk", "sparse_indexer_score_recompute",
       "dense_indexer_score_recompute", "indexer_backward", "dense_indexer_backward"]


@pytest.mark.parametrize("name", OPS)
def test_public_names_resolve(name):
    mod = {"indexer_scores": "indexer", "indexer_topk": "indexer", "indexer_forward_topk": "indexer"}.get(
        name, "indexer_training")
    assert getattr(dsagen, name) is getattr(__import__(f"dsagen.ops.{mod}", fromlist=[name]), name)


def _valid_args(dtype=torch.float32):
    b, sq, sk, h, d, kk = 1, 4, 4, 2, 4, 2
    q, k, w = inputs(b=b, sq=sq, sk=sk, h=h, d=d, dtype=dtype)
    ids = torch.zeros(b, sq, kk, **I32)
    sc = torch.zeros(b, sq, kk)
    dense = torch.zeros(b, sq, sk)
    row = torch.zeros(b, sq)
    return {
        "indexer_scores": (indexer_scores, (q, k, w), {}),
        "indexer_topk": (indexer_topk, (dense.reshape(-1, sk), torch.full((sq,), 2, **I32), 2), {}),
        "indexer_forward_topk": (indexer_forward_topk, (q, k, w, 2), {}),
        "sparse_indexer_score_recompute": (sparse_indexer_score_recompute, (q, k, w, ids), {}),
        "dense_indexer_score_recompute": (dense_indexer_score_recompute, (q, k, w), {}),
        "indexer_backward": (indexer_backward, (q, w, k, sc, sc, ids), {}),
        "dense_indexer_backward": (dense_indexer_backward, (q, w, k, dense, row, dense, row), {}),
    }


@pytest.mark.parametrize("name", OPS)
def test_fused_on_cpu_raises_value_error(name):
    fn, args, kw = _valid_args()[name]
    fn(*args, impl="reference", **kw)  # the arguments are valid
    with pytest.raises(ValueError, match="fused"):
        fn(*args, **kw)                # default impl is "fused"


@pytest.mark.parametrize("name", OPS)
def test_bad_impl_names_impl(name):
    fn, args, kw = _valid_args()[name]
    with pytest.raises(ValueError, match="impl"):
        fn(*args, impl="eager", **kw)


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


def _error_cases():
    """(op, arg index or kwarg name, bad value factory, error type, text the message must contain)."""
    cases = []
    for op in ("indexer_scores", "indexer_forward_topk", "sparse_indexer_score_recompute",
               "dense_indexer_score_recompute"):
        cases += [
            (op, 0, lambda a: a[0].int(), TypeError, "q_indexer"),
            (op, 0, lambda a: a[0][0], ValueError, "q_indexer"),
            (op, 0, lambda a: a[0][:, :, :0], ValueError, "q_indexer"),
            (op, 1, lambda a: a[1].double(), TypeError, "k_indexer"),
            (op, 1, lambda a: a[1][..., :3], ValueError, "k_indexer"),
            (op, 1, lambda a: a[1][:, :, None].expand(-1, -1, 2, -1), ValueError, "k_indexer"),
            (op, 2, lambda a: a[2][..., :1], ValueError, "weights"),
            (op, 2, lambda a: [1.0], TypeError, "weights"),
        ]
    for op in ("indexer_scores", "indexer_forward_topk", "dense_indexer_score_recompute", "dense_indexer_backward"):
        cases += [
            (op, "ratio", lambda a: 0, ValueError, "ratio"),
            (op, "ratio", lambda a: 2.0, TypeError, "ratio"),
            (op, "q_causal_offsets", lambda a: torch.zeros(2, **I32), ValueError, "q_causal_offsets"),
            (op, "q_causal_offsets", lambda a: torch.zeros(1), TypeError, "q_causal_offsets"),
        ]
    cases += [
        ("indexer_topk", 0, lambda a: a[0][0], ValueError, "input_values"),
        ("indexer_topk", 0, lambda a: a[0].int(), TypeError, "input_values"),
        ("indexer_topk", 1, lambda a: a[1].long(), TypeError, "seq_lens"),
        ("indexer_topk", 1, lambda a: a[1][:3], ValueError, "seq_lens"),
        ("indexer_topk", 2, lambda a: -1, ValueError, "top_k"),
        ("indexer_topk", "return_values", lambda a: 1, TypeError, "return_values"),
        ("indexer_forward_topk", 3, lambda a: -2, ValueError, "top_k"),
        ("indexer_forward_topk", "return_softmax", lambda a: None, TypeError, "return_softmax"),
        ("indexer_forward_topk", "return_lse", lambda a: "yes", TypeError, "return_lse"),
        ("indexer_forward_topk", "topk_indices_global", lambda a: 0, TypeError, "topk_indices_global"),
        ("sparse_indexer_score_recompute", 3, lambda a: a[3].long(), TypeError, "topk_indices"),
        ("sparse_indexer_score_recompute", 3, lambda a: a[3][:, :2], ValueError, "topk_indices"),
        ("sparse_indexer_score_recompute", "topk_length", lambda a: torch.zeros(1, 3, **I32), ValueError, "topk_length"),
        ("sparse_indexer_score_recompute", "topk_length", lambda a: torch.zeros(1, 4), TypeError, "topk_length"),
        ("sparse_indexer_score_recompute", "sm_scale", lambda a: 0.0, ValueError, "sm_scale"),
        ("sparse_indexer_score_recompute", "sm_scale", lambda a: "1", TypeError, "sm_scale"),
        ("dense_indexer_score_recompute", "sm_scale", lambda a: -1.0, ValueError, "sm_scale"),
    ]
    for op in ("indexer_backward", "dense_indexer_backward"):
        cases += [
            (op, 0, lambda a: a[0].int(), TypeError, "index_q"),
            (op, 1, lambda a: a[1][..., :1], ValueError, "weights"),
            (op, 2, lambda a: a[2].double(), TypeError, "index_k"),
            (op, 2, lambda a: a[2][:, :, None], ValueError, "index_k"),
            (op, 3, lambda a: a[3].half(), TypeError, "attn_score"),
            (op, 3, lambda a: a[3][:, :2], ValueError, "attn_score"),
            (op, "grad_loss", lambda a: torch.ones(2), ValueError, "grad_loss"),
            (op, "grad_loss", lambda a: 1.0, TypeError, "grad_loss"),
            (op, "sm_scale", lambda a: 0, ValueError, "sm_scale"),
            (op, "loss_coeff", lambda a: float("nan"), ValueError, "loss_coeff"),
            (op, "loss_coeff", lambda a: None, TypeError, "loss_coeff"),
        ]
    cases += [
        ("indexer_backward", 4, lambda a: a[4][..., :1], ValueError, "index_score"),
        ("indexer_backward", 5, lambda a: a[5].float(), TypeError, "topk_indices"),
        ("indexer_backward", 5, lambda a: a[5][:, :1], ValueError, "topk_indices"),
        ("indexer_backward", "topk_indices_global", lambda a: 1, TypeError, "topk_indices_global"),
        ("dense_indexer_backward", 4, lambda a: a[4][:, :1], ValueError, "attn_l1norm"),
        ("dense_indexer_backward", 5, lambda a: a[5][..., :2], ValueError, "index_score"),
        ("dense_indexer_backward", 6, lambda a: a[6][0], ValueError, "index_lse"),
    ]
    return cases


@pytest.mark.parametrize("op,where,bad,err,name", _error_cases())
def test_validation_errors_name_the_argument(op, where, bad, err, name):
    fn, args, kw = _valid_args()[op]
    kw = dict(kw)
    if isinstance(where, int):
        args = _replace(args, where, bad(args))
    else:
        kw[where] = bad(args)
    with pytest.raises(err, match=name):
        fn(*args, impl="reference", **kw)


def test_device_mismatch_names_the_argument():
    q, k, w = inputs()
    with pytest.raises(ValueError, match="weights must be on"):
        indexer_scores(q, k, w.to("meta"), **REF)
