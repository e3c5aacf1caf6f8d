"""Fused sparse MLA decode over a paged BF16 KV cache: `sparse_attention_decode(...)` (inputs validated by
dsagen.ops.kv_cache) runs the sparse MLA forward kernel (host.sparse_attention) on the cache's rows as one flat
[num_blocks * page_block_size, 576] pool: a page-encoded id (page block * page_block_size + offset) is that pool's row,
so no block table and no gather are needed; the B x s_q query tokens are the kernel's rows.

Not covered (NotImplementedError naming the reason, never a silent fallback): the FP8 cache format (no dequantizing
kernel yet: use impl="reference"), and a cache whose page blocks are not evenly strided rows (a view that cannot be
flattened without copying the cache).

Speed note: one CTA works on a query row's 64 heads at a time, so B x s_q x H / 64 work items fill the GPU only for
larger batches (no split over the KV slots yet, as FlashMLA's decode scheduler does for B x s_q of 1-8).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .host import sparse_attention

KV_DIM = 576


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """kv_cache [num_blocks, page_block_size, 1, 576] as a [rows, 576] view (None when its page blocks are not one
    row stride apart)."""
    nb, ps = kv_cache.shape[0], kv_cache.shape[1]
    if kv_cache.stride(3) != 1 or (nb > 1 and kv_cache.stride(0) != ps * kv_cache.stride(1)):
        return None
    return kv_cache.as_strided((nb * ps, KV_DIM), (kv_cache.stride(1), 1))


class DecodePlan:
    """The fused decode of one call signature (the public op's fast path, dsagen.ops._fast_path): the cache's view
    as one pool of rows, the rows' shapes and the forward's SparseFwdLaunch, decided by the call that made it;
    calling it with tensors of that signature makes the views and launches the same kernel."""

    def __init__(self, launch, flat: torch.Tensor, ids: torch.Tensor, shape: tuple[int, int, int], d_v: int):
        self.launch = launch
        self.flat_size, self.flat_stride = tuple(flat.shape), flat.stride()      # the cache as one pool of rows
        self.ids_shape = tuple(ids.shape)
        self.b, self.s_q, self.h = b, s_q, h = shape
        self.q_shape, self.out_shape, self.lse_shape = (b * s_q, h, KV_DIM), (b, s_q, h, d_v), (b, s_q, h)

    def __call__(self, q, kv_cache, indices, attn_sink, topk_length) -> tuple[torch.Tensor, torch.Tensor]:
        length = None if topk_length is None else _row_lengths(topk_length, self.b, self.s_q)
        out, lse, _ = self.launch(q.reshape(self.q_shape), kv_cache.as_strided(self.flat_size, self.flat_stride),
                                  indices.reshape(self.ids_shape), attn_sink, length)
        return out.view(self.out_shape), lse.view(self.lse_shape)


def _row_lengths(topk_length: torch.Tensor | None, b: int, s_q: int) -> torch.Tensor | None:
    """topk_length [B] (per sequence) or [B, s_q] as one int32 length per query row [B * s_q] (None: none)."""
    if topk_length is None:
        return None
    length = topk_length[:, None].expand(b, s_q) if topk_length.dim() == 1 else topk_length
    return length.reshape(b * s_q).contiguous()


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                            attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                            softmax_scale: float | None, d_v: int,
                            keep_plan: Callable[[DecodePlan], None] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, d_v] in q's dtype, lse [B, s_q, H] FP32, natural log, KV only, +inf for a row without a
    valid slot) of dsagen.sparse_attention_decode(impl="fused"). q [B, s_q, H, 576] bf16, kv_cache
    [num_blocks, page_block_size, 1, 576] of q's dtype, indices int32 [B, s_q, topk] page-encoded (-1 and ids past
    the cache: empty), topk_length int32 [B] or [B, s_q]. NotImplementedError for the FP8 cache and for caches that
    are not evenly strided rows. keep_plan: called with the call's DecodePlan (the public op's fast path)."""
    if kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        raise NotImplementedError("sparse_attention_decode: the FP8 cache format has no fused kernel yet "
                                  "(use impl='reference'); a BF16 cache runs fused")
    if kv_cache.dtype != q.dtype:
        raise NotImplementedError(f"sparse_attention_decode: the fused path takes a cache of q's dtype {q.dtype}, "
                                  f"got {kv_cache.dtype}")
    flat = _flat_rows(kv_cache)
    if flat is None:
        raise NotImplementedError("sparse_attention_decode: kv_cache's page blocks are not evenly strided rows "
                                  f"(strides {tuple(kv_cache.stride())}); pass a cache whose blocks are one "
                                  "page_block_size x row stride apart")
    b, s_q, h, d_qk = q.shape
    rows = b * s_q
    ids = indices.reshape(rows, indices.shape[-1])
    length = _row_lengths(topk_length, b, s_q)
    scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    # the flat entry checks the inputs, takes the custom op under torch.compile and hands eager calls' launches to keep
    keep = None if keep_plan is None else (lambda launch: keep_plan(DecodePlan(launch, flat, ids, (b, s_q, h), d_v)))
    out, lse, _ = sparse_attention(q.reshape(rows, h, d_qk), flat, ids, attn_sink=attn_sink, topk_length=length,
                                   softmax_scale=scale, d_v=d_v, keep_plan=keep)
    return out.view(b, s_q, h, d_v), lse.view(b, s_q, h)
