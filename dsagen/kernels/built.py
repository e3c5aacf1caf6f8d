"""What a kernel module's `build(...)` factory returns: the four names a rendered kernel module binds (`PARAMS,
LAUNCH, kernel, host = build(...)`; dsagen/jit/build.py checks them). One type for every family's kernels."""

from typing import Any, NamedTuple


class BuiltKernel(NamedTuple):
    """A built kernel, in the rendered module's order: `params` (PARAMS, the flat ABI), `launch` (LAUNCH: grid
    expressions over scalar params, block, cluster, dynamic smem bytes), `kernel` (the @cute.kernel) and `host` (the
    @cute.jit launch entry compiled with fake arguments)."""

    params: list[dict]
    launch: dict
    kernel: Any
    host: Any
