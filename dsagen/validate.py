"""Input validation shared by every public op. Each check raises TypeError (wrong type or dtype) or
ValueError (wrong shape, device, layout or value) with a message that names the argument and the rule."""

from __future__ import annotations

import math
import os
from typing import Iterable, Sequence

import torch

IMPLS = ("reference", "fused")


def check_impl(impl: str) -> str:
    """`impl` must be "reference" or "fused"."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {', '.join(repr(i) for i in IMPLS)}")
    return impl


def check_tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None,
                 ndim: int | Sequence[int] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """`t` must be a dense torch.Tensor with one of `dtypes`, `ndim` dimensions and on `device` (when given).

    Every tensor argument of every public op passes through here first, so the layout is checked here once:
    a sparse tensor (COO, CSR, CSC, BSR, BSC) has no strides, and the ops' indexing would otherwise fail deep
    in torch with a message that names no argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, "
                             f"got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (like the other inputs), got {t.device}")
    return t


def check_cuda(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` must live on a CUDA device (fused kernels only run there)."""
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor for impl='fused', got device {t.device}")
    return t


def check_contiguous(name: str, t: torch.Tensor, *, last_dim_only: bool = False) -> torch.Tensor:
    """`t` must be contiguous (or, with last_dim_only, have stride 1 in its last dimension)."""
    if last_dim_only:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    return t


def check_int(name: str, v, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`v` must be a Python int (not bool) within [minimum, maximum]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {v}")
    return v


# --- appended: generic scalar / shape / option checks ---------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_bool(name: str, v) -> bool:
    """`v` must be a Python bool."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def check_float(name: str, v, *, positive: bool = False) -> float:
    """`v` must be a finite real Python number (int or float, not bool); with positive, > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {v}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return v


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], what: str = "") -> torch.Tensor:
    """`t` must have exactly `shape`; `what` names the dimensions in the message, e.g. "[B, T, H]"."""
    if tuple(t.shape) != tuple(shape):
        dims = f" {what}" if what else ""
        raise ValueError(f"{name} must have shape{dims} = {tuple(shape)}, got {tuple(t.shape)}")
    return t


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """`t` must have the dtype of `ref`."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {t.dtype}")
    return t


def check_reference_options(name: str, options) -> None:
    """impl='reference' takes no kernel options: `options` must be None."""
    if options is not None:
        raise ValueError(f"{name} is only accepted for impl='fused'; impl='reference' takes no {name}, "
                         f"got {options!r}")


# --- appended: packed (THD) sequence offsets -------------------------------------------------------

OFFSET_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens(name: str, t, *, total: int, total_name: str, device: torch.device) -> None:
    """`t` must be 1-D int32/int64 offsets on `device` with B + 1 >= 1 entries: t[0] == 0,
    non-decreasing, t[-1] <= `total` (the packed tensor's row count, called `total_name`).

    The values are read on the host (one device-to-host copy; not CUDA-graph capturable)."""
    check_tensor(name, t, dtypes=OFFSET_DTYPES, ndim=1, device=device)
    if t.numel() == 0:
        raise ValueError(f"{name} must have B + 1 >= 1 entries (offsets starting at 0), got none")
    v = t.tolist()
    if v[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {v[0]}")
    for i in range(1, len(v)):
        if v[i] < v[i - 1]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i - 1}] = {v[i - 1]} > "
                             f"{name}[{i}] = {v[i]}")
    if v[-1] > total:
        raise ValueError(f"{name} must end at or before {total_name} = {total}, got {name}[-1] = {v[-1]}")


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, *, total_q: int, total_k: int,
                          device: torch.device) -> int:
    """Packed query / key offsets, passed together, each valid for its packed tensor (check_cu_seqlens)
    and with the same number of segments. Returns the segment count B."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be passed together (THD layout); {missing} is missing")
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=total_q, total_name="total_q", device=device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=total_k, total_name="total_k", device=device)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_seqlens_q.numel()}: "
                         f"one segment count B for q and k), got {cu_seqlens_k.numel()}")
    return cu_seqlens_q.numel() - 1


# --- appended: top-k widths whose outputs must be allocatable ---------------------------------------

MAX_TOPK = 2**31 - 1
"""The widest top-k row: ids and widths are int32 in every output and kernel argument."""

_device_memory: dict[tuple[str, int | None], int | None] = {}


def device_memory_bytes(device: torch.device) -> int | None:
    """The total memory of `device` in bytes (CPU: the machine's physical memory; CUDA: the device's),
    or None where it is not known (other device types). Cached per device; no synchronization."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index)
    if key not in _device_memory:
        total = None
        if device.type == "cpu":
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
                total = None
        elif device.type == "cuda":
            total = torch.cuda.get_device_properties(index).total_memory
        _device_memory[key] = total
    return _device_memory[key]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_topk(name: str, v, rows: Sequence[int], slot_bytes: int, device: torch.device, *,
               what: str = "") -> int:
    """`v`, a top-k width, must be an int in [0, MAX_TOPK] whose outputs can be allocated on `device`.

    rows: the outputs' leading shape (each output is `[*rows, v]`); slot_bytes: the bytes one slot takes
    over every output (4 for one int32 id; 4 + 4 with fp32 values, ...); what: the outputs, for the
    message. ValueError naming `name`, the width and the size when v > MAX_TOPK or the outputs need
    more bytes than the device has in all (checked before anything is allocated, so the caller gets
    this message, not an allocator's). Symbolic sizes (torch.compile) skip the byte check.
    """
    check_int(name, v, minimum=0)
    if v > MAX_TOPK:
        raise ValueError(f"{name} must be <= 2**31 - 1 = {MAX_TOPK} (ids and widths are int32), got {v}")
    if v == 0 or not all(type(r) is int for r in rows):
        return v
    need = math.prod(rows) * v * slot_bytes
    have = device_memory_bytes(device)
    if have is not None and need > have:
        shape = "[" + ", ".join(map(str, (*rows, v))) + "]"
        outputs = f" ({what})" if what else ""
        raise ValueError(f"{name}={v} needs outputs of shape {shape}{outputs} taking {_bytes(need)} "
                         f"({need} bytes), more than the {_bytes(have)} of memory on {torch.device(device)}")
    return v
