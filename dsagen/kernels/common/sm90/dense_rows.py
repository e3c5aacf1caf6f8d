"""Rows of a dense, ratio-causal score matrix (sm_90a device code): the column limit of a query row
(`causal_count`: cuDNN frontend DSA's ratio-causal mask with per-segment offsets, in 32-bit arithmetic; `row_limit`
for a flat BSHD row) and the masked tail of a row (`fill_tail`: -inf past the visible columns, 16-byte streaming
stores). Used by the dense indexer scores (lightning_indexer), the dense attention score recompute
(attn_score_recompute) and the dense indexer backward (indexer_bwd).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from dsagen.kernels.common.sm90.ptx import st_global_v4_f32


@cute.jit
def causal_count(p_off: cute.Pointer, has_off: Int32, seg: Int32, pos: Int32, count: Int32, ratio: Int32) -> Int32:
    """min(count, max(0, (q_off[seg] + pos + 1) // ratio)): the ratio-causal column limit of the query at local
    position pos >= 0 of batch element / document `seg`, whose query row 0 sits at global token q_off[seg] (0 when
    has_off == 0; q_off is then never read). Exact for every int32 offset without 64-bit division (which ptxas
    makes a subroutine call): a negative offset keeps the sum in int32; a non-negative one is split as
    a * ratio + c, and (c + pos + 1) < 2**31 + 2**20 is divided as an unsigned 32-bit value."""
    off = Int32(0)
    if has_off != 0:
        off = (p_off + seg).load()
    n = Int32(0)
    if off < 0:
        lim = off + pos + 1                       # >= -2**31 + 1: pos + 1 <= 2**20 cannot wrap
        if lim > 0:
            n = cutlass.min(count, lim // ratio)
    else:
        a = off // ratio
        if a >= count:
            n = count
        else:
            c = off - a * ratio                   # in [0, ratio)
            m = Uint32(c) + Uint32(pos + 1)
            n = cutlass.min(count, a + Int32(m // Uint32(ratio)))
    return n


@cute.jit
def row_limit(p_off: cute.Pointer, has_off: Int32, tok: Int32, T: Int32, S: Int32, ratio: Int32):
    """(b, hi) of query row tok = b * T + t of a BSHD batch (T query rows and S keys per batch element): its batch
    element and its visible keys [0, hi), hi = causal_count with b's offset."""
    b = tok // T
    return b, causal_count(p_off, has_off, b, tok - b * T, S, ratio)


@cute.jit
def fill_tail(p_row: cute.Pointer, n: Int32, width: Int32, tidx: Int32, threads: cutlass.Constexpr,
              uniform_trips: cutlass.Constexpr = False):
    """p_row[j] = -inf for n <= j < width: the masked tail of a dense score row whose first n columns are valid.
    p_row need only be 4-byte aligned: the up to 3 columns before the first 16-byte boundary and the up to 3 after
    the last are single fp32 stores, the rest 16-byte streaming stores (st.global.cs.v4: a quarter of the store
    instructions, which matters when one warp fills beside a kernel's consumers), chunk i by thread i % threads.
    uniform_trips: every thread runs the same number of loop trips (the last one's store predicated), for callers
    that issue wgmma after the fill: a loop whose trip count depends on the thread index is a divergent path to
    ptxas, which then serializes the caller's wgmma (C7520)."""
    if n < width:
        mis = Int32((p_row + n).toint() % 16) // 4                 # columns past the previous 16-byte boundary
        head = cutlass.min((4 - mis) % 4, width - n)
        if tidx < head:
            (p_row + (n + tidx)).store(-Float32.inf)
        j0 = n + head
        nv = (width - j0) // 4
        if cutlass.const_expr(uniform_trips):
            for v0 in cutlass.range(0, nv, threads, unroll=2):
                v = v0 + tidx
                if v < nv:
                    st_global_v4_f32(p_row + (j0 + 4 * v), -Float32.inf, -Float32.inf, -Float32.inf, -Float32.inf)
        else:
            for v in cutlass.range(tidx, nv, threads, unroll=2):
                st_global_v4_f32(p_row + (j0 + 4 * v), -Float32.inf, -Float32.inf, -Float32.inf, -Float32.inf)
        rest = width - j0 - 4 * nv
        if tidx < rest:
            (p_row + (j0 + 4 * nv + tidx)).store(-Float32.inf)
