"""Host side of the deterministic row scatter-add: `scatter_add_rows(acc, rows, target)` adds row i of `rows` into
row target[i] of `acc`, each accumulator row's additions in increasing i, so the sum is bitwise the same run to run
(unlike index_add_'s FP32 atomics) and does not depend on how the rows were split into calls made in increasing
order. `reverse_index` is the grouping it launches the kernel with (torch: a stable sort and a search)."""

from __future__ import annotations

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .spec import MAX_WIDTH, RowScatterAddSpec

_kernels: dict[tuple[int, int], LoadedKernel] = {}


def _kernel(device: torch.device, width: int) -> LoadedKernel:
    """The scatter-add kernel for rows of `width` values on CUDA `device` (ValueError for another device type),
    memoized."""
    index = device_index(device)
    k = _kernels.get((index, width))
    if k is None:
        k = _kernels[(index, width)] = get_kernel(RowScatterAddSpec(arch=device_arch(index), width=width), index)
    return k


def reverse_index(target: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows grouped by target: `order` int32 (m,), the row numbers i sorted by target[i] (stable, so each
    group keeps increasing i), and `ptr` int32 (n + 1,), group r = order[ptr[r]:ptr[r + 1]]. target: (m,) integer;
    values outside [0, n) belong to no group (they sort after the last one). Deterministic, on target's device."""
    if n >= 2**31 - 1:
        raise ValueError(f"reverse_index: {n} accumulator rows; at most 2**31 - 2")
    t = target.reshape(-1)
    t = torch.where((t >= 0) & (t < n), t, n).to(torch.int32)     # 32-bit keys: half a 64-bit sort's radix passes
    keys, order = torch.sort(t, stable=True)
    ptr = torch.searchsorted(keys, torch.arange(n + 1, device=t.device, dtype=torch.int32), out_int32=True)
    return order.to(torch.int32), ptr


def scatter_add_rows(acc: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> None:
    """acc[target[i]] += rows[i] for every i with 0 <= target[i] < acc.shape[0], in place; rows with another target
    are skipped. Each accumulator row gets its rows added one at a time in increasing i, starting from its value in
    acc: bitwise deterministic, and several calls over consecutive slices of the rows give the same sum as one.

    acc: float32 (n, w) contiguous CUDA, 16-byte aligned; rows: float32 (m, w) contiguous on the same device,
    16-byte aligned, m < 2**31; target: integer (m,) (any shape of m elements) on that device; w a multiple of 4 up
    to 4096 (one RowScatterAddSpec kernel per w). Temporaries: the reverse index (about 24 bytes per row of `rows`,
    from torch's caching allocator)."""
    if acc.dim() != 2 or rows.dim() != 2 or acc.dtype != torch.float32 or rows.dtype != torch.float32:
        raise ValueError(f"scatter_add_rows: acc and rows must be 2-D float32 (got {acc.dtype} {tuple(acc.shape)} "
                         f"and {rows.dtype} {tuple(rows.shape)})")
    n, w = acc.shape
    m = rows.shape[0]
    if rows.shape[1] != w or w % 4 or not 4 <= w <= MAX_WIDTH:
        raise ValueError(f"scatter_add_rows: rows of {rows.shape[1]} and accumulator rows of {w} values; both must "
                         f"have the same width, a multiple of 4 in 4..{MAX_WIDTH}")
    if target.numel() != m or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"scatter_add_rows: target must hold one integer per row of rows ({m}), got "
                         f"{target.dtype} {tuple(target.shape)}")
    for name, t in (("rows", rows), ("target", target)):
        if t.device != acc.device:
            raise ValueError(f"scatter_add_rows: {name} is on {t.device}, acc on {acc.device}; they must be on one "
                             f"CUDA device")
    for name, t in (("acc", acc), ("rows", rows)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"scatter_add_rows: {name} must be contiguous and 16-byte aligned")
    if m >= 2**31:
        raise ValueError(f"scatter_add_rows: {m} rows; at most 2**31 - 1 per call (split the rows into calls)")
    if m == 0 or n == 0:
        return
    order, ptr = reverse_index(target, n)
    _kernel(acc.device, w).launch(acc, rows, order, ptr, n)
