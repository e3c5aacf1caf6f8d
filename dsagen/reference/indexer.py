"""Plain-PyTorch indexer scoring and top-k (cuDNN frontend DSA §3-§5), plus the primitives the lightning_indexer
and indexer-training references share: the weighted-ReLU score, the ratio-causal column limit and a
deterministic top-k.

Inputs are validated by dsagen.ops.indexer; these functions assume well-formed arguments. FP16/BF16/FP32
inputs accumulate in FP32, FP64 stays FP64. Everything is device-agnostic. The BSHD paths never read tensor
values on the host; the packed THD paths (cu_seqlens_q / cu_seqlens_k given) read the offsets once to split
the rows into segments (`thd_segments`) and run the BSHD math per segment.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Largest temporary a reference call materializes at once (bytes). Query rows are processed in chunks
# so that the biggest per-chunk intermediate stays under this.
SCORE_BUDGET_BYTES = 256 << 20


class TopK(NamedTuple):
    """indexer_topk's result: int32 indices and (optionally) their values."""

    indices: torch.Tensor
    values: torch.Tensor | None


class IndexerTopK(NamedTuple):
    """indexer_forward_topk's result; `softmax` / `lse` are None when not requested."""

    indices: torch.Tensor
    logits: torch.Tensor
    softmax: torch.Tensor | None
    lse: torch.Tensor | None


def accumulate_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """FP64 when any input is FP64, else FP32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rows_per_chunk(bytes_per_row: int, budget: int = SCORE_BUDGET_BYTES) -> int:
    """How many rows of `bytes_per_row` fit in `budget` (at least one)."""
    return max(1, budget // max(1, bytes_per_row))


def weighted_relu_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """score[..., r, s] = sum_h weights[..., r, h] * relu(q[..., r, h, :] . k[..., s, :]).

    q: [G, R, H, D], k: [G, S, D], weights: [G, R, H], all in the accumulation dtype -> [G, R, S].
    One GEMM over all heads ([R*H, D] x [D, S]), then the head reduction as a batched [1, H] x [H, S].
    """
    g, r, h, d = q.shape
    dots = torch.matmul(q.reshape(g, r * h, d), k.transpose(-1, -2)).view(g, r, h, -1)
    # In-place ReLU saves a full-size temporary when no gradient is being recorded.
    track = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or weights.requires_grad)
    act = torch.relu(dots) if track else dots.relu_()
    return torch.matmul(weights.unsqueeze(-2), act).squeeze(-2)


def ratio_causal_limit(seqlen_q: int, seqlen_k: int, ratio: int, q_causal_offsets: torch.Tensor | None,
                       batch: int, device: torch.device) -> torch.Tensor:
    """[B, S_q] int64: row q of batch b sees columns k < clamp((offsets[b] + q + 1) // ratio, 0, S_k)."""
    pos = torch.arange(seqlen_q, device=device, dtype=torch.int64).expand(batch, seqlen_q)
    if q_causal_offsets is not None:
        pos = pos + q_causal_offsets.to(torch.int64).view(batch, 1)
    return torch.div(pos + 1, ratio, rounding_mode="floor").clamp(0, seqlen_k)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-k over the last dimension among `valid` entries.

    Returns int64 indices [..., min(k, S)]: the valid entries with the largest scores, ordered by
    descending score; equal scores (at the k-th boundary and within the row) resolve toward the lower
    index. Rows with fewer valid entries than k end with -1 padding. Invalid entries are never selected.

    torch.topk finds the k-th largest value; entries strictly above it are all taken, and the remaining
    slots go to the lowest-index entries equal to it. A stable sort of the k chosen (in index order)
    then orders them by score.
    """
    s = scores.shape[-1]
    k_eff = min(k, s)
    if k_eff == 0 or scores.numel() == 0:
        return torch.full((*scores.shape[:-1], k_eff), -1, dtype=torch.int64, device=scores.device)
    masked = scores.masked_fill(~valid, float("-inf"))
    kth = masked.topk(k_eff, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = valid & (masked > kth)
    at = valid & (masked == kth)
    room = k_eff - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    chosen = above | (at & (at.cumsum(dim=-1, dtype=torch.int32) <= room))
    # Chosen entries get distinct positive keys, larger for lower indices: topk returns them in
    # ascending index order, followed by unchosen (key 0) entries that become padding.
    col = torch.arange(s, 0, -1, device=scores.device, dtype=torch.int32)
    key = torch.where(chosen, col, torch.zeros((), dtype=torch.int32, device=scores.device))
    key_val, idx = key.topk(k_eff, dim=-1)
    idx = torch.where(key_val > 0, idx, -1)
    picked = torch.where(idx >= 0, masked.gather(-1, idx.clamp(min=0)), float("-inf"))
    order = picked.sort(dim=-1, descending=True, stable=True).indices
    return idx.gather(-1, order)


def pad_last(idx: torch.Tensor, k: int, value: int = -1) -> torch.Tensor:
    """Pad the last dimension of `idx` with `value` up to width k."""
    missing = k - idx.shape[-1]
    if missing <= 0:
        return idx
    return torch.cat([idx, idx.new_full((*idx.shape[:-1], missing), value)], dim=-1)


def thd_segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1): the packed query rows [q0, q1) and key rows [k0, k1) of each THD segment.

    Reads both offset tensors on the host (one device-to-host copy each): the reference needs the segment
    lengths as Python ints to slice, so a THD reference call is not CUDA-graph capturable.
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def max_key_len(segments: list[tuple[int, int, int, int]]) -> int:
    """max_b (k1 - k0): the width of THD dense-score outputs (0 without segments)."""
    return max((k1 - k0 for _, _, k0, k1 in segments), default=0)


def segment_offsets(q_causal_offsets: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Segment i's q_causal_offsets as a one-entry tensor view (values stay on the device)."""
    return None if q_causal_offsets is None else q_causal_offsets[i:i + 1]


def pad_width(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Pad the last dimension of `t` with `value` up to `width` (differentiable)."""
    missing = width - t.shape[-1]
    return t if missing <= 0 else F.pad(t, (0, missing), value=value)


def cat_segment_rows(pieces: list[torch.Tensor], total_rows: int, fill: float, row_shape: tuple[int, ...],
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Concatenate per-segment row blocks (in segment order, so they tile rows [0, cu_seqlens_q[-1])) and
    fill the rows after the last offset, which belong to no segment, with `fill`."""
    used = sum(p.shape[0] for p in pieces)
    tail = torch.full((total_rows - used, *row_shape), fill, dtype=dtype, device=device)
    return torch.cat([*pieces, tail], dim=0)


def _as_mqa_keys(k_indexer: torch.Tensor) -> torch.Tensor:
    """[B, S_k, D] or [B, S_k, 1, D] -> [B, S_k, D]."""
    return k_indexer.squeeze(2) if k_indexer.dim() == 4 else k_indexer


def _raw_scores(q_indexer, k_indexer, weights, acc):
    """Yield (row_start, row_end, unmasked scores [B, rows, S_k]) over query-row chunks."""
    b, sq, h, _ = q_indexer.shape
    k = k_indexer.to(acc)
    sk = k.shape[1]
    rows = rows_per_chunk(b * h * sk * torch.finfo(acc).bits // 8)
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        yield r0, r1, weighted_relu_scores(q_indexer[:, r0:r1].to(acc), k, weights[:, r0:r1].to(acc))


def indexer_scores(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, *, ratio: int = 1,
                   q_causal_offsets: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                   cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ratio-causal indexer scores [B, S_q, S_k] (THD: [total_q, max_seqlen_k]); masked columns are
    -inf. See dsagen.indexer_scores."""
    if cu_seqlens_q is not None:
        return _indexer_scores_thd(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q,
                                   cu_seqlens_k)
    k = _as_mqa_keys(k_indexer)
    acc = accumulate_dtype(q_indexer, k, weights)
    b, sq = q_indexer.shape[:2]
    sk = k.shape[1]
    limit = ratio_causal_limit(sq, sk, ratio, q_causal_offsets, b, q_indexer.device)
    cols = torch.arange(sk, device=q_indexer.device)
    if sq == 0 or sk == 0 or b == 0:
        return torch.full((b, sq, sk), float("-inf"), dtype=acc, device=q_indexer.device)
    chunks = []
    for r0, r1, raw in _raw_scores(q_indexer, k, weights, acc):
        valid = cols < limit[:, r0:r1, None]
        chunks.append(torch.where(valid, raw, float("-inf")))
    return torch.cat(chunks, dim=1)


def _thd_keys(k_indexer: torch.Tensor) -> torch.Tensor:
    """THD keys [total_k, D] or [total_k, 1, D] -> [total_k, D]."""
    return k_indexer.squeeze(1) if k_indexer.dim() == 3 else k_indexer


def _indexer_scores_thd(q, k_indexer, w, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    """THD indexer_scores: the BSHD math per segment (B = 1), columns local to the segment."""
    k = _thd_keys(k_indexer)
    segments = thd_segments(cu_seqlens_q, cu_seqlens_k)
    width = max_key_len(segments)
    pieces = []
    for i, (q0, q1, k0, k1) in enumerate(segments):
        s = indexer_scores(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=ratio,
                           q_causal_offsets=segment_offsets(q_causal_offsets, i))[0]
        pieces.append(pad_width(s, width, float("-inf")))
    return cat_segment_rows(pieces, q.shape[0], float("-inf"), (width,), accumulate_dtype(q, k, w), q.device)


def staggered_row_lengths(seq_lens: torch.Tensor, n_rows: int, n_cols: int, next_n: int = 1) -> torch.Tensor:
    """[n_rows] int64 effective lengths of indexer_topk's rows, on seq_lens' device (no host read).

    Row r of group g = r // (n_rows // G) (G = seq_lens.numel() >= 1) gets
    clamp(seq_lens[g] - next_n + (r % next_n) + 1, 0, n_cols): with next_n = 1 the group's length, with
    next_n = n_rows // G > 1 the speculative-decoding stagger (the group's last row sees seq_lens[g],
    each earlier row one column fewer). Computed in int64, so int32 extremes cannot wrap.
    """
    base = seq_lens.to(torch.int64).repeat_interleave(n_rows // seq_lens.numel())
    row = torch.arange(n_rows, device=seq_lens.device, dtype=torch.int64)
    return (base - next_n + row % next_n + 1).clamp(0, n_cols)


def indexer_topk(input_values: torch.Tensor, seq_lens: torch.Tensor, top_k: int, *,
                 return_values: bool = True, next_n: int = 1) -> TopK:
    """Per-row top-k over each row's first `staggered_row_lengths` columns. See dsagen.indexer_topk."""
    n_rows, n_cols = input_values.shape
    device = input_values.device
    indices = torch.full((n_rows, top_k), -1, dtype=torch.int32, device=device)
    values = (torch.full((n_rows, top_k), float("-inf"), dtype=input_values.dtype, device=device)
              if return_values else None)
    if n_rows == 0 or top_k == 0 or n_cols == 0:
        return TopK(indices, values)
    row_len = staggered_row_lengths(seq_lens, n_rows, n_cols, next_n)
    cols = torch.arange(n_cols, device=device)
    # The chunk holds a few [rows, n_cols] temporaries (scores, masks, int32 keys).
    rows = rows_per_chunk(n_cols * 16)
    for r0 in range(0, n_rows, rows):
        r1 = min(n_rows, r0 + rows)
        vals = input_values[r0:r1]
        idx = select_topk(vals, cols < row_len[r0:r1, None], top_k)
        kk = idx.shape[-1]
        indices[r0:r1, :kk] = idx.to(torch.int32)
        if values is not None:
            picked = vals.gather(-1, idx.clamp(min=0))
            values[r0:r1, :kk] = torch.where(idx >= 0, picked, torch.full_like(picked, float("-inf")))
    return TopK(indices, values)


def masked_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the valid entries of the last dimension; invalid entries and all-invalid rows give 0.

    Written so autograd stays finite: all-invalid rows are softmaxed over zeros and then zeroed.
    """
    any_valid = valid.any(dim=-1, keepdim=True)
    x = logits.masked_fill(~valid, float("-inf"))
    x = torch.where(any_valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    p = torch.softmax(x, dim=-1)
    return torch.where(valid, p, torch.zeros((), dtype=p.dtype, device=p.device))


def masked_logsumexp(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """logsumexp over the valid entries of the last dimension; -inf for all-invalid rows (finite grads)."""
    any_valid = valid.any(dim=-1)
    x = logits.masked_fill(~valid, float("-inf"))
    x = torch.where(any_valid[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(any_valid, lse, torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device))


def indexer_forward_topk(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, top_k: int, *,
                         ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                         return_softmax: bool = True, return_lse: bool = False,
                         topk_indices_global: bool = True, cu_seqlens_q: torch.Tensor | None = None,
                         cu_seqlens_k: torch.Tensor | None = None) -> IndexerTopK:
    """Scores + ratio-causal mask + top-k + softmax in one call. See dsagen.indexer_forward_topk."""
    if cu_seqlens_q is not None:
        return _indexer_forward_topk_thd(q_indexer, k_indexer, weights, top_k, ratio, q_causal_offsets,
                                         return_softmax, return_lse, topk_indices_global, cu_seqlens_q,
                                         cu_seqlens_k)
    k = _as_mqa_keys(k_indexer)
    acc = accumulate_dtype(q_indexer, k, weights)
    b, sq = q_indexer.shape[:2]
    sk = k.shape[1]
    device = q_indexer.device
    limit = ratio_causal_limit(sq, sk, ratio, q_causal_offsets, b, device)
    cols = torch.arange(sk, device=device)
    idx_chunks, logit_chunks = [], []
    if b * sq > 0 and sk > 0 and top_k > 0:
        for r0, r1, raw in _raw_scores(q_indexer, k, weights, acc):
            valid = cols < limit[:, r0:r1, None]
            with torch.no_grad():
                idx = select_topk(raw, valid, top_k)
            picked = raw.gather(-1, idx.clamp(min=0))
            idx_chunks.append(idx)
            logit_chunks.append(torch.where(idx >= 0, picked, float("-inf")))
        idx = torch.cat(idx_chunks, dim=1)
        logits = torch.cat(logit_chunks, dim=1)
    else:
        idx = torch.full((b, sq, min(top_k, sk)), -1, dtype=torch.int64, device=device)
        logits = torch.full(idx.shape, float("-inf"), dtype=acc, device=device)
    idx = pad_last(idx, top_k)
    logits = pad_last(logits, top_k, float("-inf"))
    slot_valid = idx >= 0
    if topk_indices_global:
        base = torch.arange(b, device=device, dtype=torch.int64).view(b, 1, 1) * sk
        idx = torch.where(slot_valid, idx + base, idx)
    softmax = masked_softmax(logits, slot_valid) if return_softmax else None
    lse = masked_logsumexp(logits, slot_valid) if return_lse else None
    return IndexerTopK(idx.to(torch.int32).contiguous(), logits, softmax, lse)


def _indexer_forward_topk_thd(q, k_indexer, w, top_k, ratio, q_causal_offsets, return_softmax, return_lse,
                              topk_indices_global, cu_seqlens_q, cu_seqlens_k) -> IndexerTopK:
    """THD indexer_forward_topk: the BSHD op per segment (B = 1, local ids); global ids are packed key
    rows cu_seqlens_k[b] + local. Rows after the last offset are empty rows."""
    k = _thd_keys(k_indexer)
    acc, device, total_q = accumulate_dtype(q, k, w), q.device, q.shape[0]
    idx, logits, softmax, lse = [], [], [], []
    for i, (q0, q1, k0, k1) in enumerate(thd_segments(cu_seqlens_q, cu_seqlens_k)):
        r = indexer_forward_topk(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], top_k, ratio=ratio,
                                 q_causal_offsets=segment_offsets(q_causal_offsets, i),
                                 return_softmax=return_softmax, return_lse=return_lse, topk_indices_global=False)
        ids = r.indices[0]
        idx.append(torch.where(ids >= 0, ids + k0, ids) if topk_indices_global else ids)
        logits.append(r.logits[0])
        if return_softmax:
            softmax.append(r.softmax[0])
        if return_lse:
            lse.append(r.lse[0])
    inf = float("-inf")
    return IndexerTopK(
        cat_segment_rows(idx, total_q, -1, (top_k,), torch.int32, device),
        cat_segment_rows(logits, total_q, inf, (top_k,), acc, device),
        cat_segment_rows(softmax, total_q, 0.0, (top_k,), acc, device) if return_softmax else None,
        cat_segment_rows(lse, total_q, inf, (), acc, device) if return_lse else None)


def dequantize_fp8(q8: torch.Tensor, k8: torch.Tensor, weights: torch.Tensor, q_scale: torch.Tensor,
                   k_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 (q, k, weights) of the FP8 indexer inputs: q = q8 * q_scale (q8 [..., H, D], q_scale [..., H]),
    k = k8 * k_scale (k8 [..., D] or [..., 1, D], k_scale its key dims), weights as FP32. indexer_scores of these
    is the un-factored sum_h w * relu(q_scale * k_scale * (q8 . k8)) for any descales (the fused kernel's factored
    form equals it only for positive ones)."""
    q = q8.to(torch.float32) * q_scale.to(torch.float32)[..., None]
    k = k8.to(torch.float32) * k_scale.to(torch.float32).reshape(*k8.shape[:-1], 1)
    return q, k, weights.to(torch.float32)
