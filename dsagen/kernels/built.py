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

    @classmethod
    def of(cls, params: list[dict], k: Any, grid: str, cluster: int = 1) -> "BuiltKernel":
        """The built kernel of a kernel object `k` (its THREADS, Smem struct, kernel and host) launched on a 1-D grid
        of `grid` CTAs (an expression over scalar params) in clusters of `cluster` CTAs along x (1: none), dynamic
        smem k.Smem's size."""
        launch = {"grid": [grid, 1, 1], "block": [k.THREADS, 1, 1], "cluster": [cluster, 1, 1],
                  "smem": k.Smem.size_in_bytes()}
        return cls(params, launch, k.kernel, k.host)
