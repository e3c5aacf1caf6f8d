"""Fused (generated-kernel) dense attention score recompute (cuDNN frontend DSA §8) on validated BSHD inputs.

`dense_attn_score_recompute(q, k, lse, softmax_scale, *, ratio, q_causal_offsets)` flattens the batch, pads 1..63
heads to 64 and 65..127 to 128 (padded heads get lse = +inf: P = 0) and runs the sm_90a kernel of
DenseAttnScoreRecomputeSpec (attn_score_recompute/dense_sm90.py), which writes the whole [B * S_q, S_k] output
(the visible head sums, -inf past them) and each row's denominator. Nothing synchronizes with the host.

dsagen.dense_attn_score_recompute(impl="fused") calls it (GPU tests: tests/gpu/test_dense_attn_recompute.py; the
sanitizer case test_dense_attn_score_recompute).
"""

from __future__ import annotations

import torch

from ...reference.indexer import max_key_len, segment_offsets, thd_segments
from ...runtime import LoadedKernel
from ..lightning_indexer.host import dummy_offsets, eager
from ..sparse_mla.host import gather_rows, head_padded_launch_plan, padded_heads
from .spec import DenseAttnScoreRecomputeConfig, DenseAttnScoreRecomputeSpec, dense_config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1


def supported_reason(q: torch.Tensor, k: torch.Tensor) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can): q `(B, S_q, H, D)`, k `(B, S_k, D)` or
    `(B, S_k, 1, D)`."""
    h, d = q.shape[-2], q.shape[-1]
    if q.dtype not in _DTYPES:
        return f"q has dtype {q.dtype}; the fused kernel takes bfloat16 or float16 (use impl='reference')"
    if d not in (512, 576):
        return f"D={d}; the fused kernel takes 512 or 576 (use impl='reference')"
    if not 1 <= h <= 128:
        return f"H={h}; the fused kernel takes 1..128 heads (64 and 128 natively, fewer padded)"
    if k.dim() == 4 and k.shape[2] != 1:
        return f"k has {k.shape[2]} heads; the fused kernel takes one shared key head (MQA)"
    return ""


_launch_plans: dict = {}


def _launch_plan(h: int, d: int, dtype: torch.dtype, device: torch.device,
                 config: DenseAttnScoreRecomputeConfig | None
                 ) -> tuple[DenseAttnScoreRecomputeSpec, LoadedKernel, int]:
    """The spec, loaded kernel and n_ctas argument of a call (cached per call shape and config)."""
    return head_padded_launch_plan(_launch_plans, h, d, dtype, device, config, dense_config_for, _DTYPES)


def dense_attn_score_recompute(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, *,
                               ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, denom: torch.Tensor | None = None,
                               config: DenseAttnScoreRecomputeConfig | None = None,
                               cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused dense score recompute: q `(B, S_q, H, D)` bf16 / fp16 CUDA, k `(B, S_k, D)` (or `(B, S_k, 1, D)`),
    lse `(B, S_q, H)` FP32 natural-log, ratio >= 1, q_causal_offsets int32 `(B,)` or None; out `(B, S_q, S_k)` and
    denom `(B, S_q)` FP32 contiguous caller buffers or None (allocated). config: None (the op's, through the custom
    op `dsagen::dense_attn_score_recompute_fused`, opaque to torch.compile; an eager call on real CUDA tensors
    launches directly, lightning_indexer.host.eager) or another config (a direct launch, for
    benchmarks and tests). Returns (out, denom) as dsagen.dense_attn_score_recompute defines them. Raises
    NotImplementedError (with the reason) for inputs the kernel does not cover, ValueError for a caller buffer of
    another shape, dtype or layout and past the kernel's int32 limits, before anything is written.
    cu_seqlens_q / cu_seqlens_k (validated, both): the packed THD layout, dense_attn_score_recompute_packed (no
    caller buffers there)."""
    if cu_seqlens_q is not None:
        return dense_attn_score_recompute_packed(q, k, lse, softmax_scale, ratio=ratio,
                                                 q_causal_offsets=q_causal_offsets, cu_seqlens_q=cu_seqlens_q,
                                                 cu_seqlens_k=cu_seqlens_k, config=config)
    reason = supported_reason(q, k)
    if reason:
        raise NotImplementedError(f"dense_attn_score_recompute: {reason}")
    b, s_q = q.shape[0], q.shape[1]
    s_k = k.shape[1]
    if b * s_q > _MAX_GRID_X or b * s_k > 2**31 - 1:
        raise ValueError(f"dense_attn_score_recompute: {b * s_q} query rows / {b * s_k} key rows exceed the "
                         f"kernel's int32 limits")
    out = _buffer("out", out, (b, s_q, s_k), q.device)
    denom = _buffer("denom", denom, (b, s_q), q.device)
    if config is not None or eager(q):
        run(q, k, lse, softmax_scale, ratio, q_causal_offsets, out, denom, config)
    else:
        _fused_op(q, k, lse, float(softmax_scale), int(ratio), q_causal_offsets, out, denom)
    return out, denom


def _buffer(name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A caller's FP32 output buffer, checked (contiguous, of `shape`, on `device`), or a new one."""
    if t is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
        raise ValueError(f"dense_attn_score_recompute: {name} must be a contiguous float32 tensor of shape {shape} "
                         f"on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                         + ("" if t.is_contiguous() else " (not contiguous)"))
    return t


@torch.library.custom_op("dsagen::dense_attn_score_recompute_fused", mutates_args=("out", "denom"))
def _fused_op(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, ratio: int,
              q_causal_offsets: torch.Tensor | None, out: torch.Tensor, denom: torch.Tensor) -> None:
    """The fused kernel as a custom op writing out and denom (opaque to torch.compile; CUDA-graph capturable once
    the kernel is loaded)."""
    run(q, k, lse, softmax_scale, ratio, q_causal_offsets, out, denom)


@_fused_op.register_fake
def _(q, k, lse, softmax_scale, ratio, q_causal_offsets, out, denom):
    return None


def run(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, ratio: int,
        q_causal_offsets: torch.Tensor | None, out: torch.Tensor, denom: torch.Tensor,
        config: DenseAttnScoreRecomputeConfig | None = None) -> None:
    """The launch on checked inputs and buffers (see dense_attn_score_recompute): out `(B, S_q, S_k)` with unit
    column stride and rows `out.stride(-2)` apart (a contiguous tensor, or a THD segment's rows of a wider one),
    denom `(B, S_q)` contiguous."""
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    rows, n_kv = b * s_q, b * s_k
    if rows == 0:
        return
    if s_k == 0:
        denom.zero_()
        return
    spec, kernel, n_ctas = _launch_plan(h, d, q.dtype, q.device, config)
    hp = spec.num_heads
    qf = padded_heads(q.reshape(rows, h, d), hp)
    lse_f = padded_heads(lse.reshape(rows, h).to(torch.float32), hp, float("inf"))
    keys = gather_rows(k.reshape(n_kv, d))
    q_off, has_off = (q_causal_offsets, 1) if q_causal_offsets is not None else (dummy_offsets(q.device), 0)
    kernel.launch(qf, keys, lse_f, out, denom, q_off, rows, s_q, s_k, int(ratio), has_off, qf.stride(0),
                  out.stride(-2), float(softmax_scale), n_ctas)


def dense_attn_score_recompute_packed(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, *,
                                      ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                      config: DenseAttnScoreRecomputeConfig | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused dense score recompute in the packed THD layout, as dsagen.dense_attn_score_recompute defines it:
    q `(total_q, H, D)`, k `(total_k, D)` (or `(total_k, 1, D)`), lse `(total_q, H)`, validated offsets (read on the
    host: not CUDA-graph capturable). Returns out `(total_q, W)`, W = max_seqlen_k (column j of a row of segment b is
    key row cu_seqlens_k[b] + j; -inf past the segment's keys) and denom `(total_q,)` (0 for rows with nothing
    visible and rows after the last segment). One launch per non-empty segment, as a BSHD batch of one on views
    (its rows of out, W apart); q_causal_offsets[b] is the segment's."""
    reason = supported_reason(q[None], k[None])
    if reason:
        raise NotImplementedError(f"dense_attn_score_recompute: {reason}")
    segments = thd_segments(cu_seqlens_q, cu_seqlens_k)
    out = torch.full((q.shape[0], max_key_len(segments)), float("-inf"), dtype=torch.float32, device=q.device)
    denom = torch.zeros((q.shape[0],), dtype=torch.float32, device=q.device)
    for b, (r0, r1, k0, k1) in enumerate(segments):
        if r1 == r0 or k1 == k0:
            continue                                    # no row, or no key: -inf and 0 as filled
        if r1 - r0 > _MAX_GRID_X or k1 - k0 > 2**31 - 1:
            raise ValueError(f"dense_attn_score_recompute: segment {b} exceeds the kernel's int32 limits")
        off = segment_offsets(q_causal_offsets, b)
        run(q[None, r0:r1], k[None, k0:k1], lse[None, r0:r1], softmax_scale, ratio, off,
            out[None, r0:r1, :k1 - k0], denom[None, r0:r1], config)
    return out, denom
