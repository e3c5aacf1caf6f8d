"""Online-softmax row steps on a wgmma m64nN accumulator viewed as (rows, cols) (attn_sm90.acc_mn_view), in the
log2 domain. A thread owns rows r of the view; the 4 lanes of a quad share a row, so a row reduction is the
thread's columns then two butterfly shuffles (offsets 1, 2). Called while tracing a kernel (inlined)."""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from dsagen.kernels.sparse_mla.attn_sm90 import tree_reduce


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
