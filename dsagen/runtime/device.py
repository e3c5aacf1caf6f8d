"""Which compile target a torch device needs, and torch's current stream as a raw handle."""

from __future__ import annotations

import functools

import torch

from ..spec.arch import arch_for_capability


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    return arch_for_capability(torch.cuda.get_device_capability(index)).name


def device_index(device: torch.device | int | str | None) -> int:
    """The CUDA device index of `device` (the current device when None or index-less)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def device_arch(device: torch.device | int | str | None = None) -> str:
    """The dsagen arch name (e.g. "sm_90a") whose cubins run on `device`; a description for CPU."""
    if device is not None and not isinstance(device, int) and torch.device(device).type != "cuda":
        return f"device {device}"
    return _arch_of_index(device_index(device))


@functools.lru_cache(maxsize=None)
def device_sm_count(index: int) -> int:
    """The number of SMs of CUDA device `index` (read once per device; persistent grids size themselves by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(index: int) -> int:
    """torch's current CUDA stream on device `index`, as an integer CUstream handle."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream  # pragma: no cover
