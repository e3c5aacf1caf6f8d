"""Fused (generated-kernel) sparse indexer score recompute (cuDNN frontend DSA §6), called by
dsagen.ops.indexer_training.sparse_indexer_score_recompute with validated inputs.

`sparse_indexer_score_recompute(q_indexer, k_indexer, weights, topk_indices, *, topk_length, topk_indices_global,
sm_scale)` flattens the batch (local or global ids are range-checked against their own batch's S_k rows and
addressed in the flattened keys, so no id aliases another batch), pads 1..63 heads to 64 and 65..127 to 128 (padded heads get weight 0), folds sm_scale and
log2 e into FP32 weights, and runs the sm_90a kernel of IndexerScoreRecomputeSpec, which writes the softmax over
each row's valid slots. Returns `(B, S_q, topk)` FP32. Nothing in it synchronizes with the host; it is the custom op
`dsagen::sparse_indexer_score_recompute_fused` (a fake gives torch.compile the output).
"""

from __future__ import annotations

import math

import torch

from ...runtime import LoadedKernel
from ..indices.host import batch_flat_ids
from ..sparse_mla.host import gather_rows, head_padded_launch_plan, padded_heads
from .spec import IndexerScoreRecomputeConfig, IndexerScoreRecomputeSpec, config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_INT32_MAX = 2**31 - 1


def supported_reason(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can)."""
    h, d = q_indexer.shape[-2], q_indexer.shape[-1]
    if q_indexer.dtype not in _DTYPES:
        return (f"q_indexer has dtype {q_indexer.dtype}; the fused kernel takes bfloat16 or float16 (use "
                f"impl='reference')")
    if k_indexer.dtype != q_indexer.dtype:
        return f"k_indexer has dtype {k_indexer.dtype}; the fused kernel takes q_indexer's ({q_indexer.dtype})"
    if d not in (64, 128):
        return f"D={d}; the fused kernel takes 64 or 128 (use impl='reference')"
    if not 1 <= h <= 128:
        return f"H={h}; the fused kernel takes 1..128 heads (64 and 128 natively, fewer padded)"
    return ""


_launch_plans: dict = {}


def _launch_plan(h: int, d: int, dtype: torch.dtype, device: torch.device,
                 config: IndexerScoreRecomputeConfig | None) -> tuple[IndexerScoreRecomputeSpec, LoadedKernel, int]:
    """The spec, loaded kernel and n_ctas argument of a call (cached per call shape and config)."""
    return head_padded_launch_plan(_launch_plans, h, d, dtype, device, config, config_for, _DTYPES)


def run(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, topk_indices: torch.Tensor,
        topk_length: torch.Tensor | None, topk_indices_global: bool, sm_scale: float,
        config: IndexerScoreRecomputeConfig | None = None) -> torch.Tensor:
    """The launch on validated inputs (see sparse_indexer_score_recompute); `config`: None (the op's) or another
    IndexerScoreRecomputeConfig."""
    reason = supported_reason(q_indexer, k_indexer, weights)
    if reason:
        raise NotImplementedError(f"sparse_indexer_score_recompute: {reason}")
    b, s_q, h, d = q_indexer.shape
    s_k, topk = k_indexer.shape[1], topk_indices.shape[-1]
    rows, n_k = b * s_q, b * s_k
    if rows == 0 or topk == 0 or s_k == 0:
        return torch.zeros((b, s_q, topk), dtype=torch.float32, device=q_indexer.device)
    if rows > _INT32_MAX or n_k > _INT32_MAX:
        raise ValueError(f"sparse_indexer_score_recompute: {rows} query rows / {n_k} key rows exceed the kernel's "
                         f"int32 limits")
    spec, kernel, n_ctas = _launch_plan(h, d, q_indexer.dtype, q_indexer.device, config)
    hp = spec.num_heads
    q = padded_heads(q_indexer.reshape(rows, h, d), hp)
    w = padded_heads(weights.reshape(rows, h).to(torch.float32) * (float(sm_scale) * math.log2(math.e)), hp)
    keys = gather_rows(k_indexer.reshape(n_k, d))
    ids = topk_indices.reshape(rows, topk)
    if b > 1:
        ids = batch_flat_ids(topk_indices, s_k, topk_indices_global)   # an id never aliases another batch
    elif ids.stride(1) != 1:
        ids = ids.contiguous()
    length = None if topk_length is None else topk_length.reshape(rows).to(torch.int32).contiguous()
    out = torch.empty((rows, topk), dtype=torch.float32, device=q_indexer.device)
    kernel.launch(q, keys, ids, ids if length is None else length, w, out, rows, n_k, topk, q.stride(0),
                  keys.stride(0), ids.stride(0), int(length is not None), n_ctas)
    return out.view(b, s_q, topk)


@torch.library.custom_op("dsagen::sparse_indexer_score_recompute_fused", mutates_args=())
def _fused_op(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, topk_indices: torch.Tensor,
              topk_length: torch.Tensor | None, topk_indices_global: bool, sm_scale: float) -> torch.Tensor:
    """The fused kernel as a custom op (opaque to torch.compile; CUDA-graph capturable once the kernel is loaded)."""
    return run(q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, sm_scale)


@_fused_op.register_fake
def _(q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, sm_scale):
    b, s_q = q_indexer.shape[0], q_indexer.shape[1]
    return q_indexer.new_empty((b, s_q, topk_indices.shape[-1]), dtype=torch.float32)


def sparse_indexer_score_recompute(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor,
                                   topk_indices: torch.Tensor, *, topk_length: torch.Tensor | None = None,
                                   topk_indices_global: bool = False, sm_scale: float = 1.0,
                                   config: IndexerScoreRecomputeConfig | None = None) -> torch.Tensor:
    """The fused indexer score recompute on inputs that dsagen.ops.indexer_training validated: q_indexer `(B, S_q,
    H, D)` bf16/fp16 CUDA, k_indexer `(B, S_k, D)` of q's dtype, weights `(B, S_q, H)` any float dtype, topk_indices
    int32 `(B, S_q, topk)`, topk_length int32 `(B, S_q)` or None, sm_scale > 0. config: None (the op's, through the
    custom op) or another IndexerScoreRecomputeConfig (a direct launch, for benchmarks and tests). Returns predict
    `(B, S_q, topk)` FP32. Raises NotImplementedError (with the reason) for inputs the kernel does not cover."""
    if config is not None:
        return run(q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, sm_scale, config)
    reason = supported_reason(q_indexer, k_indexer, weights)
    if reason:
        raise NotImplementedError(f"sparse_indexer_score_recompute: {reason}")
    return _fused_op(q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, float(sm_scale))
