"""Public ops over top-k index tensors (cuDNN frontend DSA: compactify_wrapper, local_to_global_wrapper)."""

from __future__ import annotations

import torch

from ._fused import fused_impl
from ..reference import indices as ref
from ..validate import check_impl, check_int, check_tensor

_INT32_MAX = 2**31 - 1


def compactify(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None = None, *,
               impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid ids of each top-k row to its front, in their original order; -1 after them.

    Args:
        topk_idxs: int32, `(rows, K)` or `(B, S_q, K)`. An id is valid when it is >= 0 (any negative
            value is padding); ids keep their convention (local or global), nothing is range-checked.
        topk_length: optional integer tensor `(rows,)` or `(B, S_q)`: slots at or after
            `topk_length[row]` are ignored (treated as padding) even if they hold ids >= 0. Values are
            clamped to [0, K].
        impl: "fused" (generated CUDA kernel; the default) or "reference" (plain PyTorch, CPU or CUDA).

    Returns:
        `(compact_idxs, lengths)`: int32 `(rows, K)` with the valid ids first and -1 after them, and
        int32 `(rows,)` with the number of valid ids per row. A 3-D input is flattened to
        `rows = B * S_q`, as cuDNN frontend DSA specifies (reshape for BSHD consumers).

    Raises:
        TypeError: topk_idxs is not int32, or topk_length not an integer tensor.
        ValueError: wrong rank, mismatched shapes or devices, a fused call on CPU tensors, or a
            topk_idxs whose last dimension is not contiguous (fused).
    """
    check_impl(impl)
    check_tensor("topk_idxs", topk_idxs, dtypes=(torch.int32,), ndim=(2, 3))
    k = topk_idxs.shape[-1]
    idx2d = topk_idxs.reshape(-1, k) if topk_idxs.dim() == 3 else topk_idxs
    rows = idx2d.shape[0]
    length = None
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=(torch.int32, torch.int64), device=topk_idxs.device)
        if tuple(topk_length.shape) != tuple(topk_idxs.shape[:-1]):
            raise ValueError(f"topk_length must have shape {tuple(topk_idxs.shape[:-1])} (topk_idxs without "
                             f"its last dimension), got {tuple(topk_length.shape)}")
        length = topk_length.reshape(rows)
    if impl == "reference":
        return ref.compactify(idx2d, length)
    return fused_impl("compactify", topk_idxs.device)(idx2d, length)


def local_to_global(topk_idxs: torch.Tensor, seqlen_k: int, *, impl: str = "fused") -> torch.Tensor:
    """Per-batch local KV ids -> flat global ids `b * seqlen_k + local`.

    Args:
        topk_idxs: int32 `(B, S_q, K)` of ids local to batch b's KV sequence of length `seqlen_k`.
        seqlen_k: the (padded, per-batch) KV length S_k; `B * seqlen_k` must fit in int32.
        impl: "fused" (generated CUDA kernel; the default) or "reference".

    Returns:
        int32 `(B, S_q, K)`, contiguous: `b * seqlen_k + x` where `0 <= x < seqlen_k`, and -1 for -1
        padding and for every out-of-range id (negative or >= seqlen_k), so no id can alias a
        neighbouring batch.

    Raises:
        TypeError: topk_idxs not int32, seqlen_k not an int.
        ValueError: wrong rank, seqlen_k < 1, B * seqlen_k > 2**31 - 1, B > 65535 (fused), or a
            fused call on CPU tensors.
    """
    check_impl(impl)
    check_tensor("topk_idxs", topk_idxs, dtypes=(torch.int32,), ndim=3)
    check_int("seqlen_k", seqlen_k, minimum=1)
    if topk_idxs.shape[0] * seqlen_k > _INT32_MAX:
        raise ValueError(f"seqlen_k={seqlen_k} with batch {topk_idxs.shape[0]}: global ids "
                         f"b * seqlen_k + x must fit in int32 (B * seqlen_k <= {_INT32_MAX})")
    if impl == "reference":
        return ref.local_to_global(topk_idxs, seqlen_k)
    return fused_impl("local_to_global", topk_idxs.device)(topk_idxs, seqlen_k)


__all__ = ["compactify", "local_to_global"]
