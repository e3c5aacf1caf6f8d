"""Online-softmax steps in the log2 domain: the masked row max and the exp2 / rescale step of an attention row
held in a wgmma accumulator view (layout.acc_mn_view: a thread owns rows r, the 4 lanes of a quad share a row),
and the merge of two partial (max, sum) statistics. Called by the consumer warpgroup's threads (the row helpers
shuffle within quads, so all 4 lanes of a quad take part).
"""

import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from dsagen.kernels.common.sm90.reduce import tree_reduce


@cute.jit
def masked_row_max(sMN: cute.Tensor, r: int, nc: int, keep: cute.Tensor, scale_log2: Float32) -> Float32:
    """Scale row r's nc scores by scale_log2 in place (-inf where keep[c] is False) and return the row max over
    the quad."""
    for c in cutlass.range_constexpr(nc):
        v = sMN[r, c] * scale_log2
        if not keep[c]:
            v = -Float32.inf
        sMN[r, c] = v
    ml = tree_reduce(cute.arch.fmax, [sMN[r, c] for c in range(nc)])
    ml = cute.arch.fmax(ml, cute.arch.shuffle_sync_bfly(ml, offset=1))
    ml = cute.arch.fmax(ml, cute.arch.shuffle_sync_bfly(ml, offset=2))
    return ml


@cute.jit
def exp_and_rescale(sMN: cute.Tensor, oMN: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, r: int, nc: int,
                    m: Float32) -> None:
    """Move row r to the running max m: P = exp2(S - m) in place, row_sum = row_sum * exp2(old max - m) + the
    thread's sum of P, O row r *= exp2(old max - m), row_max[r] = m."""
    corr = cute.math.exp2(row_max[r] - m, fastmath=True)
    row_max[r] = m
    for c in cutlass.range_constexpr(nc):
        sMN[r, c] = cute.math.exp2(sMN[r, c] - m, fastmath=True)
    row_sum[r] = row_sum[r] * corr + tree_reduce(operator.add, [sMN[r, c] for c in range(nc)])
    for c in cutlass.range_constexpr(cute.size(oMN, mode=[1])):
        oMN[r, c] = oMN[r, c] * corr


@cute.jit
def merge_softmax_stats(m1, s1, m2, s2):
    """(max, sum) of two partial softmax statistics (m, s = sum of exp2(x - m)); (-inf, 0) for two empty ones."""
    m = cute.arch.fmax(m1, m2)
    m_sub = m if m > Float32(-math.inf) else Float32(0.0)
    s = s1 * cute.math.exp2(m1 - m_sub, fastmath=True) + s2 * cute.math.exp2(m2 - m_sub, fastmath=True)
    return m, s


@cute.jit
def softmax_step_row(sMN: cute.Tensor, r: int, nc: int, row_max: cute.Tensor, row_sum: cute.Tensor,
                     corr: cute.Tensor) -> None:
    """Row r's masked scores (log2 domain, -inf where masked; the caller scaled and masked them in place) turned
    into P in place, O's rescale deferred: the running max moves to the new row max (over the quad) and corr[r] =
    exp2(old max - new max) is what O must still be scaled by (rescale_rows, once the PV that reads O retired);
    P = exp2(S - max), row_sum = row_sum * corr + the thread's sum of P."""
    ml = tree_reduce(cute.arch.fmax, [sMN[r, c] for c in range(nc)])
    ml = cute.arch.fmax(ml, cute.arch.shuffle_sync_bfly(ml, offset=1))
    ml = cute.arch.fmax(ml, cute.arch.shuffle_sync_bfly(ml, offset=2))
    m = cute.arch.fmax(row_max[r], ml)
    corr[r] = cute.math.exp2(row_max[r] - m, fastmath=True)
    row_max[r] = m
    for c in cutlass.range_constexpr(nc):
        sMN[r, c] = cute.math.exp2(sMN[r, c] - m, fastmath=True)
    row_sum[r] = row_sum[r] * corr[r] + tree_reduce(operator.add, [sMN[r, c] for c in range(nc)])


@cute.jit
def rescale_rows(oMN: cute.Tensor, corr: cute.Tensor) -> None:
    """O row r *= corr[r] for every row of an accumulator view (softmax_step_row's deferred rescale)."""
    for r in cutlass.range_constexpr(cute.size(oMN, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(oMN, mode=[1])):
            oMN[r, c] = oMN[r, c] * corr[r]
