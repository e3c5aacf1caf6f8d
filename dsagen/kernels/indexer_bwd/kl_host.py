"""The dense warm-up loss path from generated kernels (dsagen.dense_indexer_kl_backward's fused form), BSHD: the KL
loss of the indexer against the attention distribution and the indexer gradients, with memory that grows with T,
not T^2.

Per batch element and block of R query rows (whole rows: every key column of a row is in its block, so each row's
statistics are complete within one block), three launches on the block's rows:
  * indexer scores with sm_scale and their LSE (lightning_indexer.scores_host.indexer_scores, scale=sm_scale);
  * the dense attention scores and their L1 norms (attn_score_recompute.dense_host);
  * the dense indexer backward with the block's KL sum sum_{visible} tgt (log tgt - (logit - lse)) (tgt = attn / l1,
    0 where l1 = 0) from the same launch (indexer_bwd.dense_host.kl_block_backward), with loss_coeff * R / (B S_q),
    so its c is the whole loss's grad_loss * loss_coeff / (B S_q); d_index_k summed over the blocks in FP32.
The causal limit of the block's local row t is that of row r0 + t: the block gets q_causal_offsets + r0.
Scratch: the two [R, S_k] FP32 score blocks, R = max(1, scratch_bytes // (2 * 4 * S_k)). With one block (B 1,
R = S_q) the backward's outputs are returned as they are, without copies.

dsagen.dense_indexer_kl_backward(impl="fused") calls it. Inputs outside the three kernels' limits are refused
(NotImplementedError naming the limit) before any launch.
"""

from __future__ import annotations

import torch

from ...reference.indexer import segment_offsets, thd_segments
from ...reference.indexer_training import DenseKLResult
from ..attn_score_recompute import dense_host as attn_host
from ..lightning_indexer import scores_host
from . import dense_host as bwd_host

#: the default scratch of the score blocks and the loss temporaries (bytes)
SCRATCH_BYTES = 1 << 30


def block_rows(s_q: int, s_k: int, scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Query rows per block: the two [R, S_k] FP32 score blocks in scratch_bytes, at least 1 and at most S_q."""
    return max(1, min(s_q, scratch_bytes // (2 * 4 * max(s_k, 1))))


def dense_indexer_kl_backward(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor,
                              weights: torch.Tensor, index_k: torch.Tensor, *, softmax_scale: float,
                              sm_scale: float = 1.0, loss_coeff: float = 1.0, grad_loss: torch.Tensor | None = None,
                              ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                              scratch_bytes: int = SCRATCH_BYTES, loss_rows: int | None = None) -> DenseKLResult:
    """The fused dense warm-up loss path on validated BSHD inputs: q `(B, S_q, H, D)` attention queries, k
    `(B, S_k, D)` (or `(B, S_k, 1, D)`), lse `(B, S_q, H)`, index_q `(B, S_q, H_i, D_i)`, weights `(B, S_q, H_i)`,
    index_k `(B, S_k, D_i)`; the other arguments as dsagen.dense_indexer_kl_backward takes them. Returns
    DenseKLResult(loss FP32 0-d, d_index_q, d_weights, d_index_k) in the inputs' dtypes (module docstring).
    loss_rows: the rows the loss averages over (default B * S_q). cu_seqlens_q / cu_seqlens_k (validated, both):
    the packed THD layout, each segment as a batch of one with loss_rows = total_q (the offsets read on the host)."""
    packed = cu_seqlens_q is not None
    bshd = (lambda t: t[None]) if packed else (lambda t: t)            # THD tensors checked as a batch of one
    for reason in (attn_host.supported_reason(bshd(q), bshd(k)), bwd_host.supported_reason(index_q, index_k)):
        if reason:
            raise NotImplementedError(f"dense_indexer_kl_backward: {reason}")
    if packed:
        return _packed(q, k, lse, index_q, weights, index_k, softmax_scale=softmax_scale, sm_scale=sm_scale,
                       loss_coeff=loss_coeff, grad_loss=grad_loss, ratio=ratio, q_causal_offsets=q_causal_offsets,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scratch_bytes=scratch_bytes)
    b, s_q = index_q.shape[0], index_q.shape[1]
    s_k = index_k.shape[1]
    dev = index_q.device
    rows_total = b * s_q if loss_rows is None else loss_rows
    if rows_total == 0 or s_k == 0 or s_q == 0:
        return DenseKLResult(torch.zeros((), dtype=torch.float32, device=dev), torch.zeros_like(index_q),
                             torch.zeros_like(weights), torch.zeros_like(index_k))
    offs = (torch.zeros(b, dtype=torch.int32, device=dev) if q_causal_offsets is None
            else q_causal_offsets.to(torch.int32))
    rb = block_rows(s_q, s_k, scratch_bytes)
    blocks = [(bi, r0, min(s_q, r0 + rb)) for bi in range(b) for r0 in range(0, s_q, rb)]
    if len(blocks) > 1:
        d_q, d_w = torch.empty_like(index_q), torch.empty_like(weights)
        d_k = torch.zeros(index_k.shape, dtype=torch.float32, device=dev)
    loss = None
    for bi, r0, r1 in blocks:
        off = offs[bi:bi + 1] + r0
        rows = slice(r0, r1)
        iq, w = index_q[bi:bi + 1, rows], weights[bi:bi + 1, rows]
        logits, lse_i = scores_host.indexer_scores(
            iq, index_k[bi:bi + 1], w, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=None, cu_seqlens_k=None,
            out=None, lse=None, return_lse=True, shapes=((1, r1 - r0, s_k), (1, r1 - r0)), scale=sm_scale)
        attn, l1 = attn_host.dense_attn_score_recompute(q[bi:bi + 1, rows], k[bi:bi + 1], lse[bi:bi + 1, rows],
                                                        softmax_scale, ratio=ratio, q_causal_offsets=off)
        g_q, g_w, g_k, kl = bwd_host.kl_block_backward(
            iq, w, index_k[bi:bi + 1], attn, l1, logits, lse_i, grad_loss=grad_loss, sm_scale=sm_scale,
            loss_coeff=loss_coeff * (r1 - r0) / rows_total, ratio=ratio, q_causal_offsets=off)
        loss = kl if loss is None else loss + kl
        if len(blocks) == 1:
            d_q, d_w, d_k = g_q, g_w, g_k
        else:
            d_q[bi, rows] = g_q[0]
            d_w[bi, rows] = g_w[0]
            d_k[bi] += g_k[0]
    return DenseKLResult(loss * (loss_coeff / rows_total), d_q, d_w, d_k.to(index_k.dtype))


def _packed(q, k, lse, index_q, weights, index_k, *, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, **kw
            ) -> DenseKLResult:
    """THD: every segment with rows and keys as a BSHD batch of one on views, its loss averaged over all total_q
    rows (loss_rows); gradient rows of no segment are 0."""
    total_q = index_q.shape[0]
    d_q, d_w, d_k = torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k)
    loss = torch.zeros((), dtype=torch.float32, device=index_q.device)
    for b, (r0, r1, k0, k1) in enumerate(thd_segments(cu_seqlens_q, cu_seqlens_k)):
        if r1 == r0 or k1 == k0:
            continue
        off = segment_offsets(q_causal_offsets, b)
        res = dense_indexer_kl_backward(q[None, r0:r1], k[None, k0:k1], lse[None, r0:r1], index_q[None, r0:r1],
                                        weights[None, r0:r1], index_k[None, k0:k1], q_causal_offsets=off,
                                        loss_rows=total_q, **kw)
        loss = loss + res.loss
        d_q[r0:r1] = res.d_index_q[0]
        d_w[r0:r1] = res.d_weights[0]
        d_k[k0:k1] = res.d_index_k[0]
    return DenseKLResult(loss, d_q, d_w, d_k)
