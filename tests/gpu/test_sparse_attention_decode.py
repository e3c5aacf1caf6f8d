"""GPU tests of the fused sparse MLA decode over a paged BF16 cache (`dsagen.sparse_attention_decode(...,
impl="fused")`: the sparse MLA forward kernel over the cache as one flat pool of rows) against impl="reference":
B 1-5, s_q 1-4, H 64 / 128 (and 16, padded), topk 512 / 2048, random page-encoded ids with -1, ids past the cache
and repeats, topk_length per sequence and per token, a sink, empty rows (out 0, lse +inf), a cache that is a
slice of a wider buffer; the FP8 cache raises NotImplementedError.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.sparse_mla.spec import config_for

ARCH = "sm_90a"
DEV = "cuda"
REQUIRED_SPECS = [config_for(h, 576, dt, None, ARCH, None).spec(h, 576, dt, ARCH)
                  for h, dt in [(64, "bfloat16"), (128, "bfloat16")]]

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


def _check(q, cache, ids, **kw):
    out, lse = dsagen.sparse_attention_decode(q, cache, ids, **kw)
    r_out, r_lse = dsagen.sparse_attention_decode(q, cache, ids, impl="reference", **kw)
    torch.testing.assert_close(out.float(), r_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[fin], r_lse[fin].float(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("b,s_q,h,topk", [(1, 1, 128, 2048), (3, 2, 64, 512), (5, 4, 128, 512), (2, 1, 16, 640)])
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


def test_fp8_cache_is_not_fused_yet():
    gen = torch.Generator().manual_seed(6)
    q, cache, ids = _case(1, 1, 64, 512, 8, 64, gen)
    fp8 = dsagen.quantize_kv_fp8(cache.view(8, 64, 576), impl="reference").unsqueeze(2)
    with pytest.raises(NotImplementedError, match="FP8 cache"):
        dsagen.sparse_attention_decode(q, fp8, ids)
