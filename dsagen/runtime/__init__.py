"""The cubin runtime: loads generated kernels and launches them with torch tensors.

Its own modules import only torch, cuda.bindings and the standard library, never CuTe-DSL. `get_kernel`
asks dsagen.cache for the entry (which compiles on a miss only where CuTe-DSL is installed and JIT is
allowed) and loads each kernel once per (entry, device).

    from dsagen.runtime import get_kernel
    k = get_kernel(CompactifySpec(arch="sm_90a"), device=idx.device)
    k.launch(idx, length, out, out_length, n_rows, width, ld, has_length)
"""

from __future__ import annotations

import threading

import torch

from .device import current_stream_handle, device_arch, device_index, device_sm_count
from .driver import CudaDriverError
from .kernel import KernelArchMismatch, LoadedKernel

_loaded: dict[tuple, LoadedKernel] = {}
_load_lock = threading.Lock()


def get_kernel(spec, device: torch.device | int | str | None = None) -> LoadedKernel:
    """The kernel of `spec` loaded on `device` (default: the current CUDA device); memoized.

    Raises dsagen.cache.KernelNotCached when the kernel is not cached and cannot be compiled here,
    KernelArchMismatch when spec.arch does not run on the device, CudaDriverError on driver failures.
    Loading while a CUDA graph is being captured is refused: warm up (call once) before capturing.
    """
    index = device_index(device)
    memo = (spec, index)
    k = _loaded.get(memo)
    if k is not None:
        return k
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"dsagen: kernel {spec.name()} is first needed inside CUDA-graph capture; "
                           f"loading or compiling cannot be captured. Run the op once before capturing.")
    from ..cache import resolve  # the cache layer (jinja2, filelock); not imported by the runtime itself

    with _load_lock:
        k = _loaded.get(memo)
        if k is None:
            entry = resolve(spec)
            k = LoadedKernel(entry.manifest.get("name", spec.name()), entry.manifest["kernel"],
                             entry.read("kernel.cubin"), entry.manifest["arch"], index, device_arch(index))
            _loaded[memo] = k
    return k


def loaded_kernels() -> list[LoadedKernel]:
    """Every kernel loaded in this process."""
    return list(_loaded.values())


__all__ = ["get_kernel", "loaded_kernels", "LoadedKernel", "KernelArchMismatch", "CudaDriverError",
           "device_arch", "device_index", "device_sm_count", "current_stream_handle"]
