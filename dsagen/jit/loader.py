"""From a spec to a loaded kernel: resolve its cache entry (compiling on a miss where allowed) and hand the
entry's checked cubin and kernel record to the runtime. Memoized per (spec, device).

    k = get_kernel(CompactifySpec(arch="sm_90a"), device=idx.device)
    k.launch(idx, length, out, out_length, n_rows, width, ld, has_length)
"""

from __future__ import annotations

import threading

import torch

from ..log import get_logger
from ..runtime import LoadedKernel, device_arch, device_index
from .resolver import resolve

_log = get_logger("jit")

_loaded: dict[tuple, LoadedKernel] = {}
_load_lock = threading.Lock()


def get_kernel(spec, device: torch.device | int | str | None = None) -> LoadedKernel:
    """The kernel of `spec` loaded on `device` (default: the current CUDA device); memoized.

    Raises KernelNotCached when the kernel is not cached and cannot be compiled here,
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
    with _load_lock:
        k = _loaded.get(memo)
        if k is None:
            entry = resolve(spec)
            k = LoadedKernel(entry.manifest.get("name", spec.name()), entry.manifest["kernel"],
                             entry.read("kernel.cubin"), entry.manifest["arch"], index, device_arch(index))
            _loaded[memo] = k
            _log.info("loaded kernel %s on cuda:%d from %s", k.name, index, entry.where())
    return k


def loaded_kernels() -> list[LoadedKernel]:
    """Every kernel loaded in this process."""
    return list(_loaded.values())
