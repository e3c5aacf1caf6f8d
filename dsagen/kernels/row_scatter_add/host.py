"""Host side of the deterministic row scatter-add: `scatter_add_rows(acc, rows, target)` adds row i of `rows` into
row target[i] of `acc`, each accumulator row's additions in increasing i, so the sum is bitwise the same run to run
(unlike index_add_'s FP32 atomics) and does not depend on how the rows were split into calls made in increasing
order. `RowScatter` does the same for a series of rows that arrive in slices, with one reverse index for the whole
series; `reverse_index` is that grouping (torch: a stable sort and a search)."""

from __future__ import annotations

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .spec import MAX_WIDTH, RowScatterAddSpec

_kernels: dict[tuple[int, int], LoadedKernel] = {}

# The most series rows the backward ops give one RowScatter (one reverse index): about 400 MB of temporaries while
# it is built (24 bytes a row), 16.7M rows = the deterministic sparse MLA backward at T 4096 / H 128 / top-k 2048.
INDEX_SLOTS = 1 << 24


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


class RowScatter:
    """A series of rows to be added into an accumulator by target, delivered in consecutive slices: built once from
    the whole series' targets (one reverse index), then `add(acc, rows)` adds the next slice. Each accumulator row
    gets its rows added one at a time in increasing series order, starting from its value in acc, so the sum is
    bitwise deterministic and the same for any slicing, without sorting each slice's targets again.

    target: integer (M,) (any shape of M elements) on a CUDA device, M < 2**31; values outside [0, n) are skipped.
    n: the accumulator's rows. Temporaries: the reverse index and a cursor per accumulator row (about 24 bytes per
    series row while it is built, 8 after, from torch's caching allocator)."""

    def __init__(self, target: torch.Tensor, n: int):
        if target.dtype.is_floating_point or target.dtype == torch.bool:
            raise ValueError(f"RowScatter: target must be an integer tensor, got {target.dtype}")
        self.m, self.n, self.device = target.numel(), int(n), target.device
        if self.m >= 2**31:
            raise ValueError(f"RowScatter: {self.m} rows; at most 2**31 - 1 per series (split the rows)")
        self.next_row = 0
        self.order = self.ptr = self.cursor = None
        if self.m and self.n:
            self.order, self.ptr = reverse_index(target, self.n)
            self.cursor = self.ptr[:-1].clone()

    def add(self, acc: torch.Tensor, rows: torch.Tensor) -> None:
        """acc[target[i]] += rows[i - start] for the series rows i of this slice (start: the rows added before it),
        in place. acc: float32 (n, w) contiguous, 16-byte aligned, on the target's device; rows: float32 (k, w)
        contiguous, 16-byte aligned, on that device, k at most the rows left; w a multiple of 4 up to 4096 (one
        RowScatterAddSpec kernel per w)."""
        _check_rows(acc, rows, self.n, self.device)
        k = rows.shape[0]
        if self.next_row + k > self.m:
            raise ValueError(f"RowScatter.add: {k} rows after {self.next_row} of a series of {self.m}")
        row0, self.next_row = self.next_row, self.next_row + k
        if k and self.n:
            _kernel(acc.device, acc.shape[1]).launch(acc, rows, self.order, self.ptr, self.cursor, row0,
                                                     self.next_row, self.n)


def _check_rows(acc: torch.Tensor, rows: torch.Tensor, n: int, device: torch.device) -> None:
    """ValueError unless acc is a float32 (n, w) and rows a float32 (k, w) CUDA matrix on `device`, both contiguous
    and 16-byte aligned, with w a multiple of 4 in 4..MAX_WIDTH."""
    if acc.dim() != 2 or rows.dim() != 2 or acc.dtype != torch.float32 or rows.dtype != torch.float32:
        raise ValueError(f"scatter_add_rows: acc and rows must be 2-D float32 (got {acc.dtype} {tuple(acc.shape)} "
                         f"and {rows.dtype} {tuple(rows.shape)})")
    w = acc.shape[1]
    if acc.shape[0] != n:
        raise ValueError(f"scatter_add_rows: acc has {acc.shape[0]} rows, the targets index {n}")
    if rows.shape[1] != w or w % 4 or not 4 <= w <= MAX_WIDTH:
        raise ValueError(f"scatter_add_rows: rows of {rows.shape[1]} and accumulator rows of {w} values; both must "
                         f"have the same width, a multiple of 4 in 4..{MAX_WIDTH}")
    for name, t in (("acc", acc), ("rows", rows)):
        if t.device != device:
            raise ValueError(f"scatter_add_rows: {name} is on {t.device}, the targets on {device}; they must be on "
                             f"one CUDA device")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"scatter_add_rows: {name} must be contiguous and 16-byte aligned")


def scatter_add_rows(acc: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> None:
    """acc[target[i]] += rows[i] for every i with 0 <= target[i] < acc.shape[0], in place; rows with another target
    are skipped. Each accumulator row gets its rows added one at a time in increasing i, starting from its value in
    acc: bitwise deterministic, and several calls over consecutive slices of the rows give the same sum as one (a
    series sliced into many calls is cheaper as one RowScatter: one reverse index for all of them).

    acc: float32 (n, w) contiguous CUDA, 16-byte aligned; rows: float32 (m, w) contiguous on the same device,
    16-byte aligned, m < 2**31; target: integer (m,) (any shape of m elements) on that device; w a multiple of 4 up
    to 4096 (one RowScatterAddSpec kernel per w). Temporaries: the reverse index (about 24 bytes per row of `rows`,
    from torch's caching allocator)."""
    _check_rows(acc, rows, acc.shape[0] if acc.dim() == 2 else -1, acc.device)
    m = rows.shape[0]
    if target.numel() != m or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"scatter_add_rows: target must hold one integer per row of rows ({m}), got "
                         f"{target.dtype} {tuple(target.shape)}")
    if target.device != acc.device:
        raise ValueError(f"scatter_add_rows: target is on {target.device}, acc on {acc.device}; they must be on one "
                         f"CUDA device")
    RowScatter(target, acc.shape[0]).add(acc, rows)
