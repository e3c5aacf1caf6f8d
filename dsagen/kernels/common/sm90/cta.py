"""The CTA of a warp-specialized persistent Hopper kernel: its coordinates, the one-time mbarrier set-up, and the
convention of the persistent item loop.

Persistent items. The host launches min(n_items, n_ctas) CTAs (n_ctas: what fits the SMs at the kernel's
occupancy); CTA b runs items b, b + nctas, b + 2 nctas, ... (a static round-robin: every item costs about the same,
so no work queue is needed). Every role of the CTA walks the same items in the same order with the loop

    gt = Int32(0)                      # tiles of the CTA's earlier items: the rings' phases
    it = Int32(0)                      # the CTA's earlier items: the per-item buffers' phases
    for item in cutlass.range(c.bidx, n_items, c.nctas, unroll=1):
        ...                            # tile g = gt + j of the item's ntiles
        gt += ntiles
        it += 1

so that the roles agree on every barrier phase without talking to each other; item `it` of a CTA runs in grid
round `it` (grid_sync.grid_barrier). `row_head_block` maps an item of the attention kernels, a (query row, block
of heads) pair, to its coordinates.
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr


class CtaCoords(NamedTuple):
    """Where the calling thread is: its index, its CTA, its warp (warp-uniform) and warpgroup, the grid's CTAs."""
    tidx: Any
    bidx: Any
    warp: Any
    wg: Any
    nctas: Any


def cta_coords() -> CtaCoords:
    """The calling thread's CtaCoords (1-D block and grid)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    nctas, _, _ = cute.arch.grid_dim()
    return CtaCoords(tidx=tidx, bidx=bidx, warp=warp, wg=warp // 4, nctas=nctas)


@cute.jit
def init_mbarriers(warp, counts, cluster: bool = False) -> None:
    """Initialise mbarriers once per CTA, then make them visible to every thread and to the async proxy: one
    elected thread of warp 0 sets counts[i] = (mbarrier pointer, expected arrivals) in order, and every thread of
    the CTA then passes the pipeline init fence and barrier (cluster: the cluster's barrier, so that every CTA's
    mbarriers are initialised before any CTA of the cluster signals one of another). Called by all threads, before
    any role starts."""
    if warp == 0:
        with cute.arch.elect_one():
            for i in cutlass.range_constexpr(len(counts)):
                cute.arch.mbarrier_init(counts[i][0], counts[i][1])
    if const_expr(cluster):
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    else:
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()


def row_head_block(item, head_blocks: int, block_heads: int):
    """The (query row, first head) of persistent item `item` when items are (row, head block) pairs, the head
    blocks of a row consecutive: `head_blocks` blocks of `block_heads` heads per row."""
    return item // head_blocks, (item % head_blocks) * block_heads
