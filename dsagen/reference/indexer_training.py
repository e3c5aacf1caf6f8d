"""Plain-PyTorch indexer training ops (cuDNN frontend DSA §6, §8 indexer half, §9, §10): score recompute and the
analytic gradients of the indexer KL loss.

The loss (DeepSeek-V3.2 indexer loss, cuDNN normalization), for each query row (b, t) over its set of
valid slots J (top-k slots for the sparse ops, ratio-causal columns for the dense ones):

    I_j      = sum_h weights[b,t,h] * relu(index_q[b,t,h,:] . index_k[b,j,:])
    p_j      = softmax_{j in J}(sm_scale * I_j)                  (the indexer's distribution, "predict")
    tgt_j    = attention distribution over J                     ("target", treated as a constant)
    L        = grad_loss * loss_coeff / (B * S_q) * sum_{b,t} sum_{j in J} tgt_j * (log tgt_j - log p_j)

Its gradient with respect to I is dI_j = c * sm_scale * (p_j * sum_J(tgt) - tgt_j) with
c = grad_loss * loss_coeff / (B * S_q); the backward ops chain that through the weighted ReLU.
Inputs are validated by dsagen.ops.indexer_training. The dense ops also take the packed THD layout
(cu_seqlens_q / cu_seqlens_k): the offsets are read on the host and the BSHD math runs per segment.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .indexer import (accumulate_dtype, cat_segment_rows, masked_logsumexp, masked_softmax, max_key_len,
                      pad_width, ratio_causal_limit, rows_per_chunk, segment_offsets, thd_segments,
                      weighted_relu_scores)


class DenseIndexerScores(NamedTuple):
    """dense_indexer_score_recompute's result: masked scaled scores and their per-row logsumexp."""

    out: torch.Tensor
    denom: torch.Tensor


class IndexerGrads(NamedTuple):
    """The backward ops' result, each in the dtype of the tensor it is the gradient of."""

    d_index_q: torch.Tensor
    d_weights: torch.Tensor
    d_index_k: torch.Tensor


def decode_topk_indices(topk_indices: torch.Tensor, seqlen_k: int, topk_indices_global: bool,
                        topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(local ids clamped into [0, S_k) as int64, valid mask) for [B, S_q, K] ids.

    A slot is valid when its local id (id - b * S_k for global ids) lies in [0, S_k), so an id never
    aliases another batch, and, with topk_length [B, S_q], when its slot position is < topk_length.
    """
    b = topk_indices.shape[0]
    ids = topk_indices.to(torch.int64)
    if topk_indices_global:
        ids = ids - torch.arange(b, device=ids.device, dtype=torch.int64).view(b, 1, 1) * seqlen_k
    valid = (ids >= 0) & (ids < seqlen_k) & (topk_indices >= 0)
    if topk_length is not None:
        slot = torch.arange(topk_indices.shape[-1], device=ids.device)
        valid &= slot < topk_length.to(torch.int64)[..., None]
    return ids.clamp(0, max(seqlen_k - 1, 0)), valid


def _gather_rows(k: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """k [B, S_k, D], local [B, R, K] -> k[b, local[b, r, j]] as [B, R, K, D]."""
    b, r, kk = local.shape
    flat = torch.gather(k, 1, local.reshape(b, r * kk, 1).expand(b, r * kk, k.shape[-1]))
    return flat.view(b, r, kk, k.shape[-1])


def sparse_indexer_score_recompute(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor,
                                   topk_indices: torch.Tensor, *, topk_length: torch.Tensor | None = None,
                                   topk_indices_global: bool = False, sm_scale: float = 1.0) -> torch.Tensor:
    """predict [B, S_q, K]: softmax over the valid slots of sm_scale * I. See dsagen.sparse_indexer_score_recompute."""
    acc = accumulate_dtype(q_indexer, k_indexer, weights)
    b, sq, h, d = q_indexer.shape
    sk = k_indexer.shape[1]
    kk = topk_indices.shape[-1]
    local, valid = decode_topk_indices(topk_indices, sk, topk_indices_global, topk_length)
    if b * sq * kk == 0 or sk == 0:
        return torch.zeros((b, sq, kk), dtype=acc, device=q_indexer.device)
    k = k_indexer.to(acc)
    rows = rows_per_chunk(b * kk * (h + d) * torch.finfo(acc).bits // 8)
    chunks = []
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        kg = _gather_rows(k, local[:, r0:r1])                                    # [B, R, K, D]
        dots = torch.einsum("brhd,brkd->brhk", q_indexer[:, r0:r1].to(acc), kg)
        logits = torch.einsum("brh,brhk->brk", weights[:, r0:r1].to(acc), torch.relu(dots))
        chunks.append(masked_softmax(sm_scale * logits, valid[:, r0:r1]))
    return torch.cat(chunks, dim=1)


def dense_indexer_score_recompute(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, *,
                                  ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                                  sm_scale: float = 1.0, cu_seqlens_q: torch.Tensor | None = None,
                                  cu_seqlens_k: torch.Tensor | None = None) -> DenseIndexerScores:
    """(out [B, S_q, S_k], denom [B, S_q]); THD: ([total_q, max_seqlen_k], [total_q]).
    See dsagen.dense_indexer_score_recompute."""
    if cu_seqlens_q is not None:
        return _dense_indexer_score_recompute_thd(q_indexer, k_indexer, weights, ratio, q_causal_offsets,
                                                  sm_scale, cu_seqlens_q, cu_seqlens_k)
    k = k_indexer.squeeze(2) if k_indexer.dim() == 4 else k_indexer
    acc = accumulate_dtype(q_indexer, k, weights)
    b, sq, h, _ = q_indexer.shape
    sk = k.shape[1]
    device = q_indexer.device
    limit = ratio_causal_limit(sq, sk, ratio, q_causal_offsets, b, device)
    valid = torch.arange(sk, device=device) < limit[..., None]
    if b * sq * sk == 0:
        out = torch.full((b, sq, sk), float("-inf"), dtype=acc, device=device)
        return DenseIndexerScores(out, torch.full((b, sq), float("-inf"), dtype=acc, device=device))
    kf = k.to(acc)
    rows = rows_per_chunk(b * h * sk * torch.finfo(acc).bits // 8)
    chunks = []
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        raw = weighted_relu_scores(q_indexer[:, r0:r1].to(acc), kf, weights[:, r0:r1].to(acc))
        chunks.append(torch.where(valid[:, r0:r1], sm_scale * raw, float("-inf")))
    out = torch.cat(chunks, dim=1)
    return DenseIndexerScores(out, masked_logsumexp(out, valid))


def _dense_indexer_score_recompute_thd(q, k_indexer, w, ratio, q_causal_offsets, sm_scale, cu_seqlens_q,
                                       cu_seqlens_k) -> DenseIndexerScores:
    """THD dense_indexer_score_recompute: the BSHD op per segment (B = 1), columns local to the segment."""
    k = k_indexer.squeeze(1) if k_indexer.dim() == 3 else k_indexer
    acc, device, total_q = accumulate_dtype(q, k, w), q.device, q.shape[0]
    segments = thd_segments(cu_seqlens_q, cu_seqlens_k)
    width = max_key_len(segments)
    outs, denoms = [], []
    for i, (q0, q1, k0, k1) in enumerate(segments):
        r = dense_indexer_score_recompute(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], ratio=ratio,
                                          q_causal_offsets=segment_offsets(q_causal_offsets, i), sm_scale=sm_scale)
        outs.append(pad_width(r.out[0], width, float("-inf")))
        denoms.append(r.denom[0])
    inf = float("-inf")
    return DenseIndexerScores(cat_segment_rows(outs, total_q, inf, (width,), acc, device),
                              cat_segment_rows(denoms, total_q, inf, (), acc, device))


def _loss_scale(grad_loss: torch.Tensor | None, loss_coeff: float, rows: int, acc: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """c = grad_loss * loss_coeff / max(B * S_q, 1) as a 0-d tensor (no host read of grad_loss)."""
    c = torch.tensor(loss_coeff / max(rows, 1), dtype=acc, device=device)
    return c if grad_loss is None else c * grad_loss.to(acc).reshape(())


def _kl_score_grad(target: torch.Tensor, predict: torch.Tensor, valid: torch.Tensor, c: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """dL/dI over the last dimension: c * sm_scale * (p * sum(tgt) - tgt) on valid slots, 0 elsewhere."""
    zero = torch.zeros((), dtype=target.dtype, device=target.device)
    tgt = torch.where(valid, target, zero)
    p = torch.where(valid, predict, zero)
    return (c * sm_scale) * (p * tgt.sum(dim=-1, keepdim=True) - tgt)


def indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                     attn_score: torch.Tensor, index_score: torch.Tensor, topk_indices: torch.Tensor, *,
                     grad_loss: torch.Tensor | None = None, sm_scale: float = 1.0, loss_coeff: float = 1.0,
                     topk_indices_global: bool = False, deterministic: bool = False) -> IndexerGrads:
    """Sparse (top-k) indexer KL-loss gradients. See dsagen.indexer_backward. deterministic: d_index_k by
    index_put_(accumulate=True) (a fixed summation order) instead of index_add_."""
    acc = accumulate_dtype(index_q, weights, index_k, attn_score, index_score)
    b, sq, h, d = index_q.shape
    sk = index_k.shape[1]
    kk = topk_indices.shape[-1]
    device = index_q.device
    local, valid = decode_topk_indices(topk_indices, sk, topk_indices_global)
    c = _loss_scale(grad_loss, loss_coeff, b * sq, acc, device)
    d_q = torch.zeros((b, sq, h, d), dtype=acc, device=device)
    d_w = torch.zeros((b, sq, h), dtype=acc, device=device)
    d_k = torch.zeros((b, sk, d), dtype=acc, device=device)
    if b * sq * kk > 0 and sk > 0:
        k = index_k.to(acc)
        batch_base = torch.arange(b, device=device, dtype=torch.int64).view(b, 1, 1) * sk
        rows = rows_per_chunk(b * kk * (2 * h + 2 * d) * torch.finfo(acc).bits // 8)
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            q_c = index_q[:, r0:r1].to(acc)
            w_c = weights[:, r0:r1].to(acc)
            d_i = _kl_score_grad(attn_score[:, r0:r1].to(acc), index_score[:, r0:r1].to(acc),
                                 valid[:, r0:r1], c, sm_scale)                       # [B, R, K]
            kg = _gather_rows(k, local[:, r0:r1])                                    # [B, R, K, D]
            dots = torch.einsum("brhd,brkd->brhk", q_c, kg)
            d_w[:, r0:r1] = torch.einsum("brk,brhk->brh", d_i, torch.relu(dots))
            d_dots = d_i[:, :, None, :] * w_c[..., None] * (dots > 0)               # [B, R, H, K]
            d_q[:, r0:r1] = torch.einsum("brhk,brkd->brhd", d_dots, kg)
            d_kg = torch.einsum("brhk,brhd->brkd", d_dots, q_c)                     # [B, R, K, D]
            flat = (local[:, r0:r1] + batch_base).reshape(-1)
            if deterministic:
                d_k.view(b * sk, d).index_put_((flat,), d_kg.reshape(-1, d), accumulate=True)
            else:
                d_k.view(b * sk, d).index_add_(0, flat, d_kg.reshape(-1, d))
    return IndexerGrads(d_q.to(index_q.dtype), d_w.to(weights.dtype), d_k.to(index_k.dtype))


def dense_indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                           attn_score: torch.Tensor, attn_l1norm: torch.Tensor, index_score: torch.Tensor,
                           index_lse: torch.Tensor, *, grad_loss: torch.Tensor | None = None,
                           sm_scale: float = 1.0, loss_coeff: float = 1.0, ratio: int = 1,
                           q_causal_offsets: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                           cu_seqlens_k: torch.Tensor | None = None, loss_rows: int | None = None) -> IndexerGrads:
    """Dense (full-KV) indexer KL-loss gradients. See dsagen.dense_indexer_backward.

    `loss_rows` is the row count the loss is averaged over (default B * S_q; total_q for THD).
    """
    if cu_seqlens_q is not None:
        return _dense_indexer_backward_thd(index_q, weights, index_k, attn_score, attn_l1norm, index_score,
                                           index_lse, grad_loss, sm_scale, loss_coeff, ratio, q_causal_offsets,
                                           cu_seqlens_q, cu_seqlens_k)
    acc = accumulate_dtype(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse)
    b, sq, h, d = index_q.shape
    sk = index_k.shape[1]
    device = index_q.device
    limit = ratio_causal_limit(sq, sk, ratio, q_causal_offsets, b, device)
    valid = torch.arange(sk, device=device) < limit[..., None]                       # [B, S_q, S_k]
    c = _loss_scale(grad_loss, loss_coeff, b * sq if loss_rows is None else loss_rows, acc, device)
    d_q = torch.zeros((b, sq, h, d), dtype=acc, device=device)
    d_w = torch.zeros((b, sq, h), dtype=acc, device=device)
    d_k = torch.zeros((b, sk, d), dtype=acc, device=device)
    if b * sq * sk > 0:
        k = index_k.to(acc)
        rows = rows_per_chunk(b * h * sk * 2 * torch.finfo(acc).bits // 8)
        zero = torch.zeros((), dtype=acc, device=device)
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            v_c = valid[:, r0:r1]
            norm = attn_l1norm[:, r0:r1, None].to(acc)
            target = torch.where(v_c & (norm > 0), attn_score[:, r0:r1].to(acc) / norm, zero)
            predict = torch.where(v_c, torch.exp(index_score[:, r0:r1].to(acc) - index_lse[:, r0:r1, None].to(acc)),
                                  zero)
            d_i = _kl_score_grad(target, predict, v_c, c, sm_scale)                  # [B, R, S_k]
            q_c = index_q[:, r0:r1].to(acc)
            w_c = weights[:, r0:r1].to(acc)
            dots = torch.einsum("brhd,bkd->brhk", q_c, k)
            d_w[:, r0:r1] = torch.einsum("brk,brhk->brh", d_i, torch.relu(dots))
            d_dots = d_i[:, :, None, :] * w_c[..., None] * (dots > 0)
            d_q[:, r0:r1] = torch.einsum("brhk,bkd->brhd", d_dots, k)
            d_k += torch.einsum("brhk,brhd->bkd", d_dots, q_c)
    return IndexerGrads(d_q.to(index_q.dtype), d_w.to(weights.dtype), d_k.to(index_k.dtype))


def _dense_indexer_backward_thd(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                grad_loss, sm_scale, loss_coeff, ratio, q_causal_offsets, cu_seqlens_q,
                                cu_seqlens_k) -> IndexerGrads:
    """THD dense_indexer_backward: the BSHD op per segment (B = 1) with the loss averaged over all total_q
    rows. Segments own disjoint q and k rows, so each gradient block is written once; rows outside every
    segment get 0."""
    total_q = index_q.shape[0]
    d_q, d_w, d_k = torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k)
    for i, (q0, q1, k0, k1) in enumerate(thd_segments(cu_seqlens_q, cu_seqlens_k)):
        g = dense_indexer_backward(
            index_q[None, q0:q1], weights[None, q0:q1], index_k[None, k0:k1], attn_score[None, q0:q1, :k1 - k0],
            attn_l1norm[None, q0:q1], index_score[None, q0:q1, :k1 - k0], index_lse[None, q0:q1],
            grad_loss=grad_loss, sm_scale=sm_scale, loss_coeff=loss_coeff, ratio=ratio,
            q_causal_offsets=segment_offsets(q_causal_offsets, i), loss_rows=total_q)
        d_q[q0:q1], d_w[q0:q1], d_k[k0:k1] = g.d_index_q[0], g.d_weights[0], g.d_index_k[0]
    return IndexerGrads(d_q, d_w, d_k)


class DenseKLResult(NamedTuple):
    """dense_indexer_kl_backward's result: the KL loss (0-d, the accumulation dtype) and the indexer gradients."""

    loss: torch.Tensor
    d_index_q: torch.Tensor
    d_weights: torch.Tensor
    d_index_k: torch.Tensor


def _attn_probs_block(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """sum_h exp(softmax_scale * q[r, h] . k[s, h // G] - lse[r, h]) as [R, C]: q [R, H_q, D], k [C, H_kv, D],
    lse [R, H_q], all in the accumulation dtype (dense_attn_score_recompute's out on one block, unmasked)."""
    r, h_q, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    qg = q.reshape(r, h_kv, g, d).permute(1, 0, 2, 3).reshape(h_kv, r * g, d)         # (H_kv, R*G, D)
    s = torch.bmm(qg, k.permute(1, 2, 0)).mul_(softmax_scale)                           # (H_kv, R*G, C)
    s = s.reshape(h_kv, r, g, -1).permute(1, 0, 2, 3).reshape(r, h_q, -1)
    return torch.exp(s - lse[..., None]).sum(dim=1)


def dense_indexer_kl_backward(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor,
                              weights: torch.Tensor, index_k: torch.Tensor, *, softmax_scale: float,
                              sm_scale: float = 1.0, loss_coeff: float = 1.0, grad_loss: torch.Tensor | None = None,
                              ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                              row_block: int = 64, col_block: int = 1024, loss_rows: int | None = None
                              ) -> DenseKLResult:
    """The dense warm-up indexer loss and its gradients without any [S_q, S_k] tensor. See
    dsagen.dense_indexer_kl_backward. `loss_rows`: the rows the loss averages over (default B * S_q).

    Per batch element and block of `row_block` query rows: a first pass over blocks of `col_block` key columns
    gives each row's attention L1 norm (the target's denominator) and the indexer logits' logsumexp (online max
    and sum); a second pass recomputes both blocks, forms dL/dI and accumulates the loss and the gradients.
    Memory: O(row_block * col_block * max(H_q, H_i)) beyond the inputs and gradients. THD (cu_seqlens_q /
    cu_seqlens_k given): the BSHD computation per segment (B = 1), the loss averaged over all total_q rows."""
    kw = dict(softmax_scale=softmax_scale, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=grad_loss,
              ratio=ratio, row_block=row_block, col_block=col_block)
    if cu_seqlens_q is not None:
        return _dense_indexer_kl_backward_thd(q, k, lse, index_q, weights, index_k, q_causal_offsets, cu_seqlens_q,
                                              cu_seqlens_k, kw)
    acc = accumulate_dtype(q, index_q, weights, index_k)
    b, sq, h_i, _ = index_q.shape
    sk = index_k.shape[1]
    device = index_q.device
    limit = ratio_causal_limit(sq, sk, ratio, q_causal_offsets, b, device)             # [B, S_q]
    rows = b * sq if loss_rows is None else loss_rows
    c = _loss_scale(grad_loss, loss_coeff, rows, acc, device)
    kl_scale = torch.tensor(loss_coeff / max(rows, 1), dtype=acc, device=device)     # the loss without grad_loss
    d_q = torch.zeros(index_q.shape, dtype=acc, device=device)
    d_w = torch.zeros(weights.shape, dtype=acc, device=device)
    d_k = torch.zeros(index_k.shape, dtype=acc, device=device)
    loss = torch.zeros((), dtype=acc, device=device)
    neg_inf = torch.tensor(float("-inf"), dtype=acc, device=device)
    zero = torch.zeros((), dtype=acc, device=device)
    for bi in range(b):
        qa, ka, la = q[bi].to(acc), k[bi].to(acc), lse[bi].to(acc)
        iq, ik, w = index_q[bi].to(acc), index_k[bi].to(acc), weights[bi].to(acc)
        for r0 in range(0, sq, row_block):
            r1 = min(r0 + row_block, sq)
            lim = limit[bi, r0:r1, None]                                                 # [R, 1]
            n_cols = int(lim.max().item()) if r1 > r0 else 0                           # columns any row sees
            iq_r, w_r = iq[r0:r1], w[r0:r1]

            def block(c0: int, c1: int):
                """(valid [R, C], attention probs [R, C], ReLU'd dots [R, H_i, C], logits sm_scale * I [R, C])."""
                valid = torch.arange(c0, c1, device=device) < lim
                attn = _attn_probs_block(qa[r0:r1], ka[c0:c1], la[r0:r1], softmax_scale)
                dots = torch.einsum("rhd,cd->rhc", iq_r, ik[c0:c1])
                logits = sm_scale * torch.einsum("rh,rhc->rc", w_r, torch.relu(dots))
                return valid, attn, dots, logits

            l1 = torch.zeros(r1 - r0, dtype=acc, device=device)
            m = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=device)
            s = torch.zeros(r1 - r0, dtype=acc, device=device)
            for c0 in range(0, n_cols, col_block):
                valid, attn, _, logits = block(c0, min(c0 + col_block, n_cols))
                l1 += torch.where(valid, attn, zero).sum(-1)
                x = torch.where(valid, logits, neg_inf)
                m_new = torch.maximum(m, x.max(-1).values)
                shift = torch.where(torch.isfinite(m_new), m_new, zero)
                s = s * torch.exp(m - shift) + torch.exp(x - shift[:, None]).sum(-1)
                m = m_new
            lse_i = torch.where(s > 0, torch.log(s) + torch.where(torch.isfinite(m), m, zero), neg_inf)
            has_tgt = l1 > 0
            inv_l1 = torch.where(has_tgt, 1.0 / torch.where(has_tgt, l1, torch.ones_like(l1)), zero)
            for c0 in range(0, n_cols, col_block):
                c1 = min(c0 + col_block, n_cols)
                valid, attn, dots, logits = block(c0, c1)
                tgt = torch.where(valid, attn * inv_l1[:, None], zero)
                logp = torch.where(valid, logits - lse_i[:, None], zero)
                pos = tgt > 0
                loss = loss + torch.where(pos, tgt * (torch.log(torch.where(pos, tgt, torch.ones_like(tgt)))
                                                      - logp), zero).sum()
                p = torch.where(valid, torch.exp(logp), zero)
                d_i = (c * sm_scale) * (p * has_tgt.to(acc)[:, None] - tgt)               # sum_J tgt = 1 or 0
                d_w[bi, r0:r1] += torch.einsum("rc,rhc->rh", d_i, torch.relu(dots))
                d_dots = d_i[:, None, :] * w_r[..., None] * (dots > 0)
                d_q[bi, r0:r1] += torch.einsum("rhc,cd->rhd", d_dots, ik[c0:c1])
                d_k[bi, c0:c1] += torch.einsum("rhc,rhd->cd", d_dots, iq_r)
    return DenseKLResult(kl_scale * loss, d_q.to(index_q.dtype), d_w.to(weights.dtype), d_k.to(index_k.dtype))


def _dense_indexer_kl_backward_thd(q, k, lse, index_q, weights, index_k, q_causal_offsets, cu_seqlens_q,
                                   cu_seqlens_k, kw) -> DenseKLResult:
    """THD dense_indexer_kl_backward: the BSHD op per segment (B = 1), the loss averaged over all total_q rows
    (rows after the last segment count there and contribute nothing); gradient rows outside every segment are 0."""
    total_q = index_q.shape[0]
    acc = accumulate_dtype(q, index_q, weights, index_k)
    d_q, d_w, d_k = torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k)
    loss = torch.zeros((), dtype=acc, device=index_q.device)
    for i, (q0, q1, k0, k1) in enumerate(thd_segments(cu_seqlens_q, cu_seqlens_k)):
        r = dense_indexer_kl_backward(q[None, q0:q1], k[None, k0:k1], lse[None, q0:q1], index_q[None, q0:q1],
                                      weights[None, q0:q1], index_k[None, k0:k1], **kw,
                                      q_causal_offsets=segment_offsets(q_causal_offsets, i), loss_rows=total_q)
        loss = loss + r.loss
        d_q[q0:q1], d_w[q0:q1], d_k[k0:k1] = r.d_index_q[0], r.d_weights[0], r.d_index_k[0]
    return DenseKLResult(loss, d_q, d_w, d_k)
