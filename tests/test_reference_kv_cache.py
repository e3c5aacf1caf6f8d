"""dsagen.quantize_kv_fp8 / dequantize_kv_fp8, impl="reference": DeepSeek-V3.2's FP8 MLA cache format byte by byte
(FlashMLA's sparse-decode cache, tests/quant.py's V32_FP8Sparse layout), the round trip, and argument errors."""

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
