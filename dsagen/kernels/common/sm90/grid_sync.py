"""A bounded grid barrier for persistent kernels whose CTAs should walk their items in step (for the L2 cache,
never for correctness)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from dsagen.kernels.common.sm90.ptx import ld_acquire_s32, nanosleep, red_release_add_s32

GRID_BARRIER_SPINS = 4096          # a grid barrier's bound: 4096 sleeps of ~256 ns (~1 ms)


@cute.jit
def grid_barrier(counter: cute.Pointer, tidx, it, n_items, nctas, bar_id: int, threads: int) -> None:
    """Hold the `threads` threads of named barrier `bar_id` (the calling warpgroup; thread `tidx` 0 of the CTA
    counts) at the start of the CTA's item `it` until every CTA got there: round it of a persistent loop over
    `n_items` items, min((it + 1) * nctas, n_items) arrivals on the zeroed int32 `counter` in all. It only orders
    work for the cache (the CTAs then walk the same KV windows together), never for correctness, so the wait is
    bounded: after GRID_BARRIER_SPINS sleeps the CTA goes on, which keeps a grid that is not all resident at once
    (another kernel on some SMs, an MPS or green-context SM limit) from waiting forever."""
    if tidx == 0:
        red_release_add_s32(counter, Int32(1))
        target = cutlass.min((it + 1) * nctas, n_items)
        spins = Int32(0)
        while ld_acquire_s32(counter) < target and spins < GRID_BARRIER_SPINS:
            nanosleep(256)
            spins += 1
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
