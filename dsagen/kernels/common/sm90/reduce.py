"""Register and warp reductions of the Hopper kernels: a balanced tree over values a thread holds, sums over the
lanes that share an accumulator row (a quad) or column (the 8 row groups of a warp), a warp's all-reduce of a pair of
statistics, and a warp's inclusive scan.

The shuffle helpers are called by every lane of the warp (they are `shfl.sync` with a full mask).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def tree_reduce(op, vals):
    """`op` over `vals` (a non-empty list, unrolled at trace time) as a balanced tree: depth ceil(log2(len))
    instead of a len - 1 long dependency chain (row maxima / sums of a softmax)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def warp_allreduce_pair(a, b, merge):
    """(a, b) combined over the 32 lanes of a warp by butterfly shuffles, `merge(a1, b1, a2, b2) -> (a, b)` at each
    of the 5 steps (unrolled at trace time), in every lane: a softmax's partial (max, sum) statistics. `merge` must be
    commutative and associative (every lane then holds the same result)."""
    for sh in range(5):
        a2 = cute.arch.shuffle_sync_bfly(a, offset=1 << sh)
        b2 = cute.arch.shuffle_sync_bfly(b, offset=1 << sh)
        a, b = merge(a, b, a2, b2)
    return a, b


@cute.jit
def quad_sum(v):
    """The sum of `v` over the 4 lanes of a quad (lanes 4 m .. 4 m + 3: one accumulator row), in every lane."""
    v += cute.arch.shuffle_sync_bfly(v, offset=1)
    v += cute.arch.shuffle_sync_bfly(v, offset=2)
    return v


@cute.jit
def row_group_sum(v):
    """The sum of `v` over the 8 row groups of a warp (lanes l, l ^ 4, ..., l ^ 28: one accumulator column's 8
    rows of the warp's 16), in every lane."""
    v += cute.arch.shuffle_sync_bfly(v, offset=4)
    v += cute.arch.shuffle_sync_bfly(v, offset=8)
    v += cute.arch.shuffle_sync_bfly(v, offset=16)
    return v


@cute.jit
def warp_inclusive_scan(v: Int32, lane: Int32) -> Int32:
    """The inclusive prefix sum of `v` over lanes 0..lane of the warp."""
    for d in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(v, offset=1 << d)
        if lane >= (1 << d):
            v = v + o
    return v
