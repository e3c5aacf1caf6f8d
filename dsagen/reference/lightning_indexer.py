"""Plain-PyTorch lightning_indexer (attention-gym): chunked weighted-ReLU scoring and deterministic top-k.

This is both the oracle the fused kernels are tested against and the "plain PyTorch" peer in the
benchmarks, so it is written to be reasonably fast: one GEMM over all heads per chunk, torch.topk for
the selection, and query rows processed in chunks so the largest temporary stays under
`score_budget_bytes` instead of a full [B, T, H, S] (or [B, T, S]) allocation.

Inputs are validated by dsagen.ops.lightning_indexer. No host reads of tensor values (packed offsets
stay on the device), so the same code runs on CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

from .indexer import SCORE_BUDGET_BYTES, accumulate_dtype, rows_per_chunk, select_topk, weighted_relu_scores


def _candidate_bounds(t_count: int, s_count: int, causal: bool, compress_ratio: int,
                      cu_seqlens: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row t: the half-open range [lo[t], hi[t]) of candidate positions it may select.

    Unpacked: [0, S), or [0, (t + 1) // ratio) when causal. Packed: the row's document d (the one with
    cu_seqlens[d] <= t < cu_seqlens[d + 1]) owns candidates [cu_seqlens_k[d], cu_seqlens_k[d + 1]); causal
    trims that to the first (t - cu_seqlens[d] + 1) // ratio. Rows at or past cu_seqlens[-1] get an empty
    range. Both are clamped to [0, S].
    """
    t = torch.arange(t_count, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        lo = torch.zeros_like(t)
        hi = torch.div(t + 1, compress_ratio, rounding_mode="floor") if causal else torch.full_like(t, s_count)
        return lo, hi.clamp(0, s_count)
    cu_q = cu_seqlens.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    n_docs = cu_q.numel() - 1
    if n_docs == 0:
        return torch.zeros_like(t), torch.zeros_like(t)
    doc = torch.searchsorted(cu_q[1:].contiguous(), t, right=True)
    in_doc = doc < n_docs
    doc = doc.clamp(max=n_docs - 1)
    lo = cu_k[doc]
    hi = cu_k[doc + 1]
    if causal:
        local_t = t - cu_q[doc]
        hi = torch.minimum(hi, lo + torch.div(local_t + 1, compress_ratio, rounding_mode="floor"))
    hi = torch.where(in_doc, hi, lo)
    return lo.clamp(0, s_count), hi.clamp(0, s_count)


def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, causal: bool = False,
                      compress_ratio: int = 1, cu_seqlens: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None,
                      score_budget_bytes: int = SCORE_BUDGET_BYTES) -> torch.Tensor:
    """Top-k candidate indices [B, T, topk] int32 (see dsagen.lightning_indexer for the contract).

    score_budget_bytes bounds the per-chunk [rows, H, S] dot-product temporary; tests shrink it to
    exercise the chunking.
    """
    b, t_count, h, d = q.shape
    s_count = k.shape[1]
    device = q.device
    out = torch.full((b, t_count, topk), -1, dtype=torch.int32, device=device)
    if topk == 0 or b == 0 or t_count == 0 or s_count == 0:
        return out
    acc = accumulate_dtype(q, k, weights)
    norm = math.sqrt(h * d)
    with torch.no_grad():
        lo, hi = _candidate_bounds(t_count, s_count, causal, compress_ratio, cu_seqlens, cu_seqlens_k, device)
        kf = k.to(acc)
        cand = torch.arange(s_count, device=device)
        rows = rows_per_chunk(h * s_count * torch.finfo(acc).bits // 8, score_budget_bytes)
        row_chunk = min(t_count, rows)
        batch_chunk = max(1, rows // t_count) if row_chunk == t_count else 1
        for b0 in range(0, b, batch_chunk):
            b1 = min(b, b0 + batch_chunk)
            for t0 in range(0, t_count, row_chunk):
                t1 = min(t_count, t0 + row_chunk)
                scores = weighted_relu_scores(q[b0:b1, t0:t1].to(acc), kf[b0:b1], weights[b0:b1, t0:t1].to(acc))
                scores.div_(norm)
                lo_c, hi_c = lo[t0:t1, None], hi[t0:t1, None]
                valid = ((cand >= lo_c) & (cand < hi_c)).expand_as(scores)
                idx = select_topk(scores, valid, topk)
                if cu_seqlens is not None:
                    # Document-local ids: offset by the document's first candidate.
                    idx = torch.where(idx >= 0, idx - lo_c, idx)
                out[b0:b1, t0:t1, :idx.shape[-1]] = idx.to(torch.int32)
    return out
