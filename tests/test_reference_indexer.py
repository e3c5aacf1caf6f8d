"""dsagen.lightning_indexer (attention-gym lightning_indexer), impl="reference": hand-computed cases, brute-force comparisons on
random shapes (causal, compress_ratio, packed documents, padding), chunking, and every validation error."""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.ops.lightning_indexer import lightning_indexer
from dsagen.reference.lightning_indexer import lightning_indexer as reference_lightning_indexer


def run(q, k, w, topk, **kw):
    return lightning_indexer(q, k, w, topk, impl="reference", **kw)


# --- independent brute force --------------------------------------------------------------------------

def brute_scores(q, k, w):
    """score[b][t][s] as Python floats, from explicit loops in float64."""
    q, k, w = q.double(), k.double(), w.double()
    b_n, t_n, h_n, d_n = q.shape
    out = []
    for b in range(b_n):
        rows = []
        for t in range(t_n):
            row = []
            for s in range(k.shape[1]):
                acc = 0.0
                for h in range(h_n):
                    acc += float(w[b, t, h]) * max(0.0, float(torch.dot(q[b, t, h], k[b, s])))
                row.append(acc / math.sqrt(h_n * d_n))
            rows.append(row)
        out.append(rows)
    return out


def brute_candidates(t_n, s_n, causal, ratio, cu=None, cuk=None):
    """For each query row t: list of (global candidate s, returned id) it may select."""
    rows = []
    for t in range(t_n):
        if cu is None:
            hi = (t + 1) // ratio if causal else s_n
            rows.append([(s, s) for s in range(min(hi, s_n))])
            continue
        docs = [d for d in range(len(cu) - 1) if cu[d] <= t < cu[d + 1]]
        if not docs:
            rows.append([])
            continue
        d = docs[0]
        lo, hi = cuk[d], cuk[d + 1]
        if causal:
            hi = min(hi, lo + (t - cu[d] + 1) // ratio)
        rows.append([(s, s - lo) for s in range(lo, min(hi, s_n))])
    return rows


def expected_row(scores_row, cands, topk):
    """Valid ids by descending score, ties toward the lower id, -1 padded to topk."""
    ranked = sorted(cands, key=lambda c: (-scores_row[c[0]], c[1]))
    ids = [c[1] for c in ranked[:topk]]
    return ids + [-1] * (topk - len(ids))


def check_against_brute(out, q, k, w, topk, causal=False, ratio=1, cu=None, cuk=None, exact=True, tol=0.0):
    scores = brute_scores(q, k, w)
    cands = brute_candidates(q.shape[1], k.shape[1], causal, ratio, cu, cuk)
    assert out.shape == (q.shape[0], q.shape[1], topk) and out.dtype == torch.int32 and out.is_contiguous()
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            got = out[b, t].tolist()
            want = expected_row(scores[b][t], cands[t], topk)
            if exact:
                assert got == want, (b, t, got, want)
                continue
            # Low precision: same count and padding; selected scores are a valid top-k up to tol.
            n = sum(1 for x in want if x >= 0)
            assert all(x >= 0 for x in got[:n]) and all(x == -1 for x in got[n:]), (b, t, got)
            by_id = {c[1]: scores[b][t][c[0]] for c in cands[t]}
            chosen = got[:n]
            assert len(set(chosen)) == n and all(c in by_id for c in chosen)
            rest = [by_id[c] for c in by_id if c not in chosen]
            if rest and chosen:
                assert min(by_id[c] for c in chosen) >= max(rest) - tol
            vals = [by_id[c] for c in chosen]
            assert all(vals[i] >= vals[i + 1] - tol for i in range(len(vals) - 1))


# --- hand-computed ------------------------------------------------------------------------------------

def hand_inputs(dtype=torch.float64):
    # H = 2, D = 1, T = S = 3; see the scores written out in each test.
    q = torch.tensor([[[1.0], [-1.0]], [[1.0], [1.0]], [[-1.0], [1.0]]], dtype=dtype)[None]
    k = torch.tensor([[1.0], [-1.0], [2.0]], dtype=dtype)[None]
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0], [2.0, 1.0]], dtype=dtype)[None]
    return q, k, w


def test_hand_computed_noncausal():
    # scores * sqrt(2): t0 = [1, 1, 2], t1 = [0, 0, 0], t2 = [1, 2, 2]
    q, k, w = hand_inputs()
    assert run(q, k, w, 2)[0].tolist() == [[2, 0], [0, 1], [1, 2]]
    assert run(q, k, w, 4)[0].tolist() == [[2, 0, 1, -1], [0, 1, 2, -1], [1, 2, 0, -1]]


def test_hand_computed_causal():
    q, k, w = hand_inputs()
    assert run(q, k, w, 2, causal=True)[0].tolist() == [[0, -1], [0, 1], [1, 2]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_hand_computed_low_precision(dtype):
    q, k, w = hand_inputs(dtype)
    assert run(q, k, w, 3, causal=True)[0].tolist() == [[0, -1, -1], [0, 1, -1], [1, 2, 0]]


def test_hand_computed_compress_ratio():
    # T = 5, ratio 2: S = 2 candidates; row t sees s < (t + 1) // 2 -> 0, 1, 1, 2, 2 candidates.
    q = torch.ones(1, 5, 1, 1, dtype=torch.float64)
    k = torch.tensor([[[1.0], [3.0]]], dtype=torch.float64)
    w = torch.ones(1, 5, 1, dtype=torch.float64)
    out = run(q, k, w, 2, causal=True, compress_ratio=2)
    assert out[0].tolist() == [[-1, -1], [0, -1], [0, -1], [1, 0], [1, 0]]


def test_all_equal_scores_prefer_lower_index():
    q = torch.ones(1, 6, 2, 4, dtype=torch.float64)
    k = torch.ones(1, 6, 4, dtype=torch.float64)
    w = torch.ones(1, 6, 2, dtype=torch.float64)
    assert run(q, k, w, 3)[0].tolist() == [[0, 1, 2]] * 6
    assert run(q, k, w, 3, causal=True)[0].tolist() == [[0, -1, -1], [0, 1, -1]] + [[0, 1, 2]] * 4


def test_tie_at_the_kth_boundary():
    # candidate scores (D = 1, k values, one head, weight 1): [1, 3, 2, 3, 2, 2]; top-4 = 1, 3, then the
    # two lowest of the tied 2s (2, 4).
    k = torch.tensor([[[1.0], [3.0], [2.0], [3.0], [2.0], [2.0]]], dtype=torch.float64)
    q = torch.ones(1, 6, 1, 1, dtype=torch.float64)
    w = torch.ones(1, 6, 1, dtype=torch.float64)
    assert run(q, k, w, 4)[0, 0].tolist() == [1, 3, 2, 4]


def test_negative_weights_flip_preference():
    q = torch.ones(1, 3, 1, 1, dtype=torch.float64)
    k = torch.tensor([[[1.0], [2.0], [3.0]]], dtype=torch.float64)
    w = -torch.ones(1, 3, 1, dtype=torch.float64)
    assert run(q, k, w, 3)[0, 0].tolist() == [0, 1, 2]
    assert run(q, k, -w, 3)[0, 0].tolist() == [2, 1, 0]


# --- random shapes vs brute force ---------------------------------------------------------------------

@pytest.mark.parametrize("causal,ratio", [(False, 1), (True, 1), (True, 2), (True, 3), (True, 4)])
@pytest.mark.parametrize("topk", [0, 1, 3, 20])
def test_random_fp64_matches_brute_force(causal, ratio, topk):
    g = torch.Generator().manual_seed(100 * ratio + topk + int(causal))
    b, t, h, d = 2, 11, 3, 5  # T not divisible by 2, 3, 4
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, t // ratio, d, generator=g, dtype=torch.float64)
    w = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    out = run(q, k, w, topk, causal=causal, compress_ratio=ratio)
    check_against_brute(out, q, k, w, topk, causal, ratio)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5), (torch.float16, 1e-5)])
def test_random_low_precision_selects_a_valid_topk(dtype, tol):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 13, 4, 8, generator=g).to(dtype)
    k = torch.randn(2, 13 // 2, 8, generator=g).to(dtype)
    w = torch.randn(2, 13, 4, generator=g).to(dtype)
    # The inputs are exactly representable in dtype, so the fp64 brute force on the same values is the
    # exact score; the FP32 accumulation may only reorder near-ties.
    out = run(q, k, w, 4, causal=True, compress_ratio=2)
    check_against_brute(out, q, k, w, 4, True, 2, exact=False, tol=tol)


def test_fp32_path_agrees_with_fp64():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 17, 4, 16, generator=g)
    k = torch.randn(3, 17, 16, generator=g)
    w = torch.randn(3, 17, 4, generator=g)
    out32 = run(q, k, w, 6, causal=True)
    out64 = run(q.double(), k.double(), w.double(), 6, causal=True)
    assert torch.equal(out32, out64)  # no near-ties at this size and seed


@pytest.mark.parametrize("causal,ratio", [(False, 1), (True, 1), (True, 2), (True, 3)])
def test_packed_documents_match_brute_force(causal, ratio):
    # Documents of lengths 5, 0 (empty), 7, 1, then 3 rows past the last offset; S has 2 spare slots.
    lens = [5, 0, 7, 1]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cuk = [0]
    for n in lens:
        cuk.append(cuk[-1] + n // ratio)
    t_n, s_n = cu[-1] + 3, cuk[-1] + 2
    g = torch.Generator().manual_seed(11 + ratio)
    q = torch.randn(1, t_n, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, s_n, 4, generator=g, dtype=torch.float64)
    w = torch.randn(1, t_n, 2, generator=g, dtype=torch.float64)
    for topk in (0, 2, 9):
        out = run(q, k, w, topk, causal=causal, compress_ratio=ratio,
                  cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_k=torch.tensor(cuk, dtype=torch.int32))
        check_against_brute(out, q, k, w, topk, causal, ratio, cu, cuk)
        assert (out[0, cu[-1]:] == -1).all()


def test_packed_single_offset_means_no_documents():
    q, k, w = torch.randn(1, 4, 2, 4), torch.randn(1, 4, 4), torch.randn(1, 4, 2)
    zero = torch.zeros(1, dtype=torch.int32)
    out = run(q, k, w, 2, cu_seqlens=zero, cu_seqlens_k=zero)
    assert (out == -1).all()


def test_chunking_does_not_change_the_result():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 21, 4, 8, generator=g)
    k = torch.randn(3, 21, 8, generator=g)
    w = torch.randn(3, 21, 4, generator=g)
    full = reference_lightning_indexer(q, k, w, 5, causal=True)
    for budget in (1, 4 * 21 * 4 * 5, 4 * 21 * 4 * 21 * 2):  # one row, 5 rows, two batches per chunk
        chunked = reference_lightning_indexer(q, k, w, 5, causal=True, score_budget_bytes=budget)
        assert torch.equal(full, chunked)
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    full = reference_lightning_indexer(q[:1], k[:1], w[:1], 4, causal=True, cu_seqlens=cu, cu_seqlens_k=cu)
    chunked = reference_lightning_indexer(q[:1], k[:1], w[:1], 4, causal=True, cu_seqlens=cu, cu_seqlens_k=cu,
                                          score_budget_bytes=1)
    assert torch.equal(full, chunked)


# --- edges ------------------------------------------------------------------------------------------

def test_no_candidates_when_s_is_zero():
    q, w = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2)
    k = torch.randn(1, 0, 4)
    out = run(q, k, w, 2, causal=True, compress_ratio=4)
    assert out.shape == (1, 3, 2) and (out == -1).all()


def test_topk_zero_and_empty_batch():
    q, k, w = torch.randn(2, 4, 2, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 2)
    out = run(q, k, w, 0)
    assert out.shape == (2, 4, 0) and out.dtype == torch.int32
    out = run(q[:0], k[:0], w[:0], 3)
    assert out.shape == (0, 4, 3)
    out = run(q[:, :0], k[:, :0], w[:, :0], 3)
    assert out.shape == (2, 0, 3)


def test_result_is_nondifferentiable():
    q = torch.randn(1, 4, 2, 4, requires_grad=True)
    k = torch.randn(1, 4, 4, requires_grad=True)
    w = torch.randn(1, 4, 2, requires_grad=True)
    out = run(q, k, w, 2, causal=True)
    assert out.grad_fn is None and not out.requires_grad


def test_strided_inputs():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 7, 3, generator=g, dtype=torch.float64).transpose(1, 2)  # [2, 7, 4, 3] strided
    k = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).transpose(1, 2)
    w = torch.randn(2, 4, 7, generator=g, dtype=torch.float64).transpose(1, 2)
    check_against_brute(run(q, k, w, 3, causal=True), q, k, w, 3, True)


# --- API ----------------------------------------------------------------------------------------------

def test_public_name_resolves():
    assert dsagen.lightning_indexer is lightning_indexer


def test_fused_on_cpu_raises_value_error():
    q, k, w = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="fused"):
        dsagen.lightning_indexer(q, k, w, 2)


def _inputs(b=1, t=4, h=2, d=4, s=None, dtype=torch.float32):
    return torch.randn(b, t, h, d, dtype=dtype), torch.randn(b, t if s is None else s, d, dtype=dtype), \
        torch.randn(b, t, h, dtype=dtype)


I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize("case,err,name", [
    (lambda q, k, w: lightning_indexer(q, k, w, 2, impl="cuda"), ValueError, "impl"),
    (lambda q, k, w: lightning_indexer(q, k, w, 2, impl="bogus"), ValueError, "impl"),
    (lambda q, k, w: run([1], k, w, 2), TypeError, "q"),
    (lambda q, k, w: run(q.int(), k, w, 2), TypeError, "q"),
    (lambda q, k, w: run(q[0], k, w, 2), ValueError, "q"),
    (lambda q, k, w: run(q, k[0], w, 2), ValueError, "k"),
    (lambda q, k, w: run(q, k, w[0], 2), ValueError, "weights"),
    (lambda q, k, w: run(q, k.double(), w, 2), TypeError, "k"),
    (lambda q, k, w: run(q, k, w.half(), 2), TypeError, "weights"),
    (lambda q, k, w: run(q, k[..., :3], w, 2), ValueError, "k"),
    (lambda q, k, w: run(q, k[:, :3], w, 2), ValueError, "k"),
    (lambda q, k, w: run(q, k, w[..., :1], 2), ValueError, "weights"),
    (lambda q, k, w: run(q[:, :, :0], k, w[..., :0], 2), ValueError, "q"),
    (lambda q, k, w: run(q, k, w, -1), ValueError, "topk"),
    (lambda q, k, w: run(q, k, w, 2.0), TypeError, "topk"),
    (lambda q, k, w: run(q, k, w, True), TypeError, "topk"),
    (lambda q, k, w: run(q, k, w, 2, causal=1), TypeError, "causal"),
    (lambda q, k, w: run(q, k, w, 2, causal=True, compress_ratio=0), ValueError, "compress_ratio"),
    (lambda q, k, w: run(q, k[:, :2], w, 2, compress_ratio=2), ValueError, "compress_ratio"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.tensor([0, 4], **I32)), ValueError, "cu_seqlens_k"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens_k=torch.tensor([0, 4], **I32)), ValueError, "cu_seqlens"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4], **I32)),
     TypeError, "cu_seqlens"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.tensor([0, 4], **I32), cu_seqlens_k=torch.tensor([[0, 4]], **I32)),
     ValueError, "cu_seqlens_k"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.tensor([0, 4], **I32), cu_seqlens_k=torch.tensor([0, 2, 4], **I32)),
     ValueError, "cu_seqlens_k"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.zeros(0, **I32), cu_seqlens_k=torch.zeros(0, **I32)),
     ValueError, "cu_seqlens"),
    (lambda q, k, w: run(q, k, w, 2, cu_seqlens=torch.tensor([0, 9, 4, 0], **I32)[::2],
                         cu_seqlens_k=torch.tensor([0, 4], **I32)), ValueError, "cu_seqlens"),
    (lambda q, k, w: run(q, k, w, 2, kernel_options={"backend": "triton"}), ValueError, "kernel_options"),
    (lambda q, k, w: run(q, k, w, 2, kernel_options="triton"), TypeError, "kernel_options"),
])
def test_validation_errors_name_the_argument(case, err, name):
    q, k, w = _inputs()
    with pytest.raises(err, match=name):
        case(q, k, w)


def test_packed_requires_batch_one():
    q, k, w = _inputs(b=2)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must have batch size B = 1"):
        run(q, k, w, 2, cu_seqlens=cu, cu_seqlens_k=cu)


def test_device_mismatch_names_the_argument():
    q, k, w = _inputs()
    with pytest.raises(ValueError, match="k must be on"):
        run(q, k.to("meta"), w, 2)
