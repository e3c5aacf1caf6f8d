"""Fused (generated-kernel) dense indexer backward (cuDNN frontend DSA §10) on validated BSHD inputs.

`dense_indexer_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, *, grad_loss,
sm_scale, loss_coeff, ratio, q_causal_offsets)` flattens the batch, pads 1..63 heads to 64 with zero weights, folds
c * sm_scale (c = grad_loss * loss_coeff / (B S_q), grad_loss read on the device) into one FP32 value and runs the
sm_90a kernel of DenseIndexerBwdSpec (indexer_bwd/dense_sm90.py), which reads the dense score rows directly: no
[S_q, S_k] tensor is made here. Inputs are not modified. dK accumulates by FP32 atomics (not bitwise repeatable).

dsagen.dense_indexer_backward(impl="fused") calls it (GPU tests: tests/gpu/test_dense_indexer_backward.py; the
sanitizer case test_dense_indexer_backward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...reference.indexer import segment_offsets, thd_segments
from ...runtime import LoadedKernel
from ..lightning_indexer.host import dummy_offsets, eager
from ..sparse_mla.host import gather_rows, padded_heads
from .host import HEADS, cached_plan, supported_reason
from .spec import DenseIndexerBwdConfig, DenseIndexerBwdSpec, dense_config_for

_INT32_MAX = 2**31 - 1
_launch_plans: dict = {}


def _launch_plan(d: int, dtype: torch.dtype, device: torch.device, config: DenseIndexerBwdConfig | None,
                 deterministic: bool = False, kl_loss: bool = False
                 ) -> tuple[DenseIndexerBwdSpec, LoadedKernel, int, DenseIndexerBwdConfig]:
    """The spec, loaded kernel, n_ctas argument and config of a call (cached per call shape, config and mode;
    kl_loss: the KL path's kernel)."""
    return cached_plan(_launch_plans, dense_config_for, d, dtype, device, deterministic, config, kl_loss=kl_loss)


def _rows_f32(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """t viewed as contiguous-row FP32 [rows, width] (a copy only when the dtype or the layout needs one)."""
    t = t.reshape(rows, width)
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t if t.stride(1) == 1 else t.contiguous()


def dense_indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                           attn_score: torch.Tensor, attn_l1norm: torch.Tensor, index_score: torch.Tensor,
                           index_lse: torch.Tensor, *, grad_loss: torch.Tensor | None = None, sm_scale: float = 1.0,
                           loss_coeff: float = 1.0, ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                           config: DenseIndexerBwdConfig | None = None, cu_seqlens_q: torch.Tensor | None = None,
                           cu_seqlens_k: torch.Tensor | None = None, deterministic: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused dense indexer backward: index_q `(B, S_q, H, D)` bf16 / fp16 CUDA, weights `(B, S_q, H)`, index_k
    `(B, S_k, D)`, attn_score / index_score `(B, S_q, S_k)` FP32 (the dense recomputes' outputs), attn_l1norm /
    index_lse `(B, S_q)`, grad_loss a one-element tensor or None (1), ratio >= 1, q_causal_offsets int32 `(B,)` or
    None. config: None (the op's, through the custom op `dsagen::dense_indexer_backward_fused`, opaque to
    torch.compile; an eager call on real CUDA tensors launches directly, lightning_indexer.host.eager) or another
    config (a direct launch, for benchmarks and tests). Returns (d_index_q, d_weights,
    d_index_k) in the inputs' dtypes, as dsagen.dense_indexer_backward defines them. Raises NotImplementedError
    (with the reason) for inputs the kernel does not cover. cu_seqlens_q / cu_seqlens_k (validated, both): the
    packed THD layout, dense_indexer_backward_packed. deterministic: d_index_k bitwise repeatable (per-slot rows
    summed over the query rows in a fixed order, run)."""
    if cu_seqlens_q is not None:
        return dense_indexer_backward_packed(index_q, weights, index_k, attn_score, attn_l1norm, index_score,
                                             index_lse, grad_loss=grad_loss, sm_scale=sm_scale, loss_coeff=loss_coeff,
                                             ratio=ratio, q_causal_offsets=q_causal_offsets,
                                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, config=config,
                                             deterministic=deterministic)
    reason = supported_reason(index_q, index_k)
    if reason:
        raise NotImplementedError(f"dense_indexer_backward: {reason}")
    rows, n_k = index_q.shape[0] * index_q.shape[1], index_k.shape[0] * index_k.shape[1]
    if rows > _INT32_MAX or n_k > _INT32_MAX:
        raise ValueError(f"dense_indexer_backward: {rows} query rows / {n_k} key rows exceed the kernel's int32 "
                         f"limits")
    if config is not None or eager(index_q):
        return run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
                   loss_coeff, ratio, q_causal_offsets, config, bool(deterministic))
    return _fused_op(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                     float(sm_scale), float(loss_coeff), int(ratio), q_causal_offsets, bool(deterministic))


@torch.library.custom_op("dsagen::dense_indexer_backward_fused", mutates_args=())
def _fused_op(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
              attn_l1norm: torch.Tensor, index_score: torch.Tensor, index_lse: torch.Tensor,
              grad_loss: torch.Tensor | None, sm_scale: float, loss_coeff: float, ratio: int,
              q_causal_offsets: torch.Tensor | None, deterministic: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward as a custom op (opaque to torch.compile; CUDA-graph capturable once the kernel is
    loaded)."""
    return run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
               loss_coeff, ratio, q_causal_offsets, None, deterministic)


@_fused_op.register_fake
def _(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale, loss_coeff,
      ratio, q_causal_offsets, deterministic):
    return torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)


class _Operands(NamedTuple):
    """A call's kernel operands (run's flattening of dense_indexer_backward's arguments)."""
    q: torch.Tensor          # (rows, HEADS, D), heads padded with zero weights
    keys: torch.Tensor       # (B * S_k, D)
    attn: torch.Tensor       # (rows, ld_s) FP32
    idx: torch.Tensor        # (rows, ld_s) FP32, attn's row stride
    norm: torch.Tensor       # (rows,) FP32
    lse: torch.Tensor        # (rows,) FP32
    cs: torch.Tensor         # (1,) FP32: grad_loss * loss_coeff / rows * sm_scale
    w: torch.Tensor          # (rows, HEADS) FP32
    q_off: torch.Tensor      # (B,) int32 (a dummy when has_off is 0)
    has_off: int


def _operands(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
              loss_coeff, q_causal_offsets) -> _Operands:
    """The kernel operands of checked non-empty inputs (copies only where a dtype or layout needs one)."""
    b, s_q, h, d = index_q.shape
    s_k = index_k.shape[1]
    rows, dev = b * s_q, index_q.device
    cs = torch.full((1,), float(loss_coeff) / rows * float(sm_scale), dtype=torch.float32, device=dev)
    if grad_loss is not None:
        cs = cs * grad_loss.to(torch.float32).reshape(1)
    attn = _rows_f32(attn_score, rows, s_k)
    idx = _rows_f32(index_score, rows, s_k)
    if attn.stride(0) != idx.stride(0):
        idx = idx.contiguous()
        attn = attn.contiguous()
    q_off, has_off = (q_causal_offsets, 1) if q_causal_offsets is not None else (dummy_offsets(dev), 0)
    return _Operands(padded_heads(index_q.reshape(rows, h, d), HEADS), gather_rows(index_k.reshape(b * s_k, d)),
                     attn, idx, attn_l1norm.reshape(rows).to(torch.float32).contiguous(),
                     index_lse.reshape(rows).to(torch.float32).contiguous(), cs,
                     padded_heads(weights.reshape(rows, h).to(torch.float32), HEADS), q_off, has_off)


def _launch(kernel: LoadedKernel, o: _Operands, dq, dw, dk, loss_parts, rows: int, s_q: int, s_k: int, ratio: int,
            n_ctas: int) -> None:
    """One launch over `rows` query rows of o (or of the row slices the deterministic path passes in o's place);
    loss_parts: (rows, 4) FP32 for the kl_loss kernel, None for the others (norm stands in for the unread
    pointer)."""
    kernel.launch(o.q, o.keys, o.attn, o.idx, o.norm, o.lse, o.cs, o.w, dq, dw, dk, o.q_off,
                  o.norm if loss_parts is None else loss_parts, rows, s_q, s_k, int(ratio), o.has_off,
                  o.keys.stride(0), o.attn.stride(0), n_ctas)


def _new_grads(index_q: torch.Tensor, n_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's outputs for index_q `(B, S_q, H, D)` and n_k key rows: dq `(rows, HEADS, D)` in q's dtype, dw
    `(rows, HEADS)` FP32 (both written whole by the kernel) and the zeroed FP32 dK accumulator `(n_k, D)`."""
    rows, d, dev = index_q.shape[0] * index_q.shape[1], index_q.shape[3], index_q.device
    return (torch.empty((rows, HEADS, d), dtype=index_q.dtype, device=dev),
            torch.empty((rows, HEADS), dtype=torch.float32, device=dev),
            torch.zeros((n_k, d), dtype=torch.float32, device=dev))


def _unpadded(dq: torch.Tensor, dw: torch.Tensor, index_q: torch.Tensor, weights: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """dq / dw without the padded heads, in index_q's shape and weights' shape and dtype."""
    b, s_q, h, d = index_q.shape
    return dq[:, :h].reshape(b, s_q, h, d), dw[:, :h].reshape(b, s_q, h).to(weights.dtype)


def run(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
        attn_l1norm: torch.Tensor, index_score: torch.Tensor, index_lse: torch.Tensor, grad_loss: torch.Tensor | None,
        sm_scale: float, loss_coeff: float, ratio: int, q_causal_offsets: torch.Tensor | None,
        config: DenseIndexerBwdConfig | None = None, deterministic: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch on checked inputs (see dense_indexer_backward); new output tensors. deterministic: per batch
    element, launches over blocks of query rows whose per-slot dK rows ([rows, S_k, D] FP32, at most
    config.slot_bytes) are summed over the rows by one torch reduction each and added in block order."""
    b, s_q, _, d = index_q.shape
    s_k = index_k.shape[1]
    rows, n_k = b * s_q, b * s_k
    dev = index_q.device
    if rows == 0 or s_k == 0:
        return torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k)
    spec, kernel, n_ctas, cfg = _launch_plan(d, index_q.dtype, dev, config, deterministic)
    o = _operands(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
                  loss_coeff, q_causal_offsets)
    dq, dw, dk = _new_grads(index_q, n_k)
    if not deterministic:
        _launch(kernel, o, dq, dw, dk, None, rows, s_q, s_k, ratio, n_ctas)
    else:
        step = max(1, min(s_q, cfg.slot_bytes // (s_k * d * 4)))
        slots = torch.empty((step, s_k, d), dtype=torch.float32, device=dev)
        for bi in range(b):
            b_off = q_causal_offsets[bi:bi + 1] if q_causal_offsets is not None else None
            for r0 in range(0, s_q, step):
                n, t0 = min(step, s_q - r0), bi * s_q + r0      # rows [t0, t0 + n): a batch of one of n rows
                part = slots[:n].zero_()
                off = (b_off + r0 if b_off is not None else torch.full((1,), r0, dtype=torch.int32, device=dev))
                block = _Operands(o.q[t0:t0 + n], o.keys[bi * s_k:(bi + 1) * s_k], o.attn[t0:t0 + n],
                                  o.idx[t0:t0 + n], o.norm[t0:t0 + n], o.lse[t0:t0 + n], o.cs, o.w[t0:t0 + n], off, 1)
                _launch(kernel, block, dq[t0:t0 + n], dw[t0:t0 + n], part, None, n, n, s_k, ratio, n_ctas)
                dk[bi * s_k:(bi + 1) * s_k] += part.sum(0)
    return *_unpadded(dq, dw, index_q, weights), dk.view(b, s_k, d).to(index_k.dtype)


def kl_block_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
                      attn_l1norm: torch.Tensor, index_score: torch.Tensor, index_lse: torch.Tensor, *,
                      grad_loss: torch.Tensor | None = None, sm_scale: float = 1.0, loss_coeff: float = 1.0,
                      ratio: int = 1, q_causal_offsets: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense indexer backward of one block of the fused KL loss path (kl_host) with the block's KL sum from the
    same launch: the inputs as dense_indexer_backward takes them (BSHD, non-empty, supported: kl_host checks).
    Returns (d_index_q, d_weights in the inputs' dtypes, d_index_k FP32 `(B, S_k, D)` (FP32 atomics), kl FP32 0-d):
    kl = sum over the rows and their visible keys with tgt = attn / norm > 0 of tgt * (log tgt - (index - lse))
    (the rows' per-warp partials summed in a fixed order), not scaled by loss_coeff. Eager calls launch directly;
    under tracing the custom op `dsagen::dense_indexer_kl_block_fused`."""
    if eager(index_q):
        return _kl_run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                       float(sm_scale), float(loss_coeff), int(ratio), q_causal_offsets)
    return _kl_op(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                  float(sm_scale), float(loss_coeff), int(ratio), q_causal_offsets)


def _kl_run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
            loss_coeff, ratio, q_causal_offsets):
    """kl_block_backward's launch (the kl_loss kernel); new output tensors."""
    b, s_q, _, d = index_q.shape
    s_k = index_k.shape[1]
    rows, dev = b * s_q, index_q.device
    _, kernel, n_ctas, _ = _launch_plan(d, index_q.dtype, dev, None, False, kl_loss=True)
    o = _operands(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
                  loss_coeff, q_causal_offsets)
    dq, dw, dk = _new_grads(index_q, b * s_k)
    parts = torch.empty((rows, 4), dtype=torch.float32, device=dev)
    _launch(kernel, o, dq, dw, dk, parts, rows, s_q, s_k, ratio, n_ctas)
    return *_unpadded(dq, dw, index_q, weights), dk.view(b, s_k, d), parts.sum()


@torch.library.custom_op("dsagen::dense_indexer_kl_block_fused", mutates_args=())
def _kl_op(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
           attn_l1norm: torch.Tensor, index_score: torch.Tensor, index_lse: torch.Tensor,
           grad_loss: torch.Tensor | None, sm_scale: float, loss_coeff: float, ratio: int,
           q_causal_offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kl_block_backward as a custom op (opaque to torch.compile; CUDA-graph capturable once the kernel is
    loaded)."""
    return _kl_run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale,
                   loss_coeff, ratio, q_causal_offsets)


@_kl_op.register_fake
def _(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale, loss_coeff,
      ratio, q_causal_offsets):
    return (torch.empty_like(index_q), torch.empty_like(weights),
            index_k.new_empty(index_k.shape, dtype=torch.float32), index_q.new_empty((), dtype=torch.float32))


def dense_indexer_backward_packed(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                                  attn_score: torch.Tensor, attn_l1norm: torch.Tensor, index_score: torch.Tensor,
                                  index_lse: torch.Tensor, *, grad_loss: torch.Tensor | None = None,
                                  sm_scale: float = 1.0, loss_coeff: float = 1.0, ratio: int = 1,
                                  q_causal_offsets: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, config: DenseIndexerBwdConfig | None = None,
                                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused dense indexer backward in the packed THD layout, as dsagen.dense_indexer_backward defines it:
    index_q `(total_q, H, D)`, weights `(total_q, H)`, index_k `(total_k, D)`, the score rows `(total_q, W)` (W >=
    max_seqlen_k, segment-local columns), attn_l1norm / index_lse `(total_q,)`, validated offsets (read on the host:
    not CUDA-graph capturable). One launch per segment with rows and keys, as a BSHD batch of one on views (its
    score rows keep their stride W), with loss_coeff * rows / total_q so that c = grad_loss * loss_coeff / total_q
    as over the whole pack; gradient rows of no segment (and of segments without keys) are 0."""
    reason = supported_reason(index_q, index_k)
    if reason:
        raise NotImplementedError(f"dense_indexer_backward: {reason}")
    total_q = index_q.shape[0]
    d_q, d_w, d_k = torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k)
    for b, (r0, r1, k0, k1) in enumerate(thd_segments(cu_seqlens_q, cu_seqlens_k)):
        if r1 == r0 or k1 == k0:
            continue
        off = segment_offsets(q_causal_offsets, b)
        g_q, g_w, g_k = run(index_q[None, r0:r1], weights[None, r0:r1], index_k[None, k0:k1],
                            attn_score[None, r0:r1, :k1 - k0], attn_l1norm[None, r0:r1],
                            index_score[None, r0:r1, :k1 - k0], index_lse[None, r0:r1], grad_loss, sm_scale,
                            float(loss_coeff) * (r1 - r0) / total_q, ratio, off, config, deterministic)
        d_q[r0:r1] = g_q[0]
        d_w[r0:r1] = g_w[0]
        d_k[k0:k1] = g_k[0]
    return d_q, d_w, d_k
