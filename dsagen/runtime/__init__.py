"""The cubin runtime: loads generated kernels and launches them with torch tensors.

It imports only torch, cuda.bindings, the standard library and two leaf modules (dsagen.kernel_record,
the arch table dsagen.spec.arch), never CuTe-DSL, the compiler layer, the store or the ops: it is handed
a kernel record and cubin bytes (dsagen.jit.get_kernel resolves a spec to them) and loads them.

    k = LoadedKernel(name, entry.manifest["kernel"], entry.read("kernel.cubin"), arch, device_index, device_arch)
    k.launch(idx, length, out, out_length, n_rows, width, ld, has_length)
"""

from __future__ import annotations

from .device import current_stream_handle, device_arch, device_index, device_sm_count
from .driver import MIN_DRIVER_VERSION, CudaDriverError, driver_version, require_driver
from .kernel import KernelArchMismatch, LoadedKernel

__all__ = ["LoadedKernel", "KernelArchMismatch", "CudaDriverError", "MIN_DRIVER_VERSION", "driver_version",
           "require_driver", "device_arch", "device_index", "device_sm_count",
           "current_stream_handle"]
