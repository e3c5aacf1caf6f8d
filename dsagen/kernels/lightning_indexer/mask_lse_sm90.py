"""The finishing pass of dsagen.indexer_scores on sm_90a: `build(threads)` makes the kernel of one
IndexerScoresMaskSpec.

The dense_scores score kernel (score_sm90) writes only each row's valid columns: out[r, j] for j < n_r, n_r = hi - lo
of the row's bounds (row_bounds with the causal offsets). This kernel, run after it on the same stream, completes
every row r of the [rows, width] fp32 score matrix (row stride ld):

    out[r, j] = -inf                                  for n_r <= j < width (only when fill != 0)
    lse[r]    = log(sum_{j < n_r} exp(out[r, j]))     (-inf when n_r == 0; only when want_lse != 0)

The score kernel fills the tails itself when its `fill` parameter is set (score_sm90's filler warp); this pass then
runs only for the LSE, with fill = 0.

Row r is query t = r % T of batch element b = r // T (BSHD; packed THD: B = 1, the row's document found by
row_bounds' binary search over cu_q). The row's valid columns and its -inf tail are disjoint from what the other
rows touch, so the kernel needs no ordering but the stream's.

Persistent: min(rows, n_ctas) CTAs of `threads` threads, CTA i takes rows i, i + n_ctas, ... Per row (fill != 0)
every thread stores -inf to the tail columns j = n_r + tid, n_r + tid + threads, ... (dense_rows.fill_tail:
coalesced fp32 stores; the base may be only 4-byte aligned), and with want_lse reads the valid columns UNROLL per
step (independent loads in flight), keeping an online (max, sum of exp2) in the log2 domain; the warps' partial
statistics merge by butterfly shuffles, then across warps through shared memory (common/sm90/row_stats.cta_row_stats
in its log2 domain), and thread 0 writes lse[r] = (max + log2(sum)) * ln 2.

Bytes: per row 4 (width - n_r) written (fill) and, with want_lse, 4 n_r read: at most one pass over the output.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.row_stats import cta_row_stats
from dsagen.kernels.common.sm90.dense_rows import fill_tail
from dsagen.kernels.lightning_indexer.common_sm90 import row_bounds

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

PARAMS = [
    {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows, width) fp32, row stride ld
    {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows,) fp32, written when want_lse
    {"name": "cu_q", "kind": "ptr", "dtype": "int32", "align": 4},       # [n_docs + 1] (packed only)
    {"name": "cu_k", "kind": "ptr", "dtype": "int32", "align": 4},       # [n_docs + 1] (packed only)
    {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},      # [segments] causal offsets (has_off)
    {"name": "n_docs", "kind": "i32"},                                   # 0: not packed
    {"name": "T", "kind": "i32"},                                        # query rows per batch element (packed: all)
    {"name": "S", "kind": "i32"},                                        # keys per batch element (packed: all)
    {"name": "rows", "kind": "i32"},
    {"name": "width", "kind": "i32"},                                    # columns of a row
    {"name": "ratio", "kind": "i32"},
    {"name": "has_off", "kind": "i32"},
    {"name": "want_lse", "kind": "i32"},
    {"name": "fill", "kind": "i32"},                                     # 0: the tails are already -inf
    {"name": "n_ctas", "kind": "i32"},
    {"name": "ld", "kind": "i64"},
]


@cute.jit
def lse_out(m, s, lane, n: Int32, p_lse_r: cute.Pointer):
    """Warp 0's use of a row's log2-domain statistics (row_stats.cta_row_stats): lane 0 writes the natural-log LSE
    (-inf for an empty row)."""
    if lane == 0:
        v = -Float32.inf
        if n > 0:
            v = (m + cute.math.log2(s, fastmath=False)) * Float32(LN2)
        p_lse_r.store(v)


def build(threads: int) -> BuiltKernel:
    """The kernel of IndexerScoresMaskSpec(threads): `threads` (a multiple of 32, <= 1024) per CTA, one row at a
    time. Each call makes new kernel and host functions."""
    THREADS = threads
    NWARPS = threads // 32
    assert THREADS % 32 == 0 and NWARPS <= 32

    @cute.struct
    class Smem:
        red_m: cute.struct.MemRange[Float32, NWARPS]
        red_s: cute.struct.MemRange[Float32, NWARPS]

    class K:
        pass

    K.THREADS = THREADS
    K.Smem = Smem

    @cute.kernel
    def kernel(p_out: cute.Pointer, p_lse: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
               p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, rows: Int32, width: Int32, ratio: Int32,
               has_off: Int32, want_lse: Int32, fill: Int32, n_ctas: Int32, ld: Int64):
        c = cta_coords()
        lane = cute.arch.lane_idx()
        st = cutlass.memory.SmemAllocator().allocate(Smem)
        sM = st.red_m.get_tensor(cute.make_layout(NWARPS))
        sS = st.red_s.get_tensor(cute.make_layout(NWARPS))
        for r in cutlass.range(c.bidx, rows, c.nctas, unroll=1):
            b = r // T
            t = r - b * T
            lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t, T, S, Int32(1), ratio, p_off, has_off, b)
            n = cutlass.max(hi - lo, Int32(0))
            p_row = p_out + Int64(r) * ld
            if fill != 0:
                fill_tail(p_row, n, width, c.tidx, THREADS)
            if want_lse != 0:
                cta_row_stats(p_row, n, c.tidx, c.warp, lane, sM, sS, THREADS, True, lse_out, (lane, n, p_lse + r))
                cute.arch.sync_threads()               # sM / sS are rewritten by the next row

    @cute.jit
    def host(p_out: cute.Pointer, p_lse: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
             p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, rows: Int32, width: Int32, ratio: Int32,
             has_off: Int32, want_lse: Int32, fill: Int32, n_ctas: Int32, ld: Int64):
        kernel(p_out, p_lse, p_cu_q, p_cu_k, p_off, n_docs, T, S, rows, width, ratio, has_off, want_lse, fill,
               n_ctas, ld).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(THREADS, 1, 1),
                                  smem=Smem.size_in_bytes())

    K.kernel = kernel
    K.host = host
    return BuiltKernel.of(list(PARAMS), K, "min(rows, n_ctas)")
