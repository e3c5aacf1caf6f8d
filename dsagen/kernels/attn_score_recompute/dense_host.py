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

from ...runtime import LoadedKernel
from ..lightning_indexer.host import dummy_offsets
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
                               config: DenseAttnScoreRecomputeConfig | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused dense score recompute: q `(B, S_q, H, D)` bf16 / fp16 CUDA, k `(B, S_k, D)` (or `(B, S_k, 1, D)`),
    lse `(B, S_q, H)` FP32 natural-log, ratio >= 1, q_causal_offsets int32 `(B,)` or None; out `(B, S_q, S_k)` and
    denom `(B, S_q)` FP32 contiguous caller buffers or None (allocated). Returns (out, denom) as
    dsagen.dense_attn_score_recompute defines them. Raises NotImplementedError (with the reason) for inputs the
    kernel does not cover, ValueError past its int32 limits."""
    reason = supported_reason(q, k)
    if reason:
        raise NotImplementedError(f"dense_attn_score_recompute: {reason}")
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    rows, n_kv = b * s_q, b * s_k
    dev = q.device
    out = torch.empty((b, s_q, s_k), dtype=torch.float32, device=dev) if out is None else out
    denom = torch.empty((b, s_q), dtype=torch.float32, device=dev) if denom is None else denom
    if rows == 0:
        return out, denom
    if s_k == 0:
        denom.zero_()
        return out, denom
    if rows > _MAX_GRID_X or n_kv > 2**31 - 1:
        raise ValueError(f"dense_attn_score_recompute: {rows} query rows / {n_kv} key rows exceed the kernel's "
                         f"int32 limits")
    spec, kernel, n_ctas = _launch_plan(h, d, q.dtype, dev, config)
    hp = spec.num_heads
    qf = padded_heads(q.reshape(rows, h, d), hp)
    lse_f = padded_heads(lse.reshape(rows, h).to(torch.float32), hp, float("inf"))
    keys = gather_rows(k.reshape(n_kv, d))
    q_off, has_off = (q_causal_offsets, 1) if q_causal_offsets is not None else (dummy_offsets(dev), 0)
    kernel.launch(qf, keys, lse_f, out, denom, q_off, rows, s_q, s_k, int(ratio), has_off, qf.stride(0),
                  keys.stride(0), s_k, float(softmax_scale), n_ctas)
    return out, denom
