"""Reference NSA (ejkernel NSA): selected and compressed branches against brute-force loops and dense
causal attention, block selection, gates, GQA, varlen, gradcheck and validation errors."""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.reference import nsa as ref

INF = float("inf")


def nsa(*args, **kw):
    kw.setdefault("impl", "reference")
    return dsagen.native_sparse_attention(*args, **kw)


def inputs(b=2, t=10, hq=4, h=2, d=5, dv=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return mk(b, t, hq, d), mk(b, t, h, d), mk(b, t, h, dv), g


def softmax_rows(scores, values):
    """sum_i softmax(scores)_i * values_i for a non-empty list."""
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    z = sum(w)
    return sum(wi / z * vi for wi, vi in zip(w, values))


def brute_selected(q, k, v, bi, counts, bs, scale):
    """One sequence `[L, ...]`, loops: selected-branch output `[L, HQ, Dv]`."""
    length, hq, _ = q.shape
    h = k.shape[1]
    g = hq // h
    nb = -(-length // bs)
    out = torch.zeros(length, hq, v.shape[-1], dtype=torch.float64)
    for t in range(length):
        for qh in range(hq):
            kh = qh // g
            toks = []
            for s in range(bi.shape[-1]):
                j = int(bi[t, kh, s])
                if s < int(counts[t, kh]) and 0 <= j < nb:
                    toks += [u for u in range(j * bs, j * bs + bs) if u <= t]
            if toks:
                scores = [scale * float(q[t, qh].double() @ k[u, kh].double()) for u in toks]
                out[t, qh] = softmax_rows(scores, [v[u, kh].double() for u in toks])
    return out


def brute_compressed(q, k, v, bs, scale, num_select):
    """One sequence: (o_cmp `[L, HQ, Dv]`, selected block ids `[L, H, num_select]`) by loops."""
    length, hq, _ = q.shape
    h = k.shape[1]
    g = hq // h
    nb = -(-length // bs)
    kc = [torch.stack([k[u].double() for u in range(c * bs, min(c * bs + bs, length))]).sum(0) / bs for c in range(nb)]
    vc = [torch.stack([v[u].double() for u in range(c * bs, min(c * bs + bs, length))]).sum(0) / bs for c in range(nb)]
    o = torch.zeros(length, hq, v.shape[-1], dtype=torch.float64)
    sel = torch.full((length, h, num_select), -1, dtype=torch.long)
    for t in range(length):
        complete = (t + 1) // bs
        qb = t // bs
        importance = [[0.0] * nb for _ in range(h)]
        for qh in range(hq):
            kh = qh // g
            scores = [scale * float(q[t, qh].double() @ kc[c][kh]) for c in range(complete)]
            if scores:
                o[t, qh] = softmax_rows(scores, [vc[c][kh] for c in range(complete)])
                lse = max(scores) + math.log(sum(math.exp(s - max(scores)) for s in scores))
            for c in range(qb + 1):
                importance[kh][c] += 1.0 if c == qb else math.exp(scores[c] - lse)
        for kh in range(h):
            ranked = sorted(range(qb + 1), key=lambda c: (-importance[kh][c], -c))[:num_select]
            sel[t, kh, :len(ranked)] = torch.tensor(ranked)
    return o, sel


@pytest.mark.parametrize("bs", [1, 3, 4])
@pytest.mark.parametrize("per_token_counts", [False, True])
def test_selected_branch_matches_brute_force(bs, per_token_counts):
    q, k, v, g = inputs(seed=bs)
    nb = -(-10 // bs)
    bi = torch.randint(-1, nb + 2, (2, 10, 2, 3), generator=g, dtype=torch.int32)  # -1, out of range, repeats
    counts = torch.randint(0, 4, (2, 10, 2), generator=g) if per_token_counts else 2
    out = nsa(q, k, v, block_indices=bi, block_counts=counts, block_size=bs, softmax_scale=0.45)
    cnt = counts if per_token_counts else torch.full((2, 10, 2), 2)
    for b in range(2):
        torch.testing.assert_close(out[b], brute_selected(q[b], k[b], v[b], bi[b], cnt[b], bs, 0.45))


def test_all_blocks_is_dense_causal_gqa_attention():
    q, k, v, _ = inputs(b=1, t=9, hq=6, h=2, d=4, dv=4, seed=1)
    nb = 3
    bi = torch.arange(nb, dtype=torch.int32).expand(1, 9, 2, nb)  # every block; causality trims the future
    out = nsa(q, k, v, block_indices=bi, block_counts=nb, block_size=3)
    kk, vv = k.repeat_interleave(3, 2), v.repeat_interleave(3, 2)
    s = torch.einsum("bthd,buhd->bhtu", q, kk) / 2
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -INF)
    torch.testing.assert_close(out, torch.einsum("bhtu,buhd->bthd", torch.softmax(s, -1), vv))


def test_compressed_branch_selection_and_gates_match_brute_force():
    q, k, v, g = inputs(b=1, t=11, hq=4, h=2, d=4, dv=3, seed=2)
    bs, num_select = 3, 2
    g_cmp = torch.rand(1, 11, 4, generator=g, dtype=torch.float64)
    g_slc = torch.rand(1, 11, 4, generator=g, dtype=torch.float64)
    out = nsa(q, k, v, g_cmp, g_slc, block_counts=num_select, block_size=bs)
    o_cmp, sel = brute_compressed(q[0], k[0], v[0], bs, 0.5, num_select)
    o_slc = brute_selected(q[0], k[0], v[0], sel, torch.full((11, 2), num_select), bs, 0.5)
    torch.testing.assert_close(out[0], o_slc * g_slc[0, ..., None] + o_cmp * g_cmp[0, ..., None])
    # the internal selection agrees with the loop (ties go to the larger block id)
    _, chosen = ref._compressed_branch(q[0], ref.mean_pool_blocks(k[0], bs), ref.mean_pool_blocks(v[0], bs),
                                       bs, 0.5, num_select)
    torch.testing.assert_close(chosen, sel)
    assert chosen[0].tolist() == [[0, -1], [0, -1]]  # only the own block exists for the first token


def test_selection_tie_breaks_toward_larger_block():
    # Zero queries make every complete block equally likely: the own block (forced to 1) ranks first,
    # then equal scores rank by descending block id.
    q = torch.zeros(1, 8, 2, 3, dtype=torch.float64)
    k = torch.randn(1, 8, 1, 3, dtype=torch.float64)
    v = torch.randn(1, 8, 1, 3, dtype=torch.float64)
    _, chosen = ref._compressed_branch(q[0], ref.mean_pool_blocks(k[0], 2), ref.mean_pool_blocks(v[0], 2), 2, 0.5, 3)
    assert chosen[7, 0].tolist() == [3, 2, 1]


def test_varlen_equals_separate_sequences():
    q, k, v, g = inputs(b=1, t=13, hq=4, h=2, d=4, dv=3, seed=3)
    cu = [0, 5, 5, 13]
    bi = torch.randint(-1, 3, (1, 13, 2, 2), generator=g, dtype=torch.int32)
    counts = torch.randint(0, 3, (1, 13, 2), generator=g, dtype=torch.int32)
    g_cmp = torch.rand(1, 13, 4, generator=g, dtype=torch.float64)
    for kwargs in (dict(block_indices=bi), dict(g_cmp=g_cmp)):
        out = nsa(q, k, v, block_counts=counts, cu_seqlens=torch.tensor(cu), block_size=2, **kwargs)
        for a, b in zip(cu, cu[1:]):
            part = {name: x[:, a:b] for name, x in kwargs.items()}
            alone = nsa(q[:, a:b], k[:, a:b], v[:, a:b], block_counts=counts[:, a:b], block_size=2, **part)
            torch.testing.assert_close(out[:, a:b], alone)


def test_fp32_and_bf16_against_fp64():
    q, k, v, g = inputs(t=12, dtype=torch.float32, seed=4)
    bi = torch.randint(-1, 3, (2, 12, 2, 3), generator=g, dtype=torch.int32)
    g_cmp = torch.rand(2, 12, 4, generator=g)
    want = nsa(q.double(), k.double(), v.double(), g_cmp.double(), block_counts=3, block_size=4)
    got = nsa(q, k, v, g_cmp, block_counts=3, block_size=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    got16 = nsa(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_indices=bi, block_size=4)
    want16 = nsa(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), block_indices=bi, block_size=4)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), want16, atol=2e-2, rtol=2e-2)


def test_empty_rows_give_zeros_and_chunking_is_exact(monkeypatch):
    q, k, v, _ = inputs(b=1, t=6, seed=5)
    bi = torch.full((1, 6, 2, 2), -1, dtype=torch.int32)
    bi[0, 3:, 0, 0] = 1
    out = nsa(q, k, v, block_indices=bi, block_size=2)
    assert torch.all(out[0, :3] == 0) and torch.all(out[0, 3:, 2:] == 0)  # KV head 1 (q heads 2, 3) empty
    assert torch.all(out[0, 3:, :2] != 0)
    assert torch.all(nsa(q, k, v, block_indices=bi, block_counts=0, block_size=2) == 0)
    g_cmp = torch.ones(1, 6, 4, dtype=torch.float64)
    full = nsa(q, k, v, g_cmp, block_counts=2, block_size=2)
    from dsagen.reference import sparse_attention as sa_ref
    monkeypatch.setattr(sa_ref, "CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(nsa(q, k, v, g_cmp, block_counts=2, block_size=2), full, atol=0, rtol=0)


def test_gradcheck_selected_branch_with_gate():
    q, k, v, g = inputs(b=1, t=6, hq=2, h=1, d=3, dv=2, seed=6)
    bi = torch.randint(-1, 3, (1, 6, 1, 2), generator=g, dtype=torch.int32)
    bi[0, :, 0, 0] = 0
    g_slc = torch.rand(1, 6, 2, generator=g, dtype=torch.float64)
    args = tuple(x.requires_grad_() for x in (q, k, v, g_slc))
    fn = lambda a, b, c, s: nsa(a, b, c, g_slc=s, block_indices=bi, block_counts=2, block_size=2)
    assert torch.autograd.gradcheck(fn, args)


def test_gradcheck_compressed_branch():
    q, k, v, g = inputs(b=1, t=7, hq=2, h=1, d=3, dv=2, seed=7)
    g_cmp = torch.rand(1, 7, 2, generator=g, dtype=torch.float64)
    g_slc = torch.rand(1, 7, 2, generator=g, dtype=torch.float64)
    args = tuple(x.requires_grad_() for x in (q, k, v, g_cmp, g_slc))
    fn = lambda a, b, c, gc, gs: nsa(a, b, c, gc, gs, block_counts=2, block_size=2,
                                     cu_seqlens=torch.tensor([0, 3, 7]))
    assert torch.autograd.gradcheck(fn, args)


def test_block_indices_ignored_with_g_cmp_warns():
    q, k, v, g = inputs(b=1, t=6, seed=8)
    g_cmp = torch.rand(1, 6, 4, generator=g, dtype=torch.float64)
    bi = torch.zeros(1, 6, 2, 1, dtype=torch.int32)
    with pytest.warns(UserWarning, match="block_indices"):
        with_bi = nsa(q, k, v, g_cmp, block_indices=bi, block_counts=2, block_size=2)
    torch.testing.assert_close(with_bi, nsa(q, k, v, g_cmp, block_counts=2, block_size=2))


def test_fused_on_cpu_raises_value_error_and_is_the_default():
    q, k, v, _ = inputs(b=1, t=4)
    bi = torch.zeros(1, 4, 2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="native_sparse_attention"):
        dsagen.native_sparse_attention(q, k, v, block_indices=bi)


def test_validation_names_the_argument():
    q, k, v, _ = inputs(b=1, t=6)
    bi = torch.zeros(1, 6, 2, 1, dtype=torch.int32)
    gate = torch.ones(1, 6, 4, dtype=torch.float64)
    checks = [
        (lambda: nsa(q, k, v, block_indices=bi, impl="x"), ValueError, "impl"),
        (lambda: nsa(q[0], k, v, block_indices=bi), ValueError, "query"),
        (lambda: nsa(q.long(), k, v, block_indices=bi), TypeError, "query"),
        (lambda: nsa(q, k.float(), v, block_indices=bi), TypeError, "key"),
        (lambda: nsa(q, k[:, :5], v, block_indices=bi), ValueError, "key"),
        (lambda: nsa(q, k[:, :, :1].expand(1, 6, 3, 5), v, block_indices=bi), ValueError, "key"),
        (lambda: nsa(q, k, v[:, :, :1], block_indices=bi), ValueError, "value"),
        (lambda: nsa(q, k, v, g_cmp=gate[..., :2]), ValueError, "g_cmp"),
        (lambda: nsa(q, k, v, g_slc=gate.long(), block_indices=bi), TypeError, "g_slc"),
        (lambda: nsa(q, k, v, block_indices=bi.float()), TypeError, "block_indices"),
        (lambda: nsa(q, k, v, block_indices=bi[:, :3]), ValueError, "block_indices"),
        (lambda: nsa(q, k, v), ValueError, "block_indices"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=-1), ValueError, "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=2.0), TypeError, "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=torch.ones(1, 6, 1, dtype=torch.int32)), ValueError,
         "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=-torch.ones(1, 6, 2, dtype=torch.int32)), ValueError,
         "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_size=0), ValueError, "block_size"),
        (lambda: nsa(q, k, v, block_indices=bi, softmax_scale=float("nan")), ValueError, "softmax_scale"),
        (lambda: nsa(q, k, v, block_indices=bi, cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens"),
        (lambda: nsa(q, k, v, block_indices=bi, cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens"),
        (lambda: nsa(q, k, v, block_indices=bi, cu_seqlens=torch.tensor([1, 6])), ValueError, "cu_seqlens"),
        (lambda: nsa(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                     block_indices=bi.expand(2, -1, -1, -1), cu_seqlens=torch.tensor([0, 6])), ValueError,
         "cu_seqlens"),
    ]
    for fn, exc, name in checks:
        with pytest.raises(exc, match=name):
            fn()
