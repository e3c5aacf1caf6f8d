"""Two documented gaps, closed: indexer_topk's speculative-decoding stagger (next_n, cuDNN frontend DSA §5 / the
cuDNN IndexerTopK) and native_sparse_attention's per-query-block block_indices / block_counts layout
(ejkernel NSA). Hand-computed cases, brute-force loops, layout equivalence (values and FP64 gradients) and
the validation messages."""

from __future__ import annotations

import pytest
import torch

import dsagen
import dsagen.ops._fused
from dsagen.ops import nsa as nsa_ops
from dsagen.ops.indexer import indexer_topk
from dsagen.reference import nsa as nsa_ref
from dsagen.reference.indexer import indexer_topk as reference_topk
from dsagen.reference.indexer import staggered_row_lengths

REF = dict(impl="reference")
I32 = dict(dtype=torch.int32)
INF = float("inf")


# --- indexer_topk next_n ----------------------------------------------------------------------------------

def ranked(vals, n, top_k):
    """The first n columns by descending value, ties toward the lower column, -1 padded to top_k."""
    ids = sorted(range(n), key=lambda c: (-vals[c], c))[:top_k]
    return ids + [-1] * (top_k - len(ids))


def brute_lengths(seq_lens, next_n, n_cols):
    """Row r of sequence r // next_n sees seq_lens[r // next_n] - next_n + (r % next_n) + 1 columns."""
    rows = len(seq_lens) * next_n
    return [min(max(seq_lens[r // next_n] - next_n + r % next_n + 1, 0), n_cols) for r in range(rows)]


def test_next_n_hand_computed():
    x = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0], [1.0, 3.0, 2.0, 5.0, 4.0],
                      [9.0, 8.0, 7.0, 6.0, 5.0], [5.0, 6.0, 7.0, 8.0, 9.0]])
    # Two sequences of two draft rows: lengths [4 - 1, 4] and [2 - 1, 2].
    res = indexer_topk(x, torch.tensor([4, 2], **I32), 3, next_n=2, **REF)
    assert res.indices.tolist() == [[1, 2, 0], [3, 1, 2], [0, -1, -1], [1, 0, -1]]
    assert res.values.tolist() == [[3.0, 2.0, 1.0], [5.0, 3.0, 2.0], [9.0, -INF, -INF], [6.0, 5.0, -INF]]
    assert res.indices.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("groups,next_n,n_cols,top_k", [(3, 2, 9, 4), (2, 4, 7, 7), (4, 3, 12, 2), (1, 5, 6, 9)])
def test_next_n_matches_brute_force_loop(dtype, groups, next_n, n_cols, top_k):
    g = torch.Generator().manual_seed(groups * 10 + next_n)
    x = torch.randint(-3, 4, (groups * next_n, n_cols), generator=g).to(dtype)  # many exact ties
    # Lengths below next_n (early rows empty), negative, inside and beyond num_cols.
    lens = torch.randint(-2, n_cols + next_n + 2, (groups,), generator=g, **I32)
    lens[0] = 1  # only the last row of sequence 0 sees a column
    res = indexer_topk(x, lens, top_k, next_n=next_n, **REF)
    row_len = brute_lengths(lens.tolist(), next_n, n_cols)
    for r in range(groups * next_n):
        want = ranked(x[r].tolist(), row_len[r], top_k)
        assert res.indices[r].tolist() == want, r
        assert res.values[r].tolist() == [x[r, c].item() if c >= 0 else -INF for c in want]


def test_next_n_equals_per_row_lengths_and_default_is_unchanged():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 10, generator=g)
    lens = torch.tensor([7, 3, 10, 0], **I32)
    per_row = torch.tensor(brute_lengths(lens.tolist(), 3, 10), **I32)
    staggered = indexer_topk(x, lens, 5, next_n=3, **REF)
    assert torch.equal(staggered.indices, indexer_topk(x, per_row, 5, **REF).indices)
    assert torch.equal(staggered_row_lengths(lens, 12, 10, 3), per_row.long())
    # next_n = 1 keeps the old grouping: G dividing n_rows, every row of a group the same length.
    grouped = indexer_topk(x, lens, 5, **REF)
    assert torch.equal(grouped.indices, indexer_topk(x, lens, 5, next_n=1, **REF).indices)
    assert torch.equal(grouped.indices, indexer_topk(x, lens.repeat_interleave(3), 5, **REF).indices)


def test_next_n_lengths_do_not_wrap_at_int32_extremes():
    lens = torch.tensor([torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max], **I32)
    assert staggered_row_lengths(lens, 6, 5, 3).tolist() == [0, 0, 0, 5, 5, 5]
    res = indexer_topk(torch.arange(30.0).view(6, 5), lens, 2, next_n=3, **REF)
    assert res.indices.tolist() == [[-1, -1]] * 3 + [[4, 3]] * 3


def test_next_n_fused_path_receives_per_row_lengths(monkeypatch):
    seen = {}

    def fake_kernel(values, seq_lens, top_k, *, return_values):
        seen["seq_lens"] = seq_lens
        return reference_topk(values, seq_lens, top_k, return_values=return_values)

    monkeypatch.setattr(dsagen.ops._fused, "fused_impl", lambda op, device: fake_kernel)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([5, 9], **I32)
    got = indexer_topk(x, lens, 3, next_n=3, impl="fused")
    assert seen["seq_lens"].dtype == torch.int32
    assert seen["seq_lens"].tolist() == brute_lengths([5, 9], 3, 8)
    assert torch.equal(got.indices, indexer_topk(x, lens, 3, next_n=3, **REF).indices)


@pytest.mark.parametrize("bad,err", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_next_n_bad_values_name_next_n(bad, err):
    with pytest.raises(err, match="next_n"):
        indexer_topk(torch.zeros(4, 3), torch.ones(2, **I32), 1, next_n=bad, **REF)


def test_next_n_row_count_mismatch_names_next_n():
    # G = 2 divides 6 rows (fine for next_n = 1) but 6 != 2 * next_n for next_n = 2.
    indexer_topk(torch.zeros(6, 3), torch.ones(2, **I32), 1, **REF)
    with pytest.raises(ValueError, match="next_n"):
        indexer_topk(torch.zeros(6, 3), torch.ones(2, **I32), 1, next_n=2, **REF)
    with pytest.raises(ValueError, match="next_n"):
        indexer_topk(torch.zeros(6, 3), torch.ones(6, **I32), 1, next_n=2, impl="fused")


# --- native_sparse_attention: per-query-block layout ---------------------------------------------------

def nsa(*args, **kw):
    kw.setdefault("impl", "reference")
    return dsagen.native_sparse_attention(*args, **kw)


def qkv(b, t, hq, h, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    return mk(b, t, hq, d), mk(b, t, h, d), mk(b, t, h, dv), g


def to_tokens_by_loop(per_block, lengths, bs):
    """[B, H, NQB, ...] -> [B, T, H, ...] by loops; `lengths`: the packed sequence lengths (B = 1) or
    [T] for every batch. Query blocks restart per sequence and are numbered sequence after sequence."""
    b, h = per_block.shape[:2]
    rows, first = [], 0
    for n in lengths:
        rows += [first + p // bs for p in range(n)]
        first += -(-n // bs)
    out = per_block.new_empty(b, len(rows), h, *per_block.shape[3:])
    for bi in range(b):
        for t, j in enumerate(rows):
            for kh in range(h):
                out[bi, t, kh] = per_block[bi, kh, j]
    return out


def test_per_block_layout_hand_computed():
    # q = 0: uniform attention over the allowed tokens, so the output is their mean value.
    q = torch.zeros(1, 4, 1, 1, dtype=torch.float64)
    k = torch.zeros(1, 4, 1, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64).view(1, 4, 1, 1)
    bi = torch.tensor([[[[0, -1], [1, 0]]]], **I32)     # [B=1, H=1, NQB=2, S=2]: query block 1 reads 1 then 0
    out = nsa(q, k, v, block_indices=bi, block_counts=2, block_size=2)
    assert out.flatten().tolist() == pytest.approx([1.0, 1.5, 7 / 3, 15 / 4])
    counts = torch.tensor([[[2, 1]]], **I32)            # [B, H, NQB]: query block 1 keeps only block 1
    out = nsa(q, k, v, block_indices=bi, block_counts=counts, block_size=2)
    assert out.flatten().tolist() == pytest.approx([1.0, 1.5, 4.0, 6.0])


@pytest.mark.parametrize("b,t,hq,h,bs", [(2, 10, 4, 2, 3), (1, 9, 6, 3, 4), (2, 7, 2, 1, 7), (1, 5, 3, 3, 2)])
@pytest.mark.parametrize("counts_kind", ["int", "per_token", "per_block"])
def test_per_block_layout_equals_per_token_layout(b, t, hq, h, bs, counts_kind):
    q, k, v, g = qkv(b, t, hq, h, 4, 3, seed=t + bs)
    nqb = -(-t // bs)
    bi_blk = torch.randint(-1, nqb + 2, (b, h, nqb, 3), generator=g, dtype=torch.int64)  # -1, out of range
    bi_tok = to_tokens_by_loop(bi_blk, [t], bs)
    counts_blk = torch.randint(0, 4, (b, h, nqb), generator=g, dtype=torch.int32)
    counts = {"int": (2, 2), "per_token": (to_tokens_by_loop(counts_blk, [t], bs),) * 2,
              "per_block": (counts_blk, to_tokens_by_loop(counts_blk, [t], bs))}[counts_kind]
    got = nsa(q, k, v, block_indices=bi_blk, block_counts=counts[0], block_size=bs)
    want = nsa(q, k, v, block_indices=bi_tok, block_counts=counts[1], block_size=bs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_per_block_layout_varlen():
    q, k, v, g = qkv(1, 13, 4, 2, 4, 3, seed=11)
    cu, bs = [0, 5, 5, 13], 2
    nqb = 3 + 0 + 4                                    # blocks restart per sequence, numbered in order
    bi_blk = torch.randint(-1, 4, (1, 2, nqb, 2), generator=g, dtype=torch.int32)
    counts_blk = torch.randint(0, 3, (1, 2, nqb), generator=g, dtype=torch.int32)
    lengths = [y - x for x, y in zip(cu, cu[1:])]
    bi_tok, counts_tok = to_tokens_by_loop(bi_blk, lengths, bs), to_tokens_by_loop(counts_blk, lengths, bs)
    cu_t = torch.tensor(cu)
    got = nsa(q, k, v, block_indices=bi_blk, block_counts=counts_blk, cu_seqlens=cu_t, block_size=bs)
    want = nsa(q, k, v, block_indices=bi_tok, block_counts=counts_tok, cu_seqlens=cu_t, block_size=bs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # The last sequence alone, in the unpacked per-block layout, gives the same rows.
    alone = nsa(q[:, 5:], k[:, 5:], v[:, 5:], block_indices=bi_blk[:, :, 3:], block_counts=counts_blk[:, :, 3:],
                block_size=bs)
    torch.testing.assert_close(got[:, 5:], alone)


def test_per_block_layout_gradients_fp64():
    q, k, v, g = qkv(1, 6, 2, 1, 3, 2, seed=12)
    bi_blk = torch.tensor([[[[0, -1], [0, 1], [2, 1]]]], **I32)      # [1, H=1, NQB=3, 2]
    counts_blk = torch.tensor([[[1, 2, 2]]], **I32)
    g_slc = torch.rand(1, 6, 2, generator=g, dtype=torch.float64)
    args = tuple(x.requires_grad_() for x in (q, k, v, g_slc))
    fn = lambda a, b, c, s: nsa(a, b, c, g_slc=s, block_indices=bi_blk, block_counts=counts_blk, block_size=2)
    assert torch.autograd.gradcheck(fn, args)
    # Autograd gradients equal the per-token layout's, on random inputs.
    q, k, v, g = qkv(2, 9, 4, 2, 5, 3, seed=13)
    bi_blk = torch.randint(-1, 3, (2, 2, 3, 2), generator=g, dtype=torch.int64)
    grads = []
    for bi in (bi_blk, to_tokens_by_loop(bi_blk, [9], 3)):
        leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))
        out = nsa(*leaves, block_indices=bi, block_counts=2, block_size=3)
        grads.append(torch.autograd.grad((out * out.detach().cos()).sum(), leaves))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_per_block_counts_with_compressed_branch_and_ignored_indices():
    q, k, v, g = qkv(1, 8, 4, 2, 4, 3, seed=14)
    g_cmp = torch.rand(1, 8, 4, generator=g, dtype=torch.float64)
    counts_blk = torch.tensor([[[1, 2, 1, 2], [2, 2, 1, 1]]], **I32)   # [1, H=2, NQB=4]
    want = nsa(q, k, v, g_cmp, block_counts=to_tokens_by_loop(counts_blk, [8], 2), block_size=2)
    torch.testing.assert_close(nsa(q, k, v, g_cmp, block_counts=counts_blk, block_size=2), want)
    with pytest.warns(UserWarning, match="block_indices"):
        got = nsa(q, k, v, g_cmp, block_indices=torch.zeros(1, 2, 4, 1, **I32), block_counts=counts_blk,
                  block_size=2)
    torch.testing.assert_close(got, want)


def test_ambiguous_shape_is_read_per_token():
    # block_size 1 and T = H: [B, T, H, S] and [B, H, NQB, S] coincide; per token wins (ejkernel's order).
    q, k, v, g = qkv(1, 2, 2, 2, 3, 2, seed=15)
    bi = torch.tensor([[[[0], [-1]], [[1], [0]]]], **I32)      # not symmetric in (T, H)
    got = nsa(q, k, v, block_indices=bi, block_size=1)
    torch.testing.assert_close(got, nsa_ref.native_sparse_attention(q, k, v, block_indices=bi, block_size=1))
    assert not torch.equal(got, nsa(q, k, v, block_indices=bi.transpose(1, 2), block_size=1))


def test_fused_path_receives_per_token_layout(monkeypatch):
    seen = {}

    def fake_kernel(*args, **kwargs):
        seen["block_indices"], seen["block_counts"] = args[5], args[6]
        return nsa_ref.native_sparse_attention(*args, **kwargs)

    monkeypatch.setattr(nsa_ops, "fused_impl", lambda op, device: fake_kernel)
    q, k, v, g = qkv(1, 6, 2, 1, 3, 2, seed=16)
    bi_blk = torch.randint(-1, 3, (1, 1, 3, 2), generator=g, dtype=torch.int32)
    counts_blk = torch.tensor([[[1, 2, 0]]], **I32)
    got = nsa(q, k, v, block_indices=bi_blk, block_counts=counts_blk, block_size=2, impl="fused")
    assert torch.equal(seen["block_indices"], to_tokens_by_loop(bi_blk, [6], 2))
    assert torch.equal(seen["block_counts"], to_tokens_by_loop(counts_blk, [6], 2))
    torch.testing.assert_close(got, nsa(q, k, v, block_indices=bi_blk, block_counts=counts_blk, block_size=2))


def test_layout_errors_name_the_argument():
    q, k, v, _ = qkv(1, 6, 4, 2, 3, 2, seed=17)                      # T = 6, H = 2, block_size 2: NQB = 3
    bi = torch.zeros(1, 2, 3, 1, **I32)
    checks = [
        (lambda: nsa(q, k, v, block_indices=torch.zeros(1, 2, 4, 1, **I32), block_size=2), "block_indices"),
        (lambda: nsa(q, k, v, block_indices=torch.zeros(1, 3, 3, 1, **I32), block_size=2), "block_indices"),
        (lambda: nsa(q, k, v, block_indices=bi, block_size=3), "block_indices"),   # NQB would be 2
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=torch.ones(1, 2, 4, **I32), block_size=2),
         "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=torch.ones(1, 2, **I32), block_size=2), "block_counts"),
        (lambda: nsa(q, k, v, block_indices=bi, block_counts=-torch.ones(1, 2, 3, **I32), block_size=2),
         "block_counts"),
        # Per-query-block + packed sequences: NQB counts the sequences' blocks, so bad offsets are caught
        # whatever the impl (here: fused, before any kernel is looked up).
        (lambda: nsa(q, k, v, block_indices=bi, cu_seqlens=torch.tensor([0, 7]), block_size=2, impl="fused"),
         "cu_seqlens"),
        (lambda: nsa(q, k, v, block_indices=torch.zeros(1, 2, 3, 1, **I32), cu_seqlens=torch.tensor([0, 3, 6]),
                     block_size=2), "block_indices"),                          # packed NQB = 2 + 2 = 4
    ]
    for fn, name in checks:
        with pytest.raises(ValueError, match=name):
            fn()
    with pytest.raises(TypeError, match="block_indices"):
        nsa(q, k, v, block_indices=bi.float(), block_size=2)
