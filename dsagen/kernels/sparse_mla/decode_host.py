"""Fused sparse MLA decode over a paged KV cache: `sparse_attention_decode(...)` (inputs validated by
dsagen.ops.kv_cache) runs the sparse MLA forward kernel (host.sparse_attention) on the cache's rows as one flat
[num_blocks * page_block_size, row] pool: a page-encoded id (page block * page_block_size + offset) is that pool's row,
so no block table and no gather are needed; the B x s_q query tokens are the kernel's rows. A BF16 cache (rows of 576
values) runs the BF16 kernel; the FP8 cache (reference.kv_cache's rows of 656 bytes) the kv_fp8 kernel, whose
producer dequantizes each gathered row to bf16 in shared memory (the bytes dequantize_kv_fp8 gives).

Not covered (NotImplementedError naming the reason, never a silent fallback): a cache whose page blocks are not
evenly strided rows (a view that cannot be flattened without copying the cache).

Speed note: one CTA works on a query row's 64 heads at a time, so B x s_q x H / 64 work items fill the GPU only for
larger batches (no split over the KV slots yet, as FlashMLA's decode scheduler does for B x s_q of 1-8).
"""

from __future__ import annotations

import math

import torch

from .host import sparse_attention

KV_DIM = 576


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """kv_cache [num_blocks, page_block_size, 1, row] as a [rows, row] view (None when its page blocks are not one
    row stride apart)."""
    nb, ps, width = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[3]
    if kv_cache.stride(3) != 1 or (nb > 1 and kv_cache.stride(0) != ps * kv_cache.stride(1)):
        return None
    return kv_cache.as_strided((nb * ps, width), (kv_cache.stride(1), 1))


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                            attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                            softmax_scale: float | None, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, d_v] in q's dtype, lse [B, s_q, H] FP32, natural log, KV only, +inf for a row without a
    valid slot) of dsagen.sparse_attention_decode(impl="fused"). q [B, s_q, H, 576] bf16, kv_cache
    [num_blocks, page_block_size, 1, 576] of q's dtype or [num_blocks, page_block_size, 1, 656] uint8 /
    float8_e4m3fn (the FP8 format), indices int32 [B, s_q, topk] page-encoded (-1 and ids past the cache: empty),
    topk_length int32 [B] or [B, s_q]. NotImplementedError for caches that are not evenly strided rows."""
    fp8 = kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn)
    if fp8:
        kv_cache = kv_cache.view(torch.uint8)
    elif kv_cache.dtype != q.dtype:
        raise NotImplementedError(f"sparse_attention_decode: the fused path takes a cache of q's dtype {q.dtype}, "
                                  f"got {kv_cache.dtype}")
    flat = _flat_rows(kv_cache)
    if flat is None:
        raise NotImplementedError("sparse_attention_decode: kv_cache's page blocks are not evenly strided rows "
                                  f"(strides {tuple(kv_cache.stride())}); pass a cache whose blocks are one "
                                  "page_block_size x row stride apart")
    b, s_q, h, d_qk = q.shape
    if fp8 and flat.shape[0] == 0:      # no cache row: every slot is empty (out 0, lse +inf); the kernel reads row 0
        return (q.new_zeros((b, s_q, h, d_v)),
                torch.full((b, s_q, h), float("inf"), dtype=torch.float32, device=q.device))
    rows = b * s_q
    ids = indices.reshape(rows, indices.shape[-1])
    length = None
    if topk_length is not None:
        length = (topk_length[:, None].expand(b, s_q) if topk_length.dim() == 1 else topk_length)
        length = length.reshape(rows).contiguous()
    scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    out, lse, _ = sparse_attention(q.reshape(rows, h, d_qk), flat, ids, attn_sink=attn_sink, topk_length=length,
                                   softmax_scale=scale, d_v=d_v)
    return out.view(b, s_q, h, d_v), lse.view(b, s_q, h)
