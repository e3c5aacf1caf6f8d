"""The CUDA driver API through cuda.bindings, with errors turned into exceptions."""

from __future__ import annotations

import functools

from ..errors import DsagenError


#: the oldest driver API version (cuDriverGetVersion) that loads dsagen's cubins: CuTe-DSL emits them with a
#: CUDA 13 toolkit, and a driver loads no cubin newer than itself (CUDA 13.0 = NVIDIA driver 580)
MIN_DRIVER_VERSION = 13000
MIN_DRIVER_RELEASE = 580


class CudaDriverError(DsagenError, RuntimeError):
    """A CUDA driver call failed, or the driver is too old; the message names the call and the driver's error
    name, or the version found and the one needed."""


@functools.lru_cache(maxsize=1)
def cu():
    """The cuda.bindings.driver module (imported on first use, so `import dsagen.runtime` stays cheap)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("dsagen's runtime needs cuda-bindings (pip install cuda-bindings)") from e
    return driver


def check(result, what: str):
    """Unwrap a cuda.bindings result tuple `(CUresult, *values)`; raise CudaDriverError on failure."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        d = cu()
        name = d.cuGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise CudaDriverError(f"{what} failed: {name} ({int(err)})")
    if isinstance(result, tuple):
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]
    return None


def version_text(version: int) -> str:
    """A cuDriverGetVersion number as CUDA writes it: 12040 -> "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_version() -> int:
    """The CUDA version the installed driver supports (cuDriverGetVersion, e.g. 13000 for CUDA 13.0)."""
    return int(check(cu().cuDriverGetVersion(), "cuDriverGetVersion"))


def require_driver(minimum: int = MIN_DRIVER_VERSION) -> int:
    """The driver's version, checked to be at least `minimum`; CudaDriverError naming both otherwise.

    Called before a cubin is loaded: an older driver would refuse it with CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    or a bare "invalid image", which does not say that the driver is what needs upgrading."""
    found = driver_version()
    if found < minimum:
        raise CudaDriverError(
            f"the CUDA driver supports CUDA {version_text(found)} (cuDriverGetVersion {found}), but dsagen's "
            f"cubins need CUDA {version_text(minimum)} or newer (cuDriverGetVersion >= {minimum}, NVIDIA "
            f"driver >= {MIN_DRIVER_RELEASE}): upgrade the NVIDIA driver")
    return found
