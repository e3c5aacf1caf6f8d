"""Fused (generated-kernel) compactify and local_to_global. Called by dsagen.ops.indices after the
generic validation; these add the layout checks the kernels rely on. Also `batch_flat_ids`, the top-k ids of a
batch as ids into the flattened keys, which the sparse indexer kernels' host code shares."""

from __future__ import annotations

import torch

from ...validate import check_contiguous
from ...runtime import LoadedKernel, device_arch
from ...jit import get_kernel
from ...spec import CompactifySpec, LocalToGlobalSpec

_MAX_GRID_Y = 65535
_kernels: dict[tuple[str, int], LoadedKernel] = {}


def _kernel(op: str, index: int) -> LoadedKernel:
    """The op's kernel on CUDA device `index`, memoized: the per-call path is one dict hit."""
    k = _kernels.get((op, index))
    if k is None:
        spec_type = CompactifySpec if op == "compactify" else LocalToGlobalSpec
        k = _kernels[(op, index)] = get_kernel(spec_type(arch=device_arch(index)), index)
    return k


def compactify(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idxs: int32 (rows, K) CUDA, last dim contiguous; topk_length: (rows,) or None."""
    check_contiguous("topk_idxs", topk_idxs, last_dim_only=True)
    rows, k = topk_idxs.shape
    out = torch.empty_like(topk_idxs, memory_format=torch.contiguous_format)  # (cheaper than empty(shape))
    lengths = topk_idxs.new_empty((rows,))
    if rows == 0:
        return out, lengths
    has_length = topk_length is not None
    if has_length:
        topk_length = topk_length.to(torch.int32).contiguous()
    kernel = _kernel("compactify", topk_idxs.get_device())
    ld = topk_idxs.stride(0) if k > 0 else 0
    kernel.launch(topk_idxs, topk_length if has_length else lengths, out, lengths, rows, k, ld, int(has_length))
    return out, lengths


def local_to_global(topk_idxs: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """topk_idxs: int32 (B, S_q, K) CUDA; returns int32 (B, S_q, K) contiguous."""
    b = topk_idxs.shape[0]
    if b > _MAX_GRID_Y:
        raise ValueError(f"topk_idxs has batch {b}; the fused local_to_global supports at most "
                         f"{_MAX_GRID_Y} batches (use impl='reference' or split the batch)")
    src = topk_idxs.contiguous()
    out = torch.empty_like(src)
    per_batch = src.shape[1] * src.shape[2]
    if src.numel() == 0:
        return out
    kernel = _kernel("local_to_global", src.get_device())
    kernel.launch(src, out, per_batch, b, seqlen_k)
    return out


def batch_flat_ids(topk_indices: torch.Tensor, s_k: int, topk_indices_global: bool) -> torch.Tensor:
    """(B * S_q, topk) int32 ids into the flattened (B * S_k) keys of `topk_indices` (B, S_q, topk): each id
    range-checked against its own batch's rows (local ids, or global ids b * S_k + local), -1 where invalid, so no id
    aliases another batch (cuDNN frontend DSA §6 / §9)."""
    b, s_q, topk = topk_indices.shape
    rows = b * s_q
    ids = topk_indices.reshape(rows, topk)
    base = torch.arange(b, device=ids.device, dtype=torch.int32).repeat_interleave(s_q).view(rows, 1) * s_k
    local = ids - base if topk_indices_global else ids
    return torch.where((local >= 0) & (local < s_k), local + base, -1).to(torch.int32).contiguous()
