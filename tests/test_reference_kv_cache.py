"""The paged-cache ops, impl="reference": quantize_kv_fp8 / dequantize_kv_fp8 (DeepSeek-V3.2's FP8 MLA cache format
byte by byte: FlashMLA's sparse-decode cache, tests/quant.py's V32_FP8Sparse layout), sparse_attention_decode over
a paged cache, quantize_index_k_fp8 (DeepGEMM's paged index-key layout) and indexer_decode_topk; argument errors."""

from __future__ import annotations

import pytest
import torch

import dsagen

REF = dict(impl="reference")


def _flashmla_style(kv: torch.Tensor) -> torch.Tensor:
    """An independent per-tile writer of the same format for [N, 576] bf16 rows (the steps FlashMLA's
    tests/quant.py takes: per tile the bf16 |max|, / 448 in FP32, rounded up to a power of two with a 1e-4 floor,
    the FP32 quotient cast to E4M3), assembled by byte offsets."""
    n = kv.shape[0]
    out = torch.zeros((n, 656), dtype=torch.uint8)
    for t in range(4):
        tile = kv[:, 128 * t:128 * (t + 1)]
        inv = tile.abs().max(dim=-1).values.float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).float()
        out[:, 512 + 4 * t:516 + 4 * t] = inv.view(-1, 1).view(torch.uint8)
        out[:, 128 * t:128 * (t + 1)] = (tile.float() / inv[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, 528:] = kv[:, 512:].contiguous().view(torch.uint8)
    return out


def _rows(n, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g) * scale
    x[0, :128] = 0.0                                   # an all-zero tile: scale 2 ** -13
    x[1, 128:256] *= 1e-6                              # a tiny tile: the 1e-4 floor
    x[2, 256:384] *= 1e4                               # a huge tile
    x[3, 384:512] = 448.0                              # amax exactly 448 * 2 ** 0
    return x.to(torch.bfloat16)


def test_bytes_equal_an_independent_writer():
    x = _rows(64, 0, 3.0)
    got = dsagen.quantize_kv_fp8(x, **REF)
    assert got.dtype == torch.uint8 and got.shape == (64, 656) and got.is_contiguous()
    assert torch.equal(got, _flashmla_style(x))


def test_layout_of_one_token():
    x = torch.zeros(576, dtype=torch.bfloat16)
    x[5], x[200], x[300], x[511] = 3.0, -1024.0, 0.25, 448.0
    x[512:] = torch.arange(64, dtype=torch.bfloat16)
    b = dsagen.quantize_kv_fp8(x, **REF)
    assert b.shape == (656,)
    scales = b[512:528].view(torch.float32)
    # tile amaxes 3, 1024, 0.25, 448 -> 2 ** ceil(log2(amax / 448)) with the 1e-4 floor
    assert scales.tolist() == [2.0 ** -7, 4.0, 2.0 ** -10, 1.0]
    nope = b[:512].view(torch.float8_e4m3fn).float()
    assert nope[5] == 3.0 * 2 ** 7 == 384.0 and nope[200] == -256.0 and nope[300] == 256.0 and nope[511] == 448.0
    assert torch.equal(b[528:].view(torch.bfloat16), x[512:])


def test_round_trip():
    x = _rows(300, 1, 2.0).view(3, 100, 1, 576)               # a paged-cache shaped block of tokens
    b = dsagen.quantize_kv_fp8(x, **REF)
    assert b.shape == (3, 100, 1, 656)
    y = dsagen.dequantize_kv_fp8(b, **REF)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y[..., 512:], x[..., 512:])
    scales = b[..., 512:528].contiguous().view(torch.float32)                      # [..., 4]
    step = scales.repeat_interleave(128, dim=-1)                                    # the tile's scale per value
    err = (y[..., :512].float() - x[..., :512].float()).abs()
    # E4M3: half an ulp is 2 ** -4 of the value (normal) or 2 ** -10 of the scale (subnormal); bf16 output rounding
    bound = torch.maximum(x[..., :512].float().abs() * 2 ** -4, step * 2 ** -10) * (1 + 2 ** -7) + 1e-30
    assert (err <= bound).all()
    # the stored values are E4M3 x power of two: reading gives them exactly, and the cache takes float8 views too
    assert torch.equal(dsagen.dequantize_kv_fp8(b.view(torch.float8_e4m3fn), **REF), y)


def test_reader_takes_strided_paged_caches():
    x = _rows(32, 2)
    pages = torch.zeros(4, 9, 1, 656, dtype=torch.uint8)        # one padding token per page, as FlashMLA's tests
    cache = pages[:, :8]                                      # [4, 8, 1, 656], not contiguous
    for i in range(32):
        cache[i // 8, i % 8, 0] = dsagen.quantize_kv_fp8(x[i], **REF)
    assert torch.equal(dsagen.dequantize_kv_fp8(cache, **REF).view(32, 576), dsagen.dequantize_kv_fp8(
        dsagen.quantize_kv_fp8(x, **REF), **REF))


@pytest.mark.parametrize("call,err,text", [
    (lambda: dsagen.quantize_kv_fp8(torch.zeros(4, 576), **REF), TypeError, "kv"),
    (lambda: dsagen.quantize_kv_fp8(torch.zeros(4, 512, dtype=torch.bfloat16), **REF), ValueError, "kv"),
    (lambda: dsagen.dequantize_kv_fp8(torch.zeros(4, 656, dtype=torch.int32), **REF), TypeError, "cache"),
    (lambda: dsagen.dequantize_kv_fp8(torch.zeros(4, 576, dtype=torch.uint8), **REF), ValueError, "cache"),
    (lambda: dsagen.quantize_kv_fp8(torch.zeros(2, 576, dtype=torch.bfloat16), impl="eager"), ValueError, "impl"),
    (lambda: dsagen.quantize_kv_fp8(torch.zeros(2, 576, dtype=torch.bfloat16)), ValueError, "fused"),
    (lambda: dsagen.dequantize_kv_fp8(torch.zeros(2, 656, dtype=torch.uint8)), ValueError, "fused"),
])
def test_errors_name_the_argument(call, err, text):
    with pytest.raises(err, match=text):
        call()


# --- sparse_attention_decode over a paged cache ----------------------------------------------------------------

def _paged_case(seed=3, b=2, s_q=2, h=8, topk=12, n_blocks=6, page=4):
    """Queries, a page pool in random page order (a block table) and page-encoded indices of logical tokens."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, s_q, h, 576, generator=g)).to(torch.bfloat16)
    kv = (torch.randn(n_blocks * page, 576, generator=g) * 2).to(torch.bfloat16)     # logical rows of all sequences
    table = torch.randperm(n_blocks, generator=g)                                    # logical block -> page block
    cache8 = torch.zeros(n_blocks, page, 1, 656, dtype=torch.uint8)
    cache16 = torch.zeros(n_blocks, page, 1, 576, dtype=torch.bfloat16)
    for tok in range(n_blocks * page):
        cache8[table[tok // page], tok % page, 0] = dsagen.quantize_kv_fp8(kv[tok], **REF)
        cache16[table[tok // page], tok % page, 0] = kv[tok]
    logical = torch.randint(0, n_blocks * page, (b, s_q, topk), generator=g)
    logical[0, 0, 3] = -1                                  # an empty slot
    logical[1, 1, :] = -1                                  # an empty row
    paged = torch.where(logical >= 0, table[logical.clamp_min(0) // page] * page + logical.clamp_min(0) % page,
                        torch.full_like(logical, -1)).to(torch.int32)
    return q, kv, cache8, cache16, logical.to(torch.int32), paged


def test_decode_equals_sparse_attention_on_the_dequantized_rows():
    q, kv, cache8, cache16, logical, paged = _paged_case()
    sink = torch.randn(8, generator=torch.Generator().manual_seed(4))
    length = torch.tensor([10, 12], dtype=torch.int32)
    deq = dsagen.dequantize_kv_fp8(dsagen.quantize_kv_fp8(kv, **REF), **REF)        # the FP8 cache's values
    for cache, rows in ((cache8, deq), (cache16, kv)):
        out, lse = dsagen.sparse_attention_decode(q, cache, paged, attn_sink=sink, topk_length=length, **REF)
        want_out, want_lse, _ = dsagen.sparse_attention(q, rows[None].expand(2, -1, -1), logical, attn_sink=sink,
                                                        topk_length=length[:, None].expand(2, 2).contiguous(),
                                                        d_v=512, **REF)
        assert out.shape == (2, 2, 8, 512) and out.dtype == torch.bfloat16 and lse.shape == (2, 2, 8)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert (out[1, 1] == 0).all() and torch.isinf(lse[1, 1]).all()                      # the empty row


def test_decode_argument_errors():
    q, _, cache8, cache16, _, paged = _paged_case()
    cases = [
        (dict(q=q.float()), TypeError, "q"),
        (dict(q=q[..., :512]), ValueError, "q"),
        (dict(kv_cache=cache8[..., :600]), ValueError, "kv_cache"),
        (dict(kv_cache=cache16.float()), TypeError, "kv_cache"),
        (dict(indices=paged.long()), TypeError, "indices"),
        (dict(indices=paged[:1]), ValueError, "indices"),
        (dict(topk_length=torch.ones(3, dtype=torch.int32)), ValueError, "topk_length"),
        (dict(d_v=576), ValueError, "d_v"),
    ]
    for bad, err, text in cases:
        kw = dict(q=q, kv_cache=cache8, indices=paged, impl="reference")
        kw.update(bad)
        with pytest.raises(err, match=text):
            dsagen.sparse_attention_decode(**kw)
    with pytest.raises(ValueError, match="fused"):
        dsagen.sparse_attention_decode(q, cache8, paged)


# --- the indexer's paged FP8 key cache and the decode-time indexer ------------------------------------------------

def test_index_key_cache_layout_and_round_trip():
    g = torch.Generator().manual_seed(9)
    k = (torch.randn(3, 4, 16, generator=g) * 5).to(torch.bfloat16)
    k[1, 2] = 0.0                                                     # an all-zero key: the 1e-4 floor
    cache = dsagen.quantize_index_k_fp8(k, **REF)
    assert cache.shape == (3, 4, 1, 20) and cache.dtype == torch.uint8
    flat = cache.reshape(3, 80)
    scale = (k.float().abs().amax(-1).clamp_min(1e-4) / 448.0)                     # [3, 4]
    assert torch.equal(flat[:, 64:].contiguous().view(torch.float32), scale)      # the block's scales after its values
    vals = flat[:, :64].contiguous().view(torch.float8_e4m3fn).float().view(3, 4, 16)
    assert torch.equal(vals, (k.float() * (1.0 / scale[..., None])).to(torch.float8_e4m3fn).float())
    from dsagen.reference.kv_cache import dequantize_index_k_fp8
    back = dequantize_index_k_fp8(cache)
    assert ((back - k.float()).abs() <= k.float().abs() * 2 ** -4 + scale[..., None] * 2 ** -10).all()


def _decode_indexer_case(seed=12, b=2, next_n=2, h=4, d=16, bs=4, n_blocks=8, grid=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        x = torch.randn(*shape, generator=g) * 2
        return torch.round(x * 4) / 4 if grid else x            # quarters: every score exact in FP32
    q, w, k_logical = r(b, next_n, h, d), r(b, next_n, h).float(), r(b, n_blocks * bs // b, d)
    lengths = torch.tensor([9, 14], dtype=torch.int32)
    table = torch.randperm(n_blocks, generator=g).to(torch.int32).view(b, n_blocks // b)
    cache = torch.zeros(n_blocks, bs, d)
    for bi in range(b):
        for s in range(n_blocks * bs // b):
            cache[table[bi, s // bs], s % bs] = k_logical[bi, s]
    return q, w, k_logical, cache, table, lengths


def _brute_decode(q, w, k_logical, table, lengths, top_k, bs):
    """FP64 scores, ranked by (score desc, position asc), mapped to page ids."""
    b, next_n = q.shape[:2]
    out = torch.full((b, next_n, top_k), -1, dtype=torch.int32)
    for bi in range(b):
        n = int(lengths[bi])
        for j in range(next_n):
            p = n - next_n + j
            sc = [(float((w[bi, j].double() * torch.relu(q[bi, j].double() @ k_logical[bi, s].double())).sum()), s)
                  for s in range(p + 1)]
            ranked = [s for _, s in sorted(sc, key=lambda t: (-t[0], t[1]))][:top_k]
            out[bi, j, :len(ranked)] = torch.tensor([int(table[bi, s // bs]) * bs + s % bs for s in ranked])
    return out


@pytest.mark.parametrize("top_k", [0, 5, 20])
def test_decode_indexer_bf16_equals_brute_force(top_k):
    q, w, k_logical, cache, table, lengths = _decode_indexer_case()
    got = dsagen.indexer_decode_topk(q.to(torch.bfloat16), w, cache.to(torch.bfloat16), table, lengths, top_k,
                                     **REF)
    assert got.shape == (2, 2, top_k) and got.dtype == torch.int32
    assert torch.equal(got, _brute_decode(q, w, k_logical, table, lengths, top_k, 4))


def test_decode_indexer_fp8_equals_bf16_on_the_same_values():
    """Keys whose scale is a power of two (one entry at 448 x 2**-3 per key) dequantize to bf16-exact values, so the
    FP8 cache and the bf16 cache of those values give the same ids."""
    q, w, _, cache, table, lengths = _decode_indexer_case(seed=13, grid=False)
    cache = torch.randn(cache.shape, generator=torch.Generator().manual_seed(2))
    cache[..., 0] = 56.0                                              # amax 56 = 448 / 8: scale 2 ** -3
    cache8 = dsagen.quantize_index_k_fp8(cache, **REF)
    from dsagen.reference.kv_cache import dequantize_index_k_fp8
    deq = dequantize_index_k_fp8(cache8)
    q8 = q.to(torch.float8_e4m3fn)
    a = dsagen.indexer_decode_topk(q8, w, cache8, table, lengths, 6, **REF)
    b = dsagen.indexer_decode_topk(q8.to(torch.bfloat16), w, deq.to(torch.bfloat16), table, lengths, 6, **REF)
    assert torch.equal(deq.to(torch.bfloat16).float(), deq) and torch.equal(a, b)


def test_decode_indexer_argument_errors():
    q, w, _, cache, table, lengths = _decode_indexer_case()
    qb, cb = q.to(torch.bfloat16), cache.to(torch.bfloat16)
    base = dict(q_indexer=qb, weights=w, k_cache=cb, block_table=table, cache_seqlens=lengths, top_k=4,
                impl="reference")
    cases = [
        (dict(q_indexer=q), TypeError, "q_indexer"),
        (dict(weights=w.double()), TypeError, "weights"),
        (dict(weights=w[:, :1]), ValueError, "weights"),
        (dict(k_cache=cb[..., :8]), ValueError, "k_cache"),
        (dict(q_indexer=qb.to(torch.float8_e4m3fn)), TypeError, "k_cache"),
        (dict(block_table=table[:1]), ValueError, "block_table"),
        (dict(cache_seqlens=lengths.long()), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([1, 14], dtype=torch.int32)), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([9, 17], dtype=torch.int32)), ValueError, "cache_seqlens"),
        (dict(top_k=-1), ValueError, "top_k"),
    ]
    for bad, err, text in cases:
        kw = dict(base, **bad)
        with pytest.raises(err, match=text):
            dsagen.indexer_decode_topk(**kw)
    with pytest.raises(ValueError, match="fused"):
        dsagen.indexer_decode_topk(qb, w, cb, table, lengths, 4)
