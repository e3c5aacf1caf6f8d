"""GPU tests of the fused sparse MLA decode over a paged cache (`dsagen.sparse_attention_decode(...,
impl="fused")`: the sparse MLA forward kernel over the cache as one flat pool of rows) against impl="reference":
B 1-5, s_q 1-4, H 64 / 128 (and 16, padded), topk 512 / 2048, random page-encoded ids with -1, ids past the cache
and repeats, topk_length per sequence and per token, a sink, empty rows (out 0, lse +inf), a cache that is a
slice of a wider buffer; small batches through the split over the KV slots (split_kv kernel + combine), large ones
without it, and the split against the unsplit kernel. The FP8 cache (quantize_kv_fp8's format, uint8 or
float8_e4m3fn): the same cases, and bitwise the BF16 kernel's results on the dequantized cache (the producer
dequantizes to dequantize_kv_fp8's bytes).

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsagen
import dsagen.kernels.sparse_mla.host as fwd_host
from dsagen.kernels.sparse_mla.decode_host import split_plan
from dsagen.kernels.sparse_mla.spec import SparseAttnCombineSpec, config_for

ARCH = "sm_90a"
DEV = "cuda"
REQUIRED_SPECS = [config_for(h, 576, "bfloat16", None, ARCH, None, fp8).spec(h, 576, "bfloat16", ARCH, kv_fp8=fp8,
                                                                             split_kv=split)
                  for h in (64, 128) for fp8 in (False, True) for split in (False, True)]
REQUIRED_SPECS += [SparseAttnCombineSpec(arch=ARCH)]
SHARED = dataclasses.replace(config_for(128, 576, "bfloat16", None, ARCH, None, True), shared_dequant=True)
ONE_CTA = dataclasses.replace(SHARED, shared_dequant=False)
REQUIRED_SPECS += [c.spec(128, 576, "bfloat16", ARCH, kv_fp8=True, split_kv=split)
                   for c in (SHARED, ONE_CTA) for split in (False, True)]

pytestmark = pytest.mark.gpu


def _case(b, s_q, h, topk, n_blocks, page, gen):
    q = torch.randn((b, s_q, h, 576), generator=gen).bfloat16().to(DEV)
    cache = torch.randn((n_blocks, page, 1, 576), generator=gen).bfloat16().to(DEV)
    rows = n_blocks * page
    ids = torch.randint(0, rows, (b, s_q, topk), generator=gen, dtype=torch.int32)
    u = torch.rand((b, s_q, topk), generator=gen)
    ids = torch.where(u < 0.1, torch.full_like(ids, -1), ids)
    ids = torch.where((u >= 0.1) & (u < 0.13), torch.full_like(ids, rows + 5), ids)
    ids = torch.where((u >= 0.13) & (u < 0.2), ids[..., :1].expand_as(ids), ids)        # repeats
    return q, cache, ids.to(DEV)


def _check(q, cache, ids, atol=2e-2, **kw):
    """The fused decode against the reference (atol: the output's absolute error bound, 2e-2 for values of unit
    scale)."""
    out, lse = dsagen.sparse_attention_decode(q, cache, ids, **kw)
    r_out, r_lse = dsagen.sparse_attention_decode(q, cache, ids, impl="reference", **kw)
    torch.testing.assert_close(out.float(), r_out.float(), atol=atol, rtol=2e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[fin], r_lse[fin].float(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("b,s_q,h,topk", [(1, 1, 128, 2048), (3, 2, 64, 512), (5, 4, 128, 512), (2, 1, 16, 640),
                                          (70, 1, 128, 256)])
def test_matches_reference(b, s_q, h, topk):
    gen = torch.Generator().manual_seed(b * 100 + s_q * 10 + h + topk)
    q, cache, ids = _case(b, s_q, h, topk, 97, 64, gen)
    sink = torch.randn(h, generator=gen).to(DEV)
    _check(q, cache, ids, attn_sink=sink)


def test_lengths_and_empty_rows():
    """topk_length per sequence [B] and per token [B, s_q] (0: an empty row, out 0 and lse +inf), a scale."""
    gen = torch.Generator().manual_seed(77)
    q, cache, ids = _case(3, 2, 64, 512, 40, 32, gen)
    _check(q, cache, ids, topk_length=torch.tensor([0, 300, 512], dtype=torch.int32, device=DEV),
           softmax_scale=0.05)
    per_tok = torch.tensor([[5, 0], [512, 1], [64, 200]], dtype=torch.int32, device=DEV)
    _check(q, cache, ids, topk_length=per_tok)
    out, lse = dsagen.sparse_attention_decode(q, cache, ids, topk_length=per_tok)
    assert torch.isposinf(lse[0, 1]).all() and (out[0, 1] == 0).all()


def test_cache_slice_of_a_wider_buffer():
    """A cache that is every other page block of a larger one (page stride != page_block_size x row stride) is not
    one pool of rows: NotImplementedError naming it; a cache whose rows are a column slice of wider rows runs."""
    gen = torch.Generator().manual_seed(5)
    q, cache, ids = _case(2, 1, 64, 512, 40, 32, gen)
    wide = torch.randn((40, 32, 1, 640), generator=gen).bfloat16().to(DEV)
    wide[..., :576] = cache
    _check(q, wide[..., :576], ids)
    with pytest.raises(NotImplementedError, match="not evenly strided rows"):
        dsagen.sparse_attention_decode(q, torch.cat([cache, cache])[::2], ids)


def tile_spread(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 576] with NoPE column tile j (128 values) times 4 ** -j: the four tiles of a row get different FP8
    scales (on N(0, 1) values they nearly always share one), so a kernel applying a row's scales to the wrong tiles
    fails; no value grows, so the outputs keep the magnitudes the tolerances are set for."""
    f = torch.ones(576, dtype=kv.dtype, device=kv.device)
    for j in range(4):
        f[128 * j:128 * (j + 1)] = 4.0 ** -j
    return kv * f


def _fp8(cache):
    """The FP8 cache [n_blocks, page, 1, 656] uint8 of a bf16 cache (its tiles spread by tile_spread), and that
    cache dequantized (bf16, 576)."""
    cache = tile_spread(cache)
    nb, page = cache.shape[:2]
    fp8 = dsagen.quantize_kv_fp8(cache.view(nb, page, 576), impl="reference").unsqueeze(2)
    return fp8, dsagen.dequantize_kv_fp8(fp8, impl="reference")


@pytest.mark.parametrize("b,s_q,h,topk", [(1, 1, 128, 2048), (3, 2, 64, 512), (5, 4, 128, 512), (2, 1, 16, 640)])
def test_fp8_cache(b, s_q, h, topk):
    """The FP8 cache against the reference (which dequantizes the rows it gathers), and bitwise the BF16 kernel's
    out and lse over the dequantized cache; the float8_e4m3fn view of the same bytes gives the same bytes."""
    gen = torch.Generator().manual_seed(b * 100 + s_q * 10 + h + topk + 1)
    q, cache, ids = _case(b, s_q, h, topk, 97, 64, gen)
    factor = torch.exp(torch.randn((97, 64, 1, 1), generator=gen)).bfloat16()                   # varied scales
    cache = cache * factor.to(DEV)
    sink = torch.randn(h, generator=gen).to(DEV)
    fp8, deq = _fp8(cache)
    out, lse = dsagen.sparse_attention_decode(q, fp8, ids, attn_sink=sink)
    b_out, b_lse = dsagen.sparse_attention_decode(q, deq, ids, attn_sink=sink)
    assert torch.equal(out, b_out) and torch.equal(lse, b_lse)        # the BF16 kernel's bytes on the same values
    # the kernel's P is bf16 (relative error 2 ** -9 a slot), so |out - reference| <= 2 ** -9 max |V| plus the
    # output's own rounding: with per-token factors up to ~e ** 4 that exceeds 2e-2
    bound = max(2e-2, 2.0 ** -8 * deq[..., :512].float().abs().amax().item())
    _check(q, fp8, ids, atol=bound, attn_sink=sink)
    e_out, e_lse = dsagen.sparse_attention_decode(q, fp8.view(torch.float8_e4m3fn), ids, attn_sink=sink)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


def test_fp8_cache_scales_of_any_value():
    """The FP8 kernel dequantizes power-of-two scales (quantize_kv_fp8's) on the integer / bf16 path and any other
    scale on the conversion path: a cache whose every third token has its four scales times 1.5 (mixed kinds in
    a warp's rows), tokens with one scale each of 3e-3, 1e-30, 2 ** 10 (a power of two past the fast path's
    range) and 2 ** -100 (within it) gives the BF16 kernel's bytes on dequantize_kv_fp8 of the same bytes."""
    gen = torch.Generator().manual_seed(79)
    q, cache, ids = _case(4, 2, 128, 1024, 64, 64, gen)
    fp8, _ = _fp8(cache)
    scales = fp8.view(-1, 656)[:, 512:528].view(torch.float32)          # [tokens, 4], a view of fp8's bytes
    scales[::3] *= 1.5
    scales[1, 2] = 3e-3
    scales[2, 0] = 1e-30
    scales[4, 1] = 2.0 ** 10
    scales[5, 3] = 2.0 ** -100
    deq = dsagen.dequantize_kv_fp8(fp8, impl="reference")
    sink = torch.randn(128, generator=gen).to(DEV)
    out, lse = dsagen.sparse_attention_decode(q, fp8, ids, attn_sink=sink)
    b_out, b_lse = dsagen.sparse_attention_decode(q, deq, ids, attn_sink=sink)
    assert torch.equal(out, b_out) and torch.equal(lse, b_lse)


def test_fp8_cache_lengths_empty_rows_and_strides():
    """FP8: topk_length per sequence and per token with empty rows, a cache whose rows are a column slice of wider
    rows, an uneven page stride refused, and a cache with no rows (every row empty)."""
    gen = torch.Generator().manual_seed(78)
    q, cache, ids = _case(3, 2, 64, 512, 40, 32, gen)
    fp8, _ = _fp8(cache)
    per_tok = torch.tensor([[5, 0], [512, 1], [64, 200]], dtype=torch.int32, device=DEV)
    _check(q, fp8, ids, topk_length=per_tok, softmax_scale=0.05)
    _check(q, fp8, ids, topk_length=torch.tensor([0, 300, 512], dtype=torch.int32, device=DEV))
    out, lse = dsagen.sparse_attention_decode(q, fp8, ids, topk_length=per_tok)
    assert torch.isposinf(lse[0, 1]).all() and (out[0, 1] == 0).all()
    wide = torch.randint(0, 255, (40, 32, 1, 672), generator=gen, dtype=torch.uint8).to(DEV)
    wide[..., :656] = fp8
    _check(q, wide[..., :656], ids)
    with pytest.raises(NotImplementedError, match="not evenly strided rows"):
        dsagen.sparse_attention_decode(q, torch.cat([fp8, fp8])[::2], ids)
    out, lse = dsagen.sparse_attention_decode(q, fp8[:0], ids)
    assert (out == 0).all() and torch.isposinf(lse).all()


@pytest.mark.parametrize("split", [None, (4, 256)])
def test_fp8_shared_dequant_matches_the_one_cta_kernel(split):
    """The cluster of two that shares the FP8 dequantization (shared_dequant, H 128) gives the one-CTA FP8 kernel's
    bytes, whole rows and split: odd tile counts, rows shorter than a tile, empty rows, invalid ids, repeats, a
    sink, more items than CTAs (so each CTA pair loops), pow2 and other scales."""
    gen = torch.Generator().manual_seed(91 + (split is not None))
    q, cache, ids = _case(150, 2, 128, 1024, 64, 64, gen)
    fp8, _ = _fp8(cache)
    fp8.view(-1, 656)[::5, 512:528].view(torch.float32).mul_(1.5)
    rows = fp8.view(-1, 656)
    q3, ids2 = q.reshape(300, 128, 576), ids.reshape(300, 1024)
    length = torch.randint(0, 1025, (300,), generator=gen, dtype=torch.int32)
    length[:4] = torch.tensor([0, 1, 64, 65])
    length = length.to(DEV)
    sink = torch.randn(128, generator=gen).to(DEV)
    got = fwd_host._launch(q3, rows, ids2, sink, length, 0.05, 512, split=split, config=SHARED)
    want = fwd_host._launch(q3, rows, ids2, sink, length, 0.05, 512, split=split, config=ONE_CTA)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_split_matches_the_unsplit_kernel(fp8):
    """The split over the KV slots (ranges of 128 slots, some empty by topk_length, a sink) against the unsplit
    kernel on the same rows: out within bf16 rounding, lse within FP32 rounding, the same empty rows."""
    gen = torch.Generator().manual_seed(90 + fp8)
    q, cache, ids = _case(2, 2, 128, 1024, 60, 64, gen)
    rows = cache.reshape(-1, 576)
    if fp8:
        rows = dsagen.quantize_kv_fp8(rows, impl="reference")
    q3, ids2 = q.reshape(4, 128, 576), ids.reshape(4, 1024)
    length = torch.tensor([0, 100, 700, 1024], dtype=torch.int32, device=DEV)
    sink = torch.randn(128, generator=gen).to(DEV)
    assert split_plan(4, 128, 1024, torch.cuda.get_device_properties(0).multi_processor_count) is not None
    got = fwd_host._launch(q3, rows, ids2, sink, length, 0.05, 512, split=(8, 128))
    want = fwd_host._launch(q3, rows, ids2, sink, length, 0.05, 512)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1])) and torch.isinf(got[1][0]).all()
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][fin], want[1][fin], atol=1e-5, rtol=1e-5)
    assert (got[0][0] == 0).all()


def test_fp8_decode_in_a_cuda_graph_and_under_torch_compile():
    """The FP8 decode with the split (B 2, s_q 1: 2 items) captured in a CUDA graph (no allocation or host read in
    the capture) and replayed on new q, ids and lengths in the captured buffers: the eager results, bitwise; and
    under torch.compile(fullgraph=True) through the custom op torch.ops.dsagen.sparse_attention_decode: the eager
    results, bitwise."""
    gen = torch.Generator().manual_seed(91)
    q, cache, ids = _case(2, 1, 128, 1024, 60, 64, gen)
    fp8, _ = _fp8(cache)
    sink = torch.randn(128, generator=gen).to(DEV)
    length = torch.tensor([1024, 300], dtype=torch.int32, device=DEV)

    def step():
        return dsagen.sparse_attention_decode(q, fp8, ids, attn_sink=sink, topk_length=length)

    step()                                                    # warm-up: kernels loaded, the fast path's plan kept
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()
    q2, _, ids2 = _case(2, 1, 128, 1024, 60, 64, gen)
    q.copy_(q2)
    ids.copy_(ids2)
    length.copy_(torch.tensor([17, 1024], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    out_e, lse_e = step()
    assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
    compiled = torch.compile(lambda *x: torch.ops.dsagen.sparse_attention_decode(*x, sink, length, None, 512),
                             fullgraph=True)
    out_c, lse_c = compiled(q, fp8, ids)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
