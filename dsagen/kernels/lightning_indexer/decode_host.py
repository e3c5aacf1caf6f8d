"""Fused dsagen.indexer_decode_topk (DeepGEMM's fp8_paged_mqa_logits + top-k) on Hopper: indexer_forward_topk's slab
pipeline over a paged key cache.

Called by dsagen.ops.kv_cache.indexer_decode_topk after its checks. How a call runs:
  * The queries are BSHD rows: batch element b's next_n tokens, query j at position cache_seqlens[b] - next_n + j,
    which is the dense indexer's ratio-causal mask with ratio 1 and q_causal_offsets = cache_seqlens - next_n
    (computed on the device). Each batch element's keys are max_pages x 64 virtual rows: row s is row s % 64 of page
    block_table[b, s // 64], which the score kernel's TMA warp reads through the table (IndexerScoreSpec.paged).
  * FP8: the cache's pages [n_pages, 64 x (D + 4)] bytes (64 x D E4M3 values, then 64 FP32 scales) are viewed as
    k [n_pages, 64, D] uint8 and k_scale [n_pages, 64] FP32; q's own scale is in the weights (DeepGEMM's
    convention), so q_scale is 1. BF16: k is the cache [n_pages, 64, D] and the FP32 weights are rounded to bf16
    (the bf16 score kernel's weights are q's dtype).
  * The top-k kernels select each row's ids (row-local positions, ascending, ties at the k-th value toward the lower
    position) into a bounded slab pipeline; the positions become page-encoded ids block_table[b, s // 64] * 64 +
    s % 64 by device ops; -1 padding stays.
  * Nothing is read on the host: lengths and the table are not checked (a row sees the keys below
    cache_seqlens[b] - next_n + j + 1, clamped to [0, max_pages x 64]; a page outside [0, n_pages) reads zeros);
    under torch.compile the call is the custom op `dsagen::indexer_decode_topk_fused`; CUDA-graph capturable once
    its kernels are loaded.
"""

from __future__ import annotations

from typing import Callable

import torch

from .forward_topk_host import ForwardTopkCall, ForwardTopkLaunch, check_supported
from .scores_host import eager
from .spec import DECODE_PAGE_ROWS, INDEXER_MAX_T, decode_config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}


def check_decode_supported(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, top_k: int) -> None:
    """The fused kernels' limits (ValueError naming the argument): indexer_forward_topk's on q (dtype, H, D, top_k),
    pages of 64 rows, at most 2**20 virtual key rows per batch element (max_pages x 64)."""
    if k_cache.shape[1] != DECODE_PAGE_ROWS:
        raise ValueError(f"the fused indexer_decode_topk reads pages of {DECODE_PAGE_ROWS} tokens (one K tile); "
                         f"k_cache has block_size {k_cache.shape[1]} (use impl='reference')")
    if block_table.shape[1] * DECODE_PAGE_ROWS > INDEXER_MAX_T:
        raise ValueError(f"the fused indexer_decode_topk takes at most {INDEXER_MAX_T // DECODE_PAGE_ROWS} pages per "
                         f"sequence (2**20 keys); block_table has {block_table.shape[1]}")
    b, next_n, h, d = q.shape
    k_like = torch.empty((0, 0, d), dtype=q.dtype, device="meta")
    w_like = torch.empty((0, 0, h), dtype=torch.float32 if q.dtype == torch.float8_e4m3fn else q.dtype, device="meta")
    check_supported(q, k_like, w_like, top_k, False)


def _paged_inputs(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                  q_scale: torch.Tensor | None = None):
    """(k [n_pages, 64, D], weights as the kernel takes them, q_scale, k_scale) of a call; q_scale: the FP8 form's
    unit q scales when a plan already holds them (else made here)."""
    b, next_n, h, d = q.shape
    if q.dtype == torch.float8_e4m3fn:
        n_pages = k_cache.shape[0]
        flat = k_cache.reshape(n_pages, DECODE_PAGE_ROWS * (d + 4))
        k = flat[:, :DECODE_PAGE_ROWS * d].view(n_pages, DECODE_PAGE_ROWS, d)
        k_scale = flat[:, DECODE_PAGE_ROWS * d:].view(torch.float32)
        if q_scale is None:
            q_scale = torch.ones((b, next_n, h), dtype=torch.float32, device=q.device)
        return k.view(torch.float8_e4m3fn), weights, q_scale, k_scale
    return k_cache, weights.to(q.dtype), None, None


def page_encode(ids: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Row-local positions [B, next_n, top_k] (-1 padding) -> page-encoded ids block_table[b, s // 64] * 64 +
    s % 64, -1 kept (device ops)."""
    if ids.numel() == 0 or block_table.shape[1] == 0:      # nothing selected: all -1 already
        return ids
    pos = ids.clamp_min(0).flatten(1)
    pages = block_table.gather(1, (pos // DECODE_PAGE_ROWS).long())
    enc = (pages * DECODE_PAGE_ROWS + pos % DECODE_PAGE_ROWS).view_as(ids)
    return torch.where(ids >= 0, enc, -1).to(torch.int32)


class DecodeIndexerPlan:
    """The fused decode-time indexer of one call signature (the public op's fast path, dsagen.ops._fast_path): the
    forward_topk launch plan, the FP8 form's unit q_scale and the views of the cache, decided by the call that made
    it; calling it with tensors of that signature runs the same launches (run's steps without the planning)."""

    def __init__(self, launch: ForwardTopkLaunch, q: torch.Tensor, top_k: int, q_scale: torch.Tensor | None):
        self.launch, self.top_k, self.q_scale = launch, top_k, q_scale
        self.next_n = q.shape[1]

    def __call__(self, q, weights, k_cache, block_table, cache_seqlens) -> torch.Tensor:
        k, w, _, k_scale = _paged_inputs(q, weights, k_cache, self.q_scale)
        q_off = (cache_seqlens - self.next_n).to(torch.int32)
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        ids, _, _, _ = self.launch.launch(q, k, w, q_off, None, None,
                                          ForwardTopkCall.new_outputs(q, self.top_k, False, False, False),
                                          self.q_scale, k_scale, block_table=bt)
        return page_encode(ids, bt)


def run(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
        cache_seqlens: torch.Tensor, top_k: int,
        keep_plan: Callable[[DecodeIndexerPlan], None] | None = None) -> torch.Tensor:
    """The launches of one call (module docstring); returns the page-encoded ids [B, next_n, top_k]. keep_plan:
    called with the call's DecodeIndexerPlan (the public op's fast path)."""
    b, next_n, h, d = q.shape
    k, w, q_scale, k_scale = _paged_inputs(q, weights, k_cache)
    width = block_table.shape[1] * DECODE_PAGE_ROWS
    config = decode_config_for(h, d, _DTYPES[q.dtype], "sm_90a")
    q_off = (cache_seqlens - next_n).to(torch.int32)
    plan = ForwardTopkLaunch(q, k, w, top_k, 1, q_off, None, width, None, None, False, q_scale, k_scale, config,
                             paged_len=width)
    decode_plan = DecodeIndexerPlan(plan, q, top_k, q_scale)
    ids = decode_plan(q, weights, k_cache, block_table, cache_seqlens)
    if keep_plan is not None:
        keep_plan(decode_plan)
    return ids


@torch.library.custom_op("dsagen::indexer_decode_topk_fused", mutates_args=())
def _decode_op(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, top_k: int) -> torch.Tensor:
    """run as a custom op (opaque to torch.compile)."""
    return run(q, weights, k_cache, block_table, cache_seqlens, top_k)


@_decode_op.register_fake
def _(q, weights, k_cache, block_table, cache_seqlens, top_k):
    return q.new_empty((*q.shape[:2], top_k), dtype=torch.int32)


def indexer_decode_topk(q_indexer: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                        block_table: torch.Tensor, cache_seqlens: torch.Tensor, top_k: int,
                        keep_plan: Callable[[DecodeIndexerPlan], None] | None = None) -> torch.Tensor:
    """dsagen.indexer_decode_topk(impl="fused") after its checks: the kernels' limits (check_decode_supported), then
    the launches, eagerly or, under torch.compile, through the custom op. Returns int32 [B, next_n, top_k]
    page-encoded ids in ascending position, -1 padded. keep_plan: called with an eager call's DecodeIndexerPlan
    (the public op's fast path)."""
    check_decode_supported(q_indexer, k_cache, block_table, top_k)
    if eager(q_indexer):
        return run(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k, keep_plan)
    return _decode_op(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k)
