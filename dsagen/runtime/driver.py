"""The CUDA driver API through cuda.bindings, with errors turned into exceptions."""

from __future__ import annotations

import functools

from ..errors import DsagenError


class CudaDriverError(DsagenError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error name."""


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
