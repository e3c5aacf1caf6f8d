"""Indexer training ops from cuDNN frontend DSA (§6 Sparse Indexer Score Recompute, §8 Dense Indexer Score
Recompute, §9 Indexer Backward, §10 Dense Indexer Backward).

The loss these ops serve (DeepSeek-V3.2's indexer KL loss, normalized as cuDNN does), per query row
(b, t) over its valid slots J (top-k slots for the sparse ops, ratio-causal columns for the dense ops):

    I_j   = sum_h weights[b,t,h] * relu(index_q[b,t,h,:] . index_k[b,j,:])
    p_j   = softmax_{j in J}(sm_scale * I_j)            predict: the indexer's distribution
    tgt_j = the main attention's distribution over J    target: head-summed, L1-normalized, detached
    L     = grad_loss * loss_coeff / (B * S_q) * sum_{b,t} KL(tgt || p)
          = grad_loss * loss_coeff / (B * S_q) * sum_{b,t} sum_{j in J} tgt_j * (log tgt_j - log p_j)

dL/dI_j = c * sm_scale * (p_j * sum_{J} tgt - tgt_j), c = grad_loss * loss_coeff / (B * S_q); the backward
ops chain this through the weighted ReLU to index_q, weights and index_k. (The cuDNN kernels also clip
log-probabilities below -100; the reference does not, which differs only where p < e^-100.)

Layout: BSHD (cuDNN frontend DSA's primary layout). The dense ops (dense_indexer_score_recompute, dense_indexer_backward)
also take the packed THD layout, selected by passing cu_seqlens_q / cu_seqlens_k: §8 applies §3's ratio-causal
mask, which cuDNN frontend DSA defines per "batch or THD segment", and §10 consumes §8's outputs with the same offsets.
In THD the loss averages over all total_q packed rows (the analogue of B * S_q). The sparse ops stay BSHD, as
in cuDNN frontend DSA (§9: THD callers use B = 1 views with global ids). The default impl is "fused", as for every
dsagen op (the fused dense ops take THD per segment, reading the offsets on the host; the sparse ones stay BSHD).
"""

from __future__ import annotations

import torch

from ..reference.indexer_training import DenseIndexerScores, DenseKLResult, IndexerGrads
from ..validate import FLOAT_DTYPES, check_bool, check_float, check_impl, check_int, check_shape, check_tensor
from .indexer import (check_causal_offsets, check_dense_inputs, check_indexer_inputs, check_packed_indexer_inputs,
                      is_packed)

__all__ = ["sparse_indexer_score_recompute", "dense_indexer_score_recompute", "indexer_backward",
           "dense_indexer_backward", "dense_indexer_kl_backward", "DenseIndexerScores", "DenseKLResult",
           "IndexerGrads"]

_BACKWARD_NAMES = ("index_q", "index_k", "weights")


def _check_topk_indices(topk_indices, batch: int, seqlen_q: int, device: torch.device) -> None:
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32,), ndim=3, device=device)
    if tuple(topk_indices.shape[:2]) != (batch, seqlen_q):
        raise ValueError(f"topk_indices must have shape [B, S_q, topk] with B, S_q = {(batch, seqlen_q)}, "
                         f"got {tuple(topk_indices.shape)}")


def _check_grad_loss(grad_loss, device: torch.device) -> None:
    if grad_loss is None:
        return
    check_tensor("grad_loss", grad_loss, dtypes=FLOAT_DTYPES, device=device)
    if grad_loss.numel() != 1:
        raise ValueError(f"grad_loss must be a single-element tensor, got shape {tuple(grad_loss.shape)}")


def _check_score(name: str, t, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    check_tensor(name, t, dtypes=(torch.float32, torch.float64), ndim=len(shape), device=device)
    check_shape(name, t, shape, what)


def sparse_indexer_score_recompute(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor,
                                   topk_indices: torch.Tensor, *, topk_length: torch.Tensor | None = None,
                                   topk_indices_global: bool = False, sm_scale: float = 1.0,
                                   impl: str = "fused") -> torch.Tensor:
    """Indexer softmax over the top-k slots (cuDNN frontend DSA §6, Sparse Indexer Score Recompute).

    ::

        predict[b, q, i] = softmax_i(sm_scale * sum_h relu(q_indexer[b,q,h,:] . k_indexer[b, id_i, :]) * weights[b,q,h])

    over the row's valid slots. Slot i is valid when its local id (topk_indices[b,q,i], minus b * S_k for
    global ids) lies in [0, S_k), so an id never aliases another batch, and, with topk_length, when
    i < topk_length[b, q]. Duplicate ids are distinct softmax slots.

    Args:
        q_indexer: [B, S_q, H, D] fp16/bf16/fp32/fp64; k_indexer: [B, S_k, D], same dtype;
            weights: [B, S_q, H], any of those float dtypes.
        topk_indices: [B, S_q, topk] int32, -1 padded.
        topk_length: optional [B, S_q] int32 valid-prefix lengths (compact layout).
        topk_indices_global: ids are flat b * S_k + local (default False: per-batch local ids, as cuDNN frontend DSA).
        sm_scale: positive scale applied to the head-reduced score before the softmax (default 1; the
            document's formula has none, cuDNN's kernels take it; it must match indexer_backward's sm_scale).
        impl: "fused" (default; sm_90a: bf16/fp16 q and k, D 64/128, H <= 128, any topk) or "reference".

    Returns:
        predict [B, S_q, topk], FP32 (FP64 for FP64 inputs); 0 on invalid slots and all-invalid rows.
        Differentiable with respect to q_indexer, k_indexer and weights in the reference.

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, ranks, shapes, devices,
        sm_scale <= 0, bad impl; ValueError for impl="fused" on CPU; NotImplementedError where no fused
        kernel exists.
    """
    check_impl(impl)
    b, sq, _, _, _ = check_indexer_inputs(q_indexer, k_indexer, weights, allow_4d_k=False)
    _check_topk_indices(topk_indices, b, sq, q_indexer.device)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=(torch.int32,), ndim=2, device=q_indexer.device)
        check_shape("topk_length", topk_length, (b, sq), "[B, S_q]")
    check_bool("topk_indices_global", topk_indices_global)
    sm_scale = check_float("sm_scale", sm_scale, positive=True)
    kwargs = dict(topk_length=topk_length, topk_indices_global=topk_indices_global, sm_scale=sm_scale)
    if impl == "reference":
        from ..reference.indexer_training import sparse_indexer_score_recompute as reference

        return reference(q_indexer, k_indexer, weights, topk_indices, **kwargs)
    from ._fused import fused_impl

    return fused_impl("sparse_indexer_score_recompute", q_indexer.device)(q_indexer, k_indexer, weights,
                                                                          topk_indices, **kwargs)


def dense_indexer_score_recompute(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, *,
                                  ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                                  sm_scale: float = 1.0, cu_seqlens_q: torch.Tensor | None = None,
                                  cu_seqlens_k: torch.Tensor | None = None, impl: str = "fused"
                                  ) -> DenseIndexerScores:
    """Dense indexer logits and their logsumexp (cuDNN frontend DSA §8, Dense Indexer Score Recompute).

    ::

        out[b, q, k] = sm_scale * sum_h relu(q_indexer[b,q,h,:] . k_indexer[b,k,:]) * weights[b,q,h]   (valid k)
        out[b, q, k] = -inf                                                                          (masked k)
        denom[b, q]  = logsumexp_k(out[b, q, k])

    with indexer_scores' ratio-causal mask (k < clamp((q_causal_offsets[b] + q + 1) // ratio, 0, S_k)).
    Pass the same q_causal_offsets and ratio (and, in THD, the same cu_seqlens) to every dense score
    tensor of one loss.

    Packed THD layout, selected by passing cu_seqlens_q and cu_seqlens_k: segments exactly as in
    indexer_scores (segment-local rows, columns and mask; offsets read on the host).

    Args:
        q_indexer: [B, S_q, H, D] (THD: [total_q, H, D]); k_indexer: [B, S_k, D] or [B, S_k, 1, D] (THD:
            [total_k, D] or [total_k, 1, D]); weights: [B, S_q, H] (THD: [total_q, H]).
        ratio: >= 1. q_causal_offsets: optional [B] int32 (THD: one per segment). sm_scale: > 0 (default 1).
        cu_seqlens_q, cu_seqlens_k: THD offsets, as for indexer_scores.
        impl: "fused" (default) or "reference". The fused path (sm_90a) is indexer_scores' (its kernels, limits and
            layouts) with sm_scale folded into the weights the score kernel stages and the LSE as denom.

    Returns:
        DenseIndexerScores(out [B, S_q, S_k], denom [B, S_q]), FP32 (FP64 for FP64 inputs); denom is
        -inf for rows without valid columns. THD: out [total_q, max_seqlen_k] (column j = key row
        cu_seqlens_k[b] + j; -inf past the segment's S_k), denom [total_q]; rows at or after
        cu_seqlens_q[-1] are all -inf with denom -inf. Differentiable in the reference.

    Raises:
        as indexer_scores, plus ValueError for sm_scale <= 0.
    """
    check_impl(impl)
    b, packed, thd = check_dense_inputs(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q,
                                        cu_seqlens_k)
    sm_scale = check_float("sm_scale", sm_scale, positive=True)
    kwargs = dict(ratio=ratio, q_causal_offsets=q_causal_offsets, sm_scale=sm_scale)
    if impl == "reference":
        from ..reference.indexer_training import dense_indexer_score_recompute as reference

        return reference(q_indexer, k_indexer, weights, **kwargs, **thd)
    from ._fused import fused_impl
    from .indexer import _scores_shape, int32_offsets

    fn = fused_impl("dense_indexer_score_recompute", q_indexer.device)
    cu_q, cu_k = (int32_offsets(thd["cu_seqlens_q"]), int32_offsets(thd["cu_seqlens_k"])) if packed else (None, None)
    offsets = None if q_causal_offsets is None else q_causal_offsets.contiguous()
    out, denom = fn(q_indexer, k_indexer, weights, ratio=ratio, q_causal_offsets=offsets, sm_scale=sm_scale,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, shapes=_scores_shape(q_indexer, k_indexer, packed, thd))
    return DenseIndexerScores(out, denom)


def _check_backward_common(index_q, weights, index_k, grad_loss, sm_scale, loss_coeff):
    b, sq, h, d, sk = check_indexer_inputs(index_q, index_k, weights, names=_BACKWARD_NAMES, allow_4d_k=False)
    _check_grad_loss(grad_loss, index_q.device)
    check_float("sm_scale", sm_scale, positive=True)
    check_float("loss_coeff", loss_coeff)
    return b, sq, h, d, sk


def indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
                     index_score: torch.Tensor, topk_indices: torch.Tensor, *, grad_loss: torch.Tensor | None = None,
                     sm_scale: float = 1.0, loss_coeff: float = 1.0, topk_indices_global: bool = False,
                     deterministic: bool = False, impl: str = "fused") -> IndexerGrads:
    """Gradients of the sparse indexer KL loss (cuDNN frontend DSA §9, Indexer Backward).

    The loss (module docstring), with J = the row's valid top-k slots:

        L = grad_loss * loss_coeff / (B * S_q) * sum_{b,t} sum_{j in J} tgt_j * (log tgt_j - log p_j)
        p = softmax_J(sm_scale * sum_h weights * relu(index_q . index_k[id_j]))

    where tgt = attn_score (the target, e.g. sparse attention score recompute, constant) and p is
    supplied as index_score (predict, e.g. sparse_indexer_score_recompute or indexer_forward_topk's
    softmax with the same slots and sm_scale). Returns dL/d(index_q, weights, index_k), using
    dL/dI_j = c * sm_scale * (index_score_j * sum_J attn_score - attn_score_j). A slot is valid when its
    local id (minus b * S_k for global ids) lies in [0, S_k); invalid slots (e.g. -1 padding) contribute
    nothing whatever attn_score / index_score hold there. There is no topk_length: all slots are read.
    Inputs are not modified (the cuDNN kernel overwrites attn_score; this op does not).

    Args:
        index_q: [B, S_q, H, D] fp16/bf16/fp32/fp64; weights: [B, S_q, H]; index_k: [B, S_k, D] (same
            dtype as index_q).
        attn_score, index_score: [B, S_q, topk] FP32 (or FP64), aligned slot-for-slot with topk_indices.
        topk_indices: [B, S_q, topk] int32.
        grad_loss: optional single-element float tensor on the device (upstream dL/dloss; default 1),
            read on the device, never on the host.
        sm_scale: > 0 (default 1). loss_coeff: finite float (default 1).
        topk_indices_global: ids are flat b * S_k + local (default False: per-batch local ids).
        deterministic: d_index_k bitwise the same run to run (default False: the fused kernel adds FP32 atomics
            and the reference uses index_add_, whose order on CUDA is not fixed). d_index_q and d_weights are
            always deterministic. The fused deterministic mode stores each slot's FP32 row (up to 1 GiB at a
            time) and sums them per key with a reverse index (about 24 bytes per slot while it is built, for at
            most 2**24 slots at a time), all from torch's caching allocator.
        impl: "fused" (default; sm_90a: bf16/fp16 index_q and index_k, D 64/128, H <= 64, any topk) or
            "reference".

    Returns:
        IndexerGrads(d_index_q, d_weights, d_index_k), each in the dtype of its input (accumulated in FP32,
        FP64 for FP64).

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, ranks, shapes, devices,
        grad_loss with more than one element, sm_scale <= 0, non-finite loss_coeff, bad impl; ValueError
        for impl="fused" on CPU; NotImplementedError where no fused kernel exists.
    """
    check_impl(impl)
    b, sq, _, _, _ = _check_backward_common(index_q, weights, index_k, grad_loss, sm_scale, loss_coeff)
    device = index_q.device
    _check_topk_indices(topk_indices, b, sq, device)
    _check_score("attn_score", attn_score, tuple(topk_indices.shape), "[B, S_q, topk]", device)
    _check_score("index_score", index_score, tuple(topk_indices.shape), "[B, S_q, topk]", device)
    check_bool("topk_indices_global", topk_indices_global)
    check_bool("deterministic", deterministic)
    kwargs = dict(grad_loss=grad_loss, sm_scale=float(sm_scale), loss_coeff=float(loss_coeff),
                  topk_indices_global=topk_indices_global, deterministic=deterministic)
    if impl == "reference":
        from ..reference.indexer_training import indexer_backward as reference

        return reference(index_q, weights, index_k, attn_score, index_score, topk_indices, **kwargs)
    from ._fused import fused_impl

    return IndexerGrads(*fused_impl("indexer_backward", device)(index_q, weights, index_k, attn_score, index_score,
                                                                topk_indices, **kwargs))


def dense_indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                           attn_score: torch.Tensor, attn_l1norm: torch.Tensor, index_score: torch.Tensor,
                           index_lse: torch.Tensor, *, grad_loss: torch.Tensor | None = None, sm_scale: float = 1.0,
                           loss_coeff: float = 1.0, ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                           cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                           deterministic: bool = False, impl: str = "fused") -> IndexerGrads:
    """Gradients of the dense (full-KV) indexer KL loss (cuDNN frontend DSA §10, Dense Indexer Backward).

    The loss of indexer_backward with J = the ratio-causal columns k < clamp((q_causal_offsets[b] + q + 1)
    // ratio, 0, S_k), built from raw dense scores:

        tgt_j = attn_score[b,q,j] / attn_l1norm[b,q]        (dense attention score recompute; 0 if the norm is 0)
        p_j   = exp(index_score[b,q,j] - index_lse[b,q])    (dense_indexer_score_recompute's out and denom,
                                                              which already include sm_scale)
        dL/dI_j = c * sm_scale * (p_j * sum_J tgt - tgt_j),  c = grad_loss * loss_coeff / (B * S_q)

    Masked columns contribute nothing whatever the score tensors hold there. Pass the same ratio and
    q_causal_offsets as the score recompute calls. Inputs are not modified.

    Packed THD layout, selected by passing cu_seqlens_q and cu_seqlens_k (the offsets the dense score
    recomputes took; values read on the host): each segment's gradients are the BSHD ones of that segment
    with c = grad_loss * loss_coeff / total_q, i.e. the loss averages over all total_q packed rows (rows
    at or after cu_seqlens_q[-1] count there but contribute nothing). Score columns are segment-local,
    as the dense recomputes return them; columns at or past a segment's S_k are ignored. Gradient rows
    outside every segment are 0.

    Args:
        index_q: [B, S_q, H, D] (THD: [total_q, H, D]); weights: [B, S_q, H] (THD: [total_q, H]);
            index_k: [B, S_k, D] (THD: [total_k, D]).
        attn_score, index_score: [B, S_q, S_k] FP32 (or FP64) (THD: [total_q, W] with W >= max_seqlen_k,
            the width the dense recomputes return); attn_l1norm, index_lse: [B, S_q] (THD: [total_q]).
        grad_loss, sm_scale, loss_coeff: as for indexer_backward. ratio: >= 1.
        q_causal_offsets: optional [B] int32 (THD: one per segment).
        cu_seqlens_q, cu_seqlens_k: THD offsets, as for indexer_scores.
        deterministic: impl="fused" makes d_index_k bitwise repeatable too: per-slot dK rows of blocks of query
            rows (at most 1 GiB of FP32 each) summed over the rows in a fixed order, instead of FP32 atomics
            (the reference is deterministic either way).
        impl: "fused" (default) or "reference".

    Returns:
        IndexerGrads(d_index_q, d_weights, d_index_k), each in the dtype and shape of its input. impl="fused"
        (H <= 64, D 64 / 128, bf16 / fp16; THD: one launch per segment, the offsets read on the host) reads the
        score rows as they are (no [S_q, S_k] copy for FP32 scores with unit column stride); d_weights and
        d_index_q are bitwise repeatable, d_index_k sums FP32 atomics unless deterministic.

    Raises:
        as indexer_backward, plus the ratio / q_causal_offsets / cu_seqlens checks of indexer_scores;
        ValueError when a THD score tensor is narrower than max_seqlen_k.
    """
    check_impl(impl)
    device = index_q.device
    packed = is_packed(cu_seqlens_q, cu_seqlens_k)
    if packed:
        b, sq, _, _, _ = check_packed_indexer_inputs(index_q, index_k, weights, cu_seqlens_q, cu_seqlens_k,
                                                     names=_BACKWARD_NAMES, allow_3d_k=False)
        _check_grad_loss(grad_loss, device)
        check_float("sm_scale", sm_scale, positive=True)
        check_float("loss_coeff", loss_coeff)
        max_k = max((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist(), default=0)
        for name, t in (("attn_score", attn_score), ("index_score", index_score)):
            check_tensor(name, t, dtypes=(torch.float32, torch.float64), ndim=2, device=device)
            if t.shape[0] != sq or t.shape[1] < max_k:
                raise ValueError(f"{name} must have shape [total_q, W] with total_q = {sq} and W >= max_seqlen_k "
                                 f"= {max_k}, got {tuple(t.shape)}")
        _check_score("attn_l1norm", attn_l1norm, (sq,), "[total_q]", device)
        _check_score("index_lse", index_lse, (sq,), "[total_q]", device)
    else:
        b, sq, _, _, sk = _check_backward_common(index_q, weights, index_k, grad_loss, sm_scale, loss_coeff)
        _check_score("attn_score", attn_score, (b, sq, sk), "[B, S_q, S_k]", device)
        _check_score("attn_l1norm", attn_l1norm, (b, sq), "[B, S_q]", device)
        _check_score("index_score", index_score, (b, sq, sk), "[B, S_q, S_k]", device)
        _check_score("index_lse", index_lse, (b, sq), "[B, S_q]", device)
    check_int("ratio", ratio, minimum=1)
    check_causal_offsets(q_causal_offsets, b, device)
    check_bool("deterministic", deterministic)
    kwargs = dict(grad_loss=grad_loss, sm_scale=float(sm_scale), loss_coeff=float(loss_coeff), ratio=ratio,
                  q_causal_offsets=q_causal_offsets)
    if impl == "reference":
        from ..reference.indexer_training import dense_indexer_backward as reference

        thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
        return reference(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, **kwargs,
                         **thd)
    from . import _fused                     # looked up per call (tests stand a fake in for it)

    thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
    return IndexerGrads(*_fused.fused_impl("dense_indexer_backward", device)(
        index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, **kwargs, **thd,
        deterministic=deterministic))


def dense_indexer_kl_backward(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor,
                              weights: torch.Tensor, index_k: torch.Tensor, *, softmax_scale: float | None = None,
                              sm_scale: float = 1.0, loss_coeff: float = 1.0, grad_loss: torch.Tensor | None = None,
                              ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                              impl: str = "fused") -> DenseKLResult:
    """The dense warm-up indexer loss and its gradients in one call, from the attention and indexer inputs, without
    any [S_q, S_k] tensor (the three-op path materializes two: dense_attn_score_recompute's and
    dense_indexer_score_recompute's scores).

    For each query row (b, t) over its ratio-causal columns J = {s < clamp((q_causal_offsets[b] + t + 1) // ratio,
    0, S_k)}:

        A_s   = sum_h exp(softmax_scale * q[b, t, h] . k[b, s, h // G] - lse[b, t, h])   (dense_attn_score_recompute)
        tgt_s = A_s / sum_J A                                                            (0 when the sum is 0)
        p     = softmax_J(sm_scale * sum_h weights[b, t, h] * relu(index_q[b, t, h] . index_k[b, s]))
        loss  = loss_coeff / (B * S_q) * sum_{b, t} sum_J tgt_s * (log tgt_s - log p_s)

    and returns loss with the gradients of grad_loss * loss with respect to index_q, weights and index_k: exactly
    dense_indexer_backward fed by the two dense score recomputes (tgt is a constant, as there). Inputs are not
    modified.

    impl="reference" runs in blocks of query rows and key columns: a first pass over a row block's columns for
    the target's L1 norm and the indexer logsumexp, a second pass recomputing both for the loss and the gradients,
    so its memory grows with T, not T^2 (about 64 rows x 1024 columns x max(H_q, H_i) scratch values); it reads the
    row limits on the host. impl="fused" (BSHD; THD per segment, the offsets read on the host) runs per batch
    element and block of whole query rows three generated kernels: the indexer scores with their LSE, the dense
    attention scores with their L1 norms and the dense indexer backward (which also sums the loss), with at most
    1 GiB of score scratch (R = 2^30 / (8 S_k) rows per block), so its memory also grows with T; the fused kernels'
    limits apply (attention H <= 128, D 512 / 576, one key head; indexer H <= 64, D 64 / 128; bf16 / fp16), and
    d_index_k sums FP32 atomics (not bitwise repeatable).

    Packed THD layout, selected by passing cu_seqlens_q and cu_seqlens_k (read on the host): each segment is
    computed as a BSHD batch, as dense_indexer_backward does (the loss averages over all total_q rows; rows
    outside every segment get zero gradients).

    Args:
        q, k, lse, softmax_scale: the attention inputs as dense_attn_score_recompute takes them.
        index_q: [B, S_q, H_i, D_i]; weights: [B, S_q, H_i]; index_k: [B, S_k, D_i] (index_q's dtype), with q's
            B and S_q and k's S_k (THD: [total_q, H_i, D_i], [total_q, H_i], [total_k, D_i] with q's total_q and
            k's total_k).
        sm_scale, loss_coeff, grad_loss: as for dense_indexer_backward.
        ratio, q_causal_offsets: the mask, as for dense_attn_score_recompute (THD: one offset per segment).
        cu_seqlens_q, cu_seqlens_k: THD offsets, as for dense_indexer_backward.
        impl: "fused" (default) or "reference".

    Returns:
        DenseKLResult(loss, d_index_q, d_weights, d_index_k): loss 0-d FP32 (FP64 for FP64 inputs), without
        grad_loss; each gradient in the dtype and shape of its input.

    Raises:
        TypeError / ValueError naming the argument, as dense_attn_score_recompute and dense_indexer_backward
        (and for q / index_q of different B or S_q, or k / index_k of different S_k); NotImplementedError for
        impl="fused" with inputs outside the fused kernels' limits (the message names the limit).
    """
    from .sparse_attention import check_dense_attn_inputs

    check_impl(impl)
    packed = is_packed(cu_seqlens_q, cu_seqlens_k)
    k_heads, scale = check_dense_attn_inputs(q, k, lse, softmax_scale, packed=packed)
    if packed:
        b, sq, _, _, sk = check_packed_indexer_inputs(index_q, index_k, weights, cu_seqlens_q, cu_seqlens_k,
                                                      names=_BACKWARD_NAMES, allow_3d_k=False)
        _check_grad_loss(grad_loss, index_q.device)
        check_float("sm_scale", sm_scale, positive=True)
        check_float("loss_coeff", loss_coeff)
        lead, want = (sq,), "total_q"
    else:
        b, sq, _, _, sk = _check_backward_common(index_q, weights, index_k, grad_loss, sm_scale, loss_coeff)
        lead, want = (b, sq), "B and S_q"
    if index_q.device != q.device:
        raise ValueError(f"index_q must be on q's device {q.device}, got {index_q.device}")
    if tuple(q.shape[:len(lead)]) != lead:
        raise ValueError(f"q must have index_q's {want} = {lead}, got shape {tuple(q.shape)}")
    if k_heads.shape[len(lead) - 1] != sk:
        raise ValueError(f"k must have index_k's {'total_k' if packed else 'S_k'} = {sk} keys, got shape "
                         f"{tuple(k.shape)}")
    check_int("ratio", ratio, minimum=1)
    check_causal_offsets(q_causal_offsets, b, q.device)
    if impl == "reference":
        from ..reference.indexer_training import dense_indexer_kl_backward as reference

        thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
        return reference(q, k_heads, lse, index_q, weights, index_k, softmax_scale=scale, sm_scale=float(sm_scale),
                         loss_coeff=float(loss_coeff), grad_loss=grad_loss, ratio=ratio,
                         q_causal_offsets=q_causal_offsets, **thd)
    from . import _fused                     # looked up per call (tests stand a fake in for it)

    thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
    return _fused.fused_impl("dense_indexer_kl_backward", q.device)(
        q, k_heads, lse, index_q, weights, index_k, softmax_scale=scale, sm_scale=float(sm_scale),
        loss_coeff=float(loss_coeff), grad_loss=grad_loss, ratio=ratio, q_causal_offsets=q_causal_offsets, **thd)
