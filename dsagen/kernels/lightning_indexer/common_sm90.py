"""Device code shared by the lightning-indexer score and top-k kernels and the indexer_scores finishing kernel
(sm_90a): a query token's candidate rows, and the -inf tail of a dense score row."""
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
def row_bounds(p_cu_q: cute.Pointer, p_cu_k: cute.Pointer, n_docs: Int32, t: Int32, T: Int32, S: Int32,
               causal: Int32, ratio: Int32, p_off=None, has_off=None, b=None):
    """[lo, hi): the rows of this batch element's candidate pool that query token t may select
    (lo == hi: none). Without packed offsets (n_docs == 0) the pool is [0, S) and causal rows stop at
    (t + 1) // ratio. With packed offsets, t's document d is found by binary search over cu_q
    (cu_q[d] <= t < cu_q[d + 1]); its pool is cu_k[d] .. cu_k[d + 1], the causal limit uses the
    document-local position, and ids written out are relative to lo (document-local).

    p_off (given at trace time: the indexer_scores kernels) adds per-segment causal offsets: with has_off != 0 the
    causal limit of batch element `b` (unpacked) or document d (packed) is (q_off[.] + local position + 1) //
    ratio clamped to [0, count] (causal_count). Without p_off the code is exactly the lightning indexer's."""
    lo = Int32(0)
    hi = Int32(0)
    if t < T:
        if n_docs == 0:
            hi = S
            if causal != 0:
                if cutlass.const_expr(p_off is None):
                    hi = cutlass.min(S, (t + 1) // ratio)
                else:
                    hi = causal_count(p_off, has_off, b, t, S, ratio)
        else:
            cu_q = cute.make_tensor(p_cu_q, cute.make_layout(n_docs + 1))
            cu_k = cute.make_tensor(p_cu_k, cute.make_layout(n_docs + 1))
            if t < cu_q[n_docs]:
                a = Int32(0)
                z = n_docs
                while z - a > 1:                      # invariant: cu_q[a] <= t < cu_q[z]
                    m = (a + z) // 2
                    if cu_q[m] <= t:
                        a = m
                    else:
                        z = m
                lo = cu_k[a]
                count = cu_k[a + 1] - lo
                if causal != 0:
                    if cutlass.const_expr(p_off is None):
                        count = cutlass.min(count, (t - cu_q[a] + 1) // ratio)
                    else:
                        count = causal_count(p_off, has_off, a, t - cu_q[a], count, ratio)
                lo = cutlass.max(cutlass.min(lo, S), Int32(0))
                hi = cutlass.max(cutlass.min(lo + count, S), lo)
    return lo, hi


@cute.jit
def fill_tail(p_row: cute.Pointer, n: Int32, width: Int32, tidx: Int32, threads: cutlass.Constexpr):
    """p_row[j] = -inf for n <= j < width: the masked tail of a dense score row whose first n columns are valid.
    p_row need only be 4-byte aligned: the up to 3 columns before the first 16-byte boundary and the up to 3 after
    the last are single fp32 stores, the rest 16-byte streaming stores (st.global.cs.v4: a quarter of the store
    instructions, which matters when one warp fills beside a kernel's consumers), chunk i by thread i % threads."""
    if n < width:
        mis = Int32((p_row + n).toint() % 16) // 4                 # columns past the previous 16-byte boundary
        head = cutlass.min((4 - mis) % 4, width - n)
        if tidx < head:
            (p_row + (n + tidx)).store(-Float32.inf)
        j0 = n + head
        nv = (width - j0) // 4
        for v in cutlass.range(tidx, nv, threads, unroll=2):
            st_global_v4_f32(p_row + (j0 + 4 * v), -Float32.inf, -Float32.inf, -Float32.inf, -Float32.inf)
        rest = width - j0 - 4 * nv
        if tidx < rest:
            (p_row + (j0 + 4 * nv + tidx)).store(-Float32.inf)
