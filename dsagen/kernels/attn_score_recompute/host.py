"""Fused (generated-kernel) sparse attention score recompute (cuDNN frontend DSA §7), called by
dsagen.ops.sparse_attention.sparse_attn_score_recompute with validated inputs.

`sparse_attn_score_recompute(q_attn, k_attn, lse, topk_indices, softmax_scale, *, topk_length, topk_indices_global)`
flattens the batch (local ids are range-checked against S_k and moved to their batch's rows, so no id aliases another
batch), pads 1..63 heads to 64 and 65..127 to 128 (padded heads get lse = +inf: P = 0), runs the sm_90a kernel of
AttnScoreRecomputeSpec, which writes each slot's head sum S[t, j], and divides by each row's sum over its slots (a
fixed-order torch reduction; all zeros where that sum is 0). Returns `(B, S_q, topk)` FP32. Nothing in it
synchronizes with the host; it is the custom op `dsagen::sparse_attn_score_recompute_fused` (a fake gives
torch.compile the output).
"""

from __future__ import annotations

import torch

from ...runtime import LoadedKernel
from ..sparse_mla.host import gather_rows, head_padded_launch_plan, padded_heads
from .spec import AttnScoreRecomputeConfig, AttnScoreRecomputeSpec, config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1


def supported_reason(q_attn: torch.Tensor) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can)."""
    h, d = q_attn.shape[-2], q_attn.shape[-1]
    if q_attn.dtype not in _DTYPES:
        return f"q_attn has dtype {q_attn.dtype}; the fused kernel takes bfloat16 or float16 (use impl='reference')"
    if d not in (512, 576):
        return f"D={d}; the fused kernel takes 512 or 576 (use impl='reference')"
    if not 1 <= h <= 128:
        return f"H={h}; the fused kernel takes 1..128 heads (64 and 128 natively, fewer padded)"
    return ""


_launch_plans: dict = {}


def _launch_plan(h: int, d: int, dtype: torch.dtype, device: torch.device,
                 config: AttnScoreRecomputeConfig | None) -> tuple[AttnScoreRecomputeSpec, LoadedKernel, int]:
    """The spec, loaded kernel and n_ctas argument of a call (cached per call shape and config)."""
    return head_padded_launch_plan(_launch_plans, h, d, dtype, device, config, config_for, _DTYPES)


def sparse_attn_score_recompute(q_attn: torch.Tensor, k_attn: torch.Tensor, lse: torch.Tensor,
                                topk_indices: torch.Tensor, softmax_scale: float, *,
                                topk_length: torch.Tensor | None = None, topk_indices_global: bool = False,
                                config: AttnScoreRecomputeConfig | None = None) -> torch.Tensor:
    """The fused score recompute on inputs that dsagen.ops.sparse_attention validated: q_attn `(B, S_q, H, D)`
    bf16/fp16 CUDA, k_attn `(B, S_k, D)`, lse `(B, S_q, H)` FP32/FP64, topk_indices int32 `(B, S_q, topk)`,
    topk_length int32 `(B, S_q)` or None. config: None (the op's, through the custom op
    `dsagen::sparse_attn_score_recompute_fused`) or another AttnScoreRecomputeConfig (a direct launch, for benchmarks
    and tests). Returns the target `(B, S_q, topk)` FP32. Raises NotImplementedError (with the reason) for inputs
    the kernel does not cover.
    """
    reason = supported_reason(q_attn)
    if reason:
        raise NotImplementedError(f"sparse_attn_score_recompute: {reason}")
    if config is not None:
        return run(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length, topk_indices_global, config)
    return _fused_op(q_attn, k_attn, lse, topk_indices, float(softmax_scale), topk_length, bool(topk_indices_global))


@torch.library.custom_op("dsagen::sparse_attn_score_recompute_fused", mutates_args=())
def _fused_op(q_attn: torch.Tensor, k_attn: torch.Tensor, lse: torch.Tensor, topk_indices: torch.Tensor,
              softmax_scale: float, topk_length: torch.Tensor | None, topk_indices_global: bool) -> torch.Tensor:
    """The fused kernel as a custom op (opaque to torch.compile; CUDA-graph capturable once the kernel is loaded)."""
    return run(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length, topk_indices_global)


@_fused_op.register_fake
def _(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length, topk_indices_global):
    b, s_q = q_attn.shape[0], q_attn.shape[1]
    return q_attn.new_empty((b, s_q, topk_indices.shape[-1]), dtype=torch.float32)


def run(q_attn: torch.Tensor, k_attn: torch.Tensor, lse: torch.Tensor, topk_indices: torch.Tensor,
        softmax_scale: float, topk_length: torch.Tensor | None = None, topk_indices_global: bool = False,
        config: AttnScoreRecomputeConfig | None = None) -> torch.Tensor:
    """The launch on validated inputs (see sparse_attn_score_recompute)."""
    reason = supported_reason(q_attn)
    if reason:
        raise NotImplementedError(f"sparse_attn_score_recompute: {reason}")
    b, s_q, h, d = q_attn.shape
    s_k, topk = k_attn.shape[1], topk_indices.shape[-1]
    rows, n_kv = b * s_q, b * s_k
    out = torch.zeros((rows, topk), dtype=torch.float32, device=q_attn.device)
    if rows == 0 or topk == 0:
        return out.view(b, s_q, topk)
    if rows > _MAX_GRID_X or n_kv > 2**31 - 1:
        raise ValueError(f"sparse_attn_score_recompute: {rows} query rows / {n_kv} key rows exceed the kernel's "
                         f"int32 limits")
    spec, kernel, n_ctas = _launch_plan(h, d, q_attn.dtype, q_attn.device, config)
    hp = spec.num_heads
    q = padded_heads(q_attn.reshape(rows, h, d), hp)
    lse_f = padded_heads(lse.reshape(rows, h).to(torch.float32), hp, float("inf"))
    keys = gather_rows(k_attn.reshape(n_kv, d))
    ids = topk_indices.reshape(rows, topk)
    if not topk_indices_global and b > 1:
        # local ids: range-check against S_k, then move to the batch's rows (never aliasing another batch)
        batch = torch.arange(b, device=ids.device, dtype=torch.int32).repeat_interleave(s_q).view(rows, 1)
        ids = torch.where((ids >= 0) & (ids < s_k), ids + batch * s_k, -1).to(torch.int32)
    elif ids.stride(1) != 1:
        ids = ids.contiguous()
    length = None if topk_length is None else topk_length.reshape(rows).to(torch.int32).contiguous()
    kernel.launch(q, keys, ids, ids if length is None else length, lse_f, out, rows, n_kv, topk, q.stride(0),
                  keys.stride(0), ids.stride(0), float(softmax_scale), int(length is not None), n_ctas)
    z = out.sum(dim=-1, keepdim=True)
    target = torch.where(z > 0, out / torch.where(z > 0, z, 1.0), 0.0)
    return target.view(b, s_q, topk)
