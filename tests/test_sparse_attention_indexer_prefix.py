"""The forward's indexer prefix on the CPU (cuDNN frontend DSA §1 Sparse Attention Forward, `indexer_topk` /
`lse_indexer`): `dsagen.sparse_attention(..., indexer_topk=N, impl="reference")` against two independent
formulations (torch.logsumexp over gathered, masked scores; per-row Python loops in FP64 on the truncated
problem), adversarial ids, topk_length shorter and longer than N, N = 0 / between / K, empty rows and empty
prefixes (+inf), a prefix far below the row's maximum, chunking, the batched layout against the flat one,
the other outputs unchanged, every validation error, and the autograd wiring (lse_indexer non-differentiable;
the fused path's host contract through a stand-in for the fused kernels)."""

from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch

import dsagen
from dsagen.reference import sparse_attention as ref
from test_reference_attention import brute_force, random_case

sa_mod = sys.modules[dsagen.sparse_attention.__module__]
INF = float("inf")


def sa(*args, **kw):
    kw.setdefault("impl", "reference")
    return dsagen.sparse_attention(*args, **kw)


def prefix_lse(q, kv, idx, length, n, scale=None):
    """lse over the valid slots j < min(n, length[t]): torch.logsumexp of FP64 gathered scores, invalid slots
    masked to -inf, +inf where nothing in the prefix is valid."""
    s_q, h, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = idx.shape[1]
    ids = idx.long()
    pos = torch.arange(k)
    valid = (ids >= 0) & (ids < kv.shape[0]) & (pos < n)
    if length is not None:
        valid &= pos < length.long().clamp(0, k)[:, None]
    rows = kv.double()[torch.where(valid, ids, 0)]                               # (S_q, K, D)
    s = torch.einsum("thd,tkd->thk", q.double(), rows) * scale
    s = s.masked_fill(~valid[:, None, :], -INF)
    out = torch.logsumexp(s, dim=-1)
    return torch.where(torch.isneginf(out), torch.full_like(out, INF), out)


def truncated_lse(q, kv, idx, length, n, scale=None):
    """lse of the problem cut to its first n slots (per-row Python loops in FP64)."""
    ln = None if length is None else length.clamp(max=n)
    return brute_force(q, kv, idx[:, :n], length=ln, scale=scale)[1]


# ----------------------------------------------------------------------------------------------------
# values (reference)


@pytest.mark.parametrize("n", [0, 1, 3, 5, 7])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("length", [False, True])
def test_lse_indexer_matches_two_independent_formulations(n, sink, length):
    """-1, negative, out-of-range and duplicate ids, an all-invalid row, lengths below, at and above n (K = 7)."""
    q, kv, idx, sk, ln = random_case(seed=300 + n, sink=sink, length=length)
    if length:
        ln[3:6] = torch.tensor([max(n - 2, 0), n, n + 1], dtype=torch.int32)
    out, lse, mx, lse_idx = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=n)
    if n == 0:
        assert lse_idx is None
        return
    assert lse_idx.shape == lse.shape and lse_idx.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(lse_idx, prefix_lse(q, kv, idx, ln, n))
    torch.testing.assert_close(lse_idx, truncated_lse(q, kv, idx, ln, n))
    assert torch.all(lse_idx[2] == INF)                            # the all-invalid row
    if length:                                                     # a row no longer than n: its prefix is the row
        short = ln <= n
        torch.testing.assert_close(lse_idx[short], lse[short])
    # a prefix can only lose slots: lse_indexer <= lse wherever the prefix has a valid slot
    finite = torch.isfinite(lse_idx)
    assert torch.all(lse_idx[finite] <= lse[finite] + 1e-12)


def test_the_other_outputs_are_unchanged_bitwise():
    q, kv, idx, sk, ln = random_case(seed=310)
    want = sa(q, kv, idx, attn_sink=sk, topk_length=ln)
    for n in (0, 2, 7):
        got = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=n)
        assert len(got) == 4
        for g, w in zip(got[:3], want):
            torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_n_equal_k_gives_lse_and_the_sink_is_never_in_it():
    q, kv, idx, sk, ln = random_case(seed=311)
    _, lse, _, lse_idx = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=idx.shape[1])
    torch.testing.assert_close(lse_idx, lse, atol=0, rtol=0)
    _, _, _, no_sink = sa(q, kv, idx, topk_length=ln, indexer_topk=4)
    _, _, _, big_sink = sa(q, kv, idx, attn_sink=torch.full((3,), 50.0), topk_length=ln, indexer_topk=4)
    torch.testing.assert_close(big_sink, no_sink, atol=0, rtol=0)


def test_empty_rows_and_empty_prefixes_are_inf():
    """Row 0: no valid slot at all; row 1: the first 3 slots invalid (-1, out of range, negative), later ones
    valid; row 2: valid prefix but topk_length 0; row 3: topk_length 2 < n = 3."""
    g = torch.Generator().manual_seed(312)
    q = torch.randn(4, 2, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(5, 8, generator=g, dtype=torch.float64)
    idx = torch.tensor([[-1, -1, 9, -3, -1, 7],
                        [-1, 5, -2, 0, 1, 2],
                        [0, 1, 2, 3, 4, 0],
                        [3, 1, 4, 0, 2, 2]], dtype=torch.int32)
    ln = torch.tensor([6, 6, 0, 2], dtype=torch.int32)
    _, lse, mx, lse_idx = sa(q, kv, idx, topk_length=ln, indexer_topk=3)
    assert torch.all(lse_idx[:3] == INF)
    assert torch.all(lse[0] == INF) and torch.all(torch.isfinite(lse[1])) and torch.all(lse[2] == INF)
    assert torch.all(mx[0] == -INF)
    torch.testing.assert_close(lse_idx[3], truncated_lse(q, kv, idx, ln, 2)[3])    # min(n, length) = 2 slots
    torch.testing.assert_close(lse_idx, prefix_lse(q, kv, idx, ln, 3))


def test_a_prefix_far_below_the_rows_maximum_does_not_underflow():
    """FP32 accumulation: the prefix's scores sit ~300 below a later slot's, so exp relative to the row's maximum
    would be 0; lse_indexer keeps its own maximum."""
    q = torch.zeros(1, 1, 4)
    q[0, 0, 0] = 1.0
    kv = torch.tensor([[-100.0, 0, 0, 0], [-101.0, 0, 0, 0], [200.0, 0, 0, 0]])
    idx = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    _, lse, _, lse_idx = sa(q, kv, idx, softmax_scale=1.0, indexer_topk=2)
    assert lse.dtype == lse_idx.dtype == torch.float32
    torch.testing.assert_close(lse_idx, torch.tensor([[math.log(math.exp(-100.0) + math.exp(-101.0))]]))
    torch.testing.assert_close(lse, torch.tensor([[200.0]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    q, kv, idx, sk, ln = random_case(s_q=9, s_kv=40, h=4, d=16, k=24, dtype=dtype, seed=313)
    _, lse, _, lse_idx = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=10)
    assert lse_idx.dtype == torch.float32
    torch.testing.assert_close(lse_idx.double(), prefix_lse(q, kv, idx, ln, 10), atol=1e-5, rtol=1e-5)


def test_chunked_rows_give_the_same_values(monkeypatch):
    q, kv, idx, sk, ln = random_case(s_q=11, seed=314)
    want = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=4)
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 40)                # a few rows per chunk
    assert ref.rows_per_chunk(idx.shape[1] * (q.shape[-1] + 2 * q.shape[1])) < q.shape[0]
    got = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_no_query_rows():
    q, kv = torch.zeros(0, 3, 8), torch.zeros(4, 8)
    _, lse, _, lse_idx = sa(q, kv, torch.zeros(0, 5, dtype=torch.int32), indexer_topk=2)
    assert lse_idx.shape == lse.shape == (0, 3)


def test_k_zero_takes_only_n_zero():
    q, kv, idx = torch.zeros(2, 3, 8), torch.zeros(4, 8), torch.zeros(2, 0, dtype=torch.int32)
    out, lse, mx, lse_idx = sa(q, kv, idx, indexer_topk=0)
    assert lse_idx is None and torch.all(lse == INF)
    with pytest.raises(ValueError, match="indexer_topk"):
        sa(q, kv, idx, indexer_topk=1)


def test_batched_layout_equals_the_flat_one():
    """Local ids (out of [0, N) never alias a neighbouring batch) against hand-made flat ids."""
    g = torch.Generator().manual_seed(315)
    b, t, h, d, n_kv, k = 3, 4, 2, 8, 6, 9
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(b, n_kv, d, generator=g, dtype=torch.float64)
    idx = torch.randint(-2, n_kv + 3, (b, t, k), generator=g, dtype=torch.int32)
    idx[1, 2] = -1                                                      # an empty row
    ln = torch.randint(0, k + 2, (b, t), generator=g, dtype=torch.int32)
    sk = torch.randn(h, generator=g)
    got = sa(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=5)
    local = idx.long()
    flat_ids = torch.where((local >= 0) & (local < n_kv), local + torch.arange(b).view(b, 1, 1) * n_kv, -1)
    want = sa(q.reshape(b * t, h, d), kv.reshape(b * n_kv, d), flat_ids.reshape(b * t, k).to(torch.int32),
              attn_sink=sk, topk_length=ln.reshape(b * t), indexer_topk=5)
    assert got[3].shape == (b, t, h)
    assert torch.all(got[3][1, 2] == INF)
    shapes = [(b, t, h, d), (b, t, h), (b, t, h), (b, t, h)]
    for g_, w, shape in zip(got, want, shapes):
        torch.testing.assert_close(g_, w.reshape(shape), atol=0, rtol=0)
    assert sa(q, kv, idx, indexer_topk=0)[3] is None


# ----------------------------------------------------------------------------------------------------
# the reference function's return arity (its callers unpack three values)


def test_reference_forward_returns_a_fourth_value_only_when_asked():
    q, kv, idx, sk, ln = random_case(seed=316)
    assert len(ref.sparse_attention_forward(q, kv, idx, attn_sink=sk, topk_length=ln)) == 3
    four = ref.sparse_attention_forward(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=0)
    assert len(four) == 4 and four[3] is None
    four = ref.sparse_attention_forward(q, kv, idx, attn_sink=sk, topk_length=ln, indexer_topk=3)
    torch.testing.assert_close(four[3], prefix_lse(q, kv, idx, ln, 3))


# ----------------------------------------------------------------------------------------------------
# validation


def test_indexer_topk_out_of_range_is_a_value_error_naming_it():
    q, kv, idx, sk, ln = random_case(seed=317)
    for bad in (-1, idx.shape[1] + 1, 10**9):
        for impl in ("reference", "fused"):
            with pytest.raises(ValueError, match="indexer_topk"):
                dsagen.sparse_attention(q, kv, idx, indexer_topk=bad, impl=impl)
    qb, kvb, idxb = q.reshape(2, 3, 3, 8), kv.reshape(1, 9, 8).expand(2, 9, 8), idx.reshape(2, 3, 7)
    with pytest.raises(ValueError, match=r"indexer_topk.*\[0, 7\]"):
        sa(qb, kvb, idxb, indexer_topk=8)


@pytest.mark.parametrize("bad", [2.0, True, "128", torch.tensor(2)])
def test_indexer_topk_not_an_int_is_a_type_error(bad):
    q, kv, idx, _, _ = random_case(seed=318)
    with pytest.raises(TypeError, match="indexer_topk"):
        sa(q, kv, idx, indexer_topk=bad)


def test_fused_takes_only_multiples_of_128():
    """NotImplementedError with the reason, raised before anything runs (also for CPU tensors, where the fused
    path would otherwise be a ValueError); never a silent fallback to the reference."""
    g = torch.Generator().manual_seed(319)
    q = torch.randn(2, 4, 16, generator=g).to(torch.bfloat16)
    kv = torch.randn(300, 16, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 300, (2, 256), generator=g, dtype=torch.int32)
    for bad in (1, 64, 100, 200, 255):
        with pytest.raises(NotImplementedError, match=r"indexer_topk=\d+.*multiple of 128"):
            dsagen.sparse_attention(q, kv, idx, indexer_topk=bad, impl="fused")
    for ok in (0, 128, 256):                      # accepted: the fused path then refuses CPU tensors as usual
        with pytest.raises(ValueError, match="CPU|cpu"):
            dsagen.sparse_attention(q, kv, idx, indexer_topk=ok, impl="fused")
    assert sa(q, kv, idx, indexer_topk=100)[3].shape == (2, 4)        # the reference takes any N in [0, K]


# ----------------------------------------------------------------------------------------------------
# autograd


def test_out_backward_works_and_lse_indexer_has_no_grad_fn():
    q, kv, idx, sk, ln = random_case(seed=320)
    leaves = [x.clone().requires_grad_() for x in (q, kv, sk.double())]
    out, lse, mx, lse_idx = sa(*leaves[:2], idx, attn_sink=leaves[2], topk_length=ln, indexer_topk=4)
    assert out.grad_fn is not None
    for t in (lse, mx, lse_idx):
        assert t.grad_fn is None and not t.requires_grad
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out.backward(dout)
    leaves_r = [x.detach().clone().requires_grad_() for x in leaves]
    out_r, _, _ = sa(*leaves_r[:2], idx, attn_sink=leaves_r[2], topk_length=ln)
    out_r.backward(dout)
    for a, b in zip(leaves, leaves_r):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)
    torch.testing.assert_close(lse_idx, prefix_lse(q, kv, idx, ln, 4))


def test_batched_autograd_with_the_prefix():
    g = torch.Generator().manual_seed(321)
    q = torch.randn(2, 3, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 7, (2, 3, 4), generator=g, dtype=torch.int32)
    out, _, _, lse_idx = sa(q, kv, idx, indexer_topk=2)
    assert lse_idx.shape == (2, 3, 2) and lse_idx.grad_fn is None
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    q2, kv2 = q.detach().requires_grad_(), kv.detach().requires_grad_()
    want = torch.autograd.grad(sa(q2, kv2, idx)[0].sum(), (q2, kv2))
    torch.testing.assert_close(dq, want[0], atol=0, rtol=0)
    torch.testing.assert_close(dkv, want[1], atol=0, rtol=0)


class _FusedStandIn:
    """Stands in for fused_impl on the CPU with the fused hosts' contracts: the forward takes `indexer_topk` as a
    keyword only when it is > 0 and then returns four values; both record their calls and run the reference."""

    def __init__(self):
        self.forward_kwargs, self.backward_calls = [], 0

    def __call__(self, op, device):
        if op == "sparse_attention":
            def forward(q, kv, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v, config=None,
                        indexer_topk=0, keep_plan=None):      # keeps no plan: every call takes the full path
                self.forward_kwargs.append(indexer_topk)
                outs = ref.sparse_attention_forward(q, kv, topk_idxs, attn_sink=attn_sink, topk_length=topk_length,
                                                    softmax_scale=softmax_scale, d_v=d_v,
                                                    indexer_topk=indexer_topk or None)
                return outs if indexer_topk else outs[:3]
            return forward
        assert op == "sparse_attention_backward", op

        def backward(q, kv, out, dout, lse, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v,
                     deterministic, workspace):
            self.backward_calls += 1
            return ref.sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs,
                                                 topk_length=topk_length, softmax_scale=softmax_scale, d_v=d_v)
        return backward


@pytest.mark.parametrize("grad", [False, True])
def test_fused_path_passes_indexer_topk_to_the_host_only_when_positive(monkeypatch, grad):
    stand_in = _FusedStandIn()
    monkeypatch.setattr(sa_mod, "fused_impl", stand_in)
    q, kv, idx, sk, ln = random_case(s_q=5, s_kv=300, k=256, seed=322)
    leaves = [x.clone().requires_grad_(grad) for x in (q, kv, sk.double())]
    args = (*leaves[:2], idx)
    kw = dict(attn_sink=leaves[2], topk_length=ln, impl="fused")
    three = dsagen.sparse_attention(*args, **kw)
    none = dsagen.sparse_attention(*args, indexer_topk=0, **kw)
    out, lse, mx, lse_idx = dsagen.sparse_attention(*args, indexer_topk=128, **kw)
    assert len(three) == 3 and none[3] is None
    assert stand_in.forward_kwargs == [0, 0, 128]
    torch.testing.assert_close(lse_idx, prefix_lse(q, kv, idx, ln, 128))
    assert lse_idx.grad_fn is None and not lse_idx.requires_grad
    if grad:
        out.sum().backward()
        assert stand_in.backward_calls == 1 and leaves[0].grad is not None and leaves[2].grad is not None


def test_signature_and_docstring():
    sig = inspect.signature(dsagen.sparse_attention)
    p = sig.parameters["indexer_topk"]
    assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    doc = inspect.getdoc(dsagen.sparse_attention)
    for needle in ("indexer_topk", "lse_indexer", "multiple of 128", "cuDNN frontend DSA §1", "+inf"):
        assert needle in doc, needle
