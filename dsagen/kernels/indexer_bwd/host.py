"""Fused (generated-kernel) sparse indexer backward (cuDNN frontend DSA §9), called by
dsagen.ops.indexer_training.indexer_backward with validated inputs.

`indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, *, grad_loss, sm_scale, loss_coeff,
topk_indices_global, deterministic)`:
1. flattens the batch: each id is range-checked against its own batch's S_k rows (local ids, or global ids
   b * S_k + local) and addressed in the flattened keys, -1 where invalid, so no id aliases another batch;
2. the score gradient dI = c * sm_scale * (p * sum_J tgt - tgt) on valid slots (0 elsewhere), c = grad_loss *
   loss_coeff / (B * S_q) read on the device (torch, a fixed-order row sum: cuDNN's kernel 1, without overwriting
   attn_score);
3. in atomic mode, for a key pool whose FP32 accumulator misses L2 (IndexerBwdConfig.ordered), orders each row's
   valid ids by key window with the sparse MLA backward's ordering kernel (sparse_mla_bwd.host.slot_windows, which
   also gives the kernel each ordered slot's input slot for its dI);
4. pads 1..63 heads to 64 (zero q and weights) and runs the sm_90a kernel of IndexerBwdSpec: d_index_q in the input
   dtype, d_weights in FP32 (fixed order: deterministic), d_index_k into an FP32 accumulator by 16-byte atomics, or
   with deterministic=True per-slot rows (launches of at most `chunk_bytes`) summed by the row scatter-add
   (row_scatter_add.host.RowScatter, one reverse index for the launches of up to INDEX_SLOTS slots: each id's
   rows added in slot order, the same every run);
5. casts the gradients to their inputs' dtypes.
Nothing in it synchronizes with the host; it is the custom op `dsagen::indexer_backward_fused`.
"""

from __future__ import annotations

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index, device_sm_count
from ..indices.host import batch_flat_ids
from ..row_scatter_add.host import INDEX_SLOTS, RowScatter
from ..sparse_mla.host import gather_rows, padded_heads
from ..sparse_mla_bwd.host import slot_windows
from .spec import IndexerBwdConfig, IndexerBwdSpec, config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_INT32_MAX = 2**31 - 1
HEADS = 64


def supported_reason(index_q: torch.Tensor, index_k: torch.Tensor) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can)."""
    h, d = index_q.shape[-2], index_q.shape[-1]
    if index_q.dtype not in _DTYPES:
        return f"index_q has dtype {index_q.dtype}; the fused kernel takes bfloat16 or float16 (use impl='reference')"
    if index_k.dtype != index_q.dtype:
        return f"index_k has dtype {index_k.dtype}; the fused kernel takes index_q's ({index_q.dtype})"
    if d not in (64, 128):
        return f"D={d}; the fused kernel takes 64 or 128 (use impl='reference')"
    if not 1 <= h <= HEADS:
        return f"H={h}; the fused kernel takes 1..64 heads (64 natively, fewer padded; use impl='reference')"
    return ""


_launch_plans: dict = {}


def cached_plan(cache: dict, op_config_for, d: int, dtype: torch.dtype, device: torch.device, deterministic: bool,
                config, **spec_kw) -> tuple:
    """(spec, loaded kernel, n_ctas argument, config) of a call of an indexer backward family (the sparse form with
    config_for, the dense one with dense_config_for: configs with spec(d, dtype name, arch, deterministic=,
    **spec_kw) and n_ctas(num_sms)); config None: op_config_for's. Cached in `cache` per call shape, mode and
    config."""
    key = (d, dtype, device, deterministic, config, *sorted(spec_kw.items()))
    plan = cache.get(key)
    if plan is None:
        arch = device_arch(device)
        num_sms = device_sm_count(device_index(device))
        cfg = op_config_for(d, dtype, arch, num_sms) if config is None else config
        spec = cfg.spec(d, _DTYPES[dtype], arch, deterministic=deterministic, **spec_kw)
        plan = cache[key] = (spec, get_kernel(spec, device_index(device)), cfg.n_ctas(num_sms), cfg)
    return plan


def _launch_plan(d: int, dtype: torch.dtype, device: torch.device, deterministic: bool,
                 config: IndexerBwdConfig | None) -> tuple[IndexerBwdSpec, LoadedKernel, int, IndexerBwdConfig]:
    """The spec, loaded kernel, n_ctas argument and config of a call (cached per call shape and config)."""
    return cached_plan(_launch_plans, config_for, d, dtype, device, deterministic, config)


def score_grad(attn_score: torch.Tensor, index_score: torch.Tensor, valid: torch.Tensor, grad_loss, loss_coeff: float,
               rows: int, sm_scale: float) -> torch.Tensor:
    """dI = c * sm_scale * (p * sum_J tgt - tgt) over the valid slots of (rows, topk) FP32 scores, 0 elsewhere,
    with c = grad_loss * loss_coeff / rows (grad_loss: a one-element tensor, read on the device, or None = 1)."""
    tgt = torch.where(valid, attn_score.reshape(valid.shape).to(torch.float32), 0.0)
    p = torch.where(valid, index_score.reshape(valid.shape).to(torch.float32), 0.0)
    d_i = (p * tgt.sum(dim=-1, keepdim=True) - tgt) * (float(loss_coeff) / max(rows, 1) * float(sm_scale))
    if grad_loss is not None:
        d_i = d_i * grad_loss.to(torch.float32).reshape(())
    return d_i.contiguous()


def run(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale: float,
        loss_coeff: float, topk_indices_global: bool, deterministic: bool,
        config: IndexerBwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch(es) on validated inputs (see indexer_backward); returns (d_index_q, d_weights, d_index_k) in the
    inputs' dtypes."""
    reason = supported_reason(index_q, index_k)
    if reason:
        raise NotImplementedError(f"indexer_backward: {reason}")
    b, s_q, h, d = index_q.shape
    s_k, topk = index_k.shape[1], topk_indices.shape[-1]
    rows, n_k = b * s_q, b * s_k
    dev = index_q.device
    if rows == 0 or topk == 0 or s_k == 0:
        return (torch.zeros_like(index_q), torch.zeros_like(weights), torch.zeros_like(index_k))
    if rows > _INT32_MAX or n_k > _INT32_MAX:
        raise ValueError(f"indexer_backward: {rows} query rows / {n_k} key rows exceed the kernel's int32 limits")
    spec, kernel, n_ctas, cfg = _launch_plan(d, index_q.dtype, dev, deterministic, config)
    flat_ids = batch_flat_ids(topk_indices, s_k, topk_indices_global)
    valid = flat_ids >= 0
    d_i = score_grad(attn_score, index_score, valid, grad_loss, loss_coeff, rows, sm_scale)
    ordered = cfg.ordered(n_k, d, deterministic)
    ids = perm = flat_ids                        # perm is not read unless ordered
    if ordered:                                  # the kernel reads slot j's dI at perm[j]
        ids, perm = torch.empty_like(flat_ids), torch.empty_like(flat_ids)
        slot_windows(flat_ids, n_k, None, cfg.bucket_rows, ids_out=ids, perm_out=perm,
                     win_out=torch.empty((rows, 2), dtype=torch.int32, device=dev))
    q = padded_heads(index_q.reshape(rows, h, d), HEADS)
    w = padded_heads(weights.reshape(rows, h).to(torch.float32), HEADS)
    keys = gather_rows(index_k.reshape(n_k, d))
    dq = torch.empty((rows, HEADS, d), dtype=index_q.dtype, device=dev)
    dw = torch.empty((rows, HEADS), dtype=torch.float32, device=dev)
    dk = torch.zeros((n_k, d), dtype=torch.float32, device=dev)
    if not deterministic:
        kernel.launch(q, keys, ids, d_i, w, dq, dw, dk, rows, n_k, topk, keys.stride(0), perm, int(ordered), n_ctas)
    else:
        step = max(1, min(rows, cfg.chunk_bytes // (topk * d * 4)))
        buf = torch.empty((step, topk, d), dtype=torch.float32, device=dev)
        group = max(1, INDEX_SLOTS // (step * topk)) * step      # one reverse index per group of launches
        for g0 in range(0, rows, group):
            g1 = min(rows, g0 + group)
            scatter = RowScatter(ids[g0:g1], n_k)                  # invalid slots (-1) skipped
            for r0 in range(g0, g1, step):
                r1 = min(g1, r0 + step)
                kernel.launch(q[r0:r1], keys, ids[r0:r1], d_i[r0:r1], w[r0:r1], dq[r0:r1], dw[r0:r1], buf, r1 - r0,
                              n_k, topk, keys.stride(0), perm[r0:r1], 0, n_ctas)
                scatter.add(dk, buf[:r1 - r0].view(-1, d))
    d_q = dq[:, :h].reshape(b, s_q, h, d)
    d_w = dw[:, :h].reshape(b, s_q, h).to(weights.dtype)
    return d_q, d_w, dk.view(b, s_k, d).to(index_k.dtype)


@torch.library.custom_op("dsagen::indexer_backward_fused", mutates_args=())
def _fused_op(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
              index_score: torch.Tensor, topk_indices: torch.Tensor, grad_loss: torch.Tensor | None, sm_scale: float,
              loss_coeff: float, topk_indices_global: bool, deterministic: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward as a custom op (opaque to torch.compile; CUDA-graph capturable once the kernel is
    loaded)."""
    return run(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale, loss_coeff,
               topk_indices_global, deterministic)


@_fused_op.register_fake
def _(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale, loss_coeff,
      topk_indices_global, deterministic):
    return torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)


def indexer_backward(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, attn_score: torch.Tensor,
                     index_score: torch.Tensor, topk_indices: torch.Tensor, *, grad_loss: torch.Tensor | None = None,
                     sm_scale: float = 1.0, loss_coeff: float = 1.0, topk_indices_global: bool = False,
                     deterministic: bool = False, config: IndexerBwdConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused indexer backward on inputs that dsagen.ops.indexer_training validated: index_q `(B, S_q, H, D)`
    bf16/fp16 CUDA (H <= 64, D 64/128), weights `(B, S_q, H)` any float dtype, index_k `(B, S_k, D)` of index_q's
    dtype, attn_score / index_score `(B, S_q, topk)` FP32/FP64, topk_indices int32 `(B, S_q, topk)`, grad_loss a
    one-element tensor or None. config: None (the op's, through the custom op) or another IndexerBwdConfig (a direct
    launch, for benchmarks and tests). Returns (d_index_q, d_weights, d_index_k) in the inputs' dtypes. Raises
    NotImplementedError (with the reason) for inputs the kernel does not cover."""
    reason = supported_reason(index_q, index_k)
    if reason:
        raise NotImplementedError(f"indexer_backward: {reason}")
    args = (index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, float(sm_scale),
            float(loss_coeff), bool(topk_indices_global), bool(deterministic))
    return run(*args, config) if config is not None else _fused_op(*args)
