"""Fused sparse MLA decode over a paged KV cache: `sparse_attention_decode(...)` (inputs validated by
dsagen.ops.kv_cache) runs the sparse MLA forward kernel (host.sparse_attention) on the cache's rows as one flat
[num_blocks * page_block_size, row] pool: a page-encoded id (page block * page_block_size + offset) is that pool's row,
so no block table and no gather are needed; the B x s_q query tokens are the kernel's rows. A BF16 cache (rows of 576
values) runs the BF16 kernel; the FP8 cache (reference.kv_cache's rows of 656 bytes) the kv_fp8 kernel, whose
producer dequantizes each gathered row to bf16 in shared memory (the bytes dequantize_kv_fp8 gives).

Not covered (NotImplementedError naming the reason, never a silent fallback): a cache whose page blocks are not
evenly strided rows (a view that cannot be flattened without copying the cache).

Split over the KV slots: one CTA works on a query row's 64 heads at a time, so B x s_q x H / 64 work items fill the
GPU only for larger batches; when they fill less than half of the SMs (split_plan), each row's slots go in ranges
(the split_kv kernel writes FP32 partials per (row, range)) and the combine kernel merges them by their LSEs, as
FlashMLA's decode scheduler does for B x s_q of 1-8, from shapes alone (no host read).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...runtime import device_index, device_sm_count
from .checks import kernel_heads
from .host import sparse_attention
from .spec import COMBINE_MAX_SPLITS

KV_DIM = 576
SPLIT_MIN_SLOTS = 128      # slots per range at least: a pair of 64-row tiles, the kernel's unit of work


def split_plan(rows: int, heads: int, topk: int, num_sms: int) -> tuple[int, int] | None:
    """(n_splits, split_slots) for a decode of `rows` query rows of `heads` query heads over `topk` slots on
    `num_sms` SMs, or None when the rows' items (one per row and 64 heads) fill at least half of the SMs: then each
    row's slots go in n_splits ranges of split_slots (a multiple of 128, at most 32 ranges), as many as the SMs hold
    in one wave (rows x ranges items <= SMs: a second, partial wave would add a whole range's time). From shapes only
    (no host read: graph-capturable)."""
    items = rows * (kernel_heads(heads) // 64)
    if items == 0 or 2 * items > num_sms or topk < 2 * SPLIT_MIN_SLOTS:
        return None
    n = min(COMBINE_MAX_SPLITS, num_sms // items, topk // SPLIT_MIN_SLOTS)
    slots = -(-topk // n)
    slots = -(-slots // SPLIT_MIN_SLOTS) * SPLIT_MIN_SLOTS
    n = -(-topk // slots)
    return (n, slots) if n > 1 else None


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """kv_cache [num_blocks, page_block_size, 1, row] as a [rows, row] view (None when its page blocks are not one
    row stride apart)."""
    nb, ps, width = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[3]
    if kv_cache.stride(3) != 1 or (nb > 1 and kv_cache.stride(0) != ps * kv_cache.stride(1)):
        return None
    return kv_cache.as_strided((nb * ps, width), (kv_cache.stride(1), 1))


class DecodePlan:
    """The fused decode of one call signature (the public op's fast path, dsagen.ops._fast_path): the cache's view
    as one pool of rows, the rows' shapes and the forward's SparseFwdLaunch (with its split), decided by the call
    that made it; calling it with tensors of that signature makes the views and launches the same kernels."""

    def __init__(self, launch, fp8: bool, flat: torch.Tensor, ids: torch.Tensor, shape: tuple[int, int, int],
                 d_v: int):
        self.launch, self.fp8 = launch, fp8
        self.flat_size, self.flat_stride = tuple(flat.shape), flat.stride()      # the cache as one pool of rows
        self.ids_shape = tuple(ids.shape)
        self.b, self.s_q, self.h = b, s_q, h = shape
        self.q_shape, self.out_shape, self.lse_shape = (b * s_q, h, KV_DIM), (b, s_q, h, d_v), (b, s_q, h)

    def __call__(self, q, kv_cache, indices, attn_sink, topk_length) -> tuple[torch.Tensor, torch.Tensor]:
        length = None if topk_length is None else _row_lengths(topk_length, self.b, self.s_q)
        cache = kv_cache.view(torch.uint8) if self.fp8 else kv_cache
        out, lse, _ = self.launch(q.reshape(self.q_shape), cache.as_strided(self.flat_size, self.flat_stride),
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
    [num_blocks, page_block_size, 1, 576] of q's dtype or [num_blocks, page_block_size, 1, 656] uint8 /
    float8_e4m3fn (the FP8 format), indices int32 [B, s_q, topk] page-encoded (-1 and ids past the cache: empty),
    topk_length int32 [B] or [B, s_q]. NotImplementedError for caches that are not evenly strided rows. keep_plan:
    called with the call's DecodePlan (the public op's fast path)."""
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
    length = _row_lengths(topk_length, b, s_q)
    scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    # the flat entry checks the inputs, takes the custom op under torch.compile (whole rows: the split is for eager
    # calls and graphs) and hands eager calls' launches to keep
    split = split_plan(rows, h, ids.shape[1], device_sm_count(device_index(q.device)))
    keep = None
    if keep_plan is not None:
        keep = lambda launch: keep_plan(DecodePlan(launch, fp8, flat, ids, (b, s_q, h), d_v))   # noqa: E731
    out, lse, _ = sparse_attention(q.reshape(rows, h, d_qk), flat, ids, attn_sink=attn_sink, topk_length=length,
                                   softmax_scale=scale, d_v=d_v, keep_plan=keep, split=split)
    return out.view(b, s_q, h, d_v), lse.view(b, s_q, h)
