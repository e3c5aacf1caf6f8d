"""The finishing pass of dsagen.indexer_forward_topk on sm_90a: `build(threads)` makes the kernel of one
IndexerTopkSoftmaxSpec.

The forward top-k kernel (topk_sm90, `forward=True`) wrote every row r's selected ids (row-local, ascending) into
ids[r, :] and their scores into logits[r, :]: slots j < n_r hold the selection, n_r = min(hi - lo, topk) of the
row's bounds (row_bounds with the causal offsets), the rest -1 / -inf. This kernel, run after it on the same stream,
completes every row r of the [rows, topk] outputs:

    lse[r]        = log(sum_{j < n_r} exp(logits[r, j]))      (-inf when n_r == 0; only when want_lse != 0)
    softmax[r, j] = exp(logits[r, j] - lse[r]) for j < n_r, else 0            (only when want_soft != 0)
    ids[r, j]    += base_r for j < n_r                                        (only when global_ids != 0)

where base_r = b * S for row (b, t) of a BSHD call (the flat key row of batch element b) and the document's first
key row cu_k[d] for a packed (THD) call: the ids cuDNN frontend DSA calls global. Row r is query t = r % T of batch
element b = r // T (THD: B = 1). Each row's slots are touched by one CTA only, so the kernel needs no ordering but the
stream's.

Persistent: min(rows, n_ctas) CTAs of `threads` threads, CTA i takes rows i, i + n_ctas, ... Per row the valid logits
are read once for the statistics (common/sm90/row_stats.cta_row_stats in its raw domain: an online max m of the raw
logits and s = sum exp2((x - m) log2 e), UNROLL loads in flight, then a butterfly and a shared-memory merge), m and
log2(s) are broadcast through shared memory, and a second pass (the row's 4 * topk bytes are L1 / L2 resident by then)
writes softmax = exp2((x - m) log2 e - log2 s) and shifts the ids. The difference x - m is taken before any scaling,
so it is exact for the logits near the max (Sterbenz) and the large probabilities keep FP32 accuracy however large the
logits are (an exponent of x log2 e - lse2 would carry the rounding of the product, ~1e-5 relative at logits of a few
hundred).

Bytes: per row 4 n_r read twice, 4 topk written (softmax), 4 n_r read and written (global ids).
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.row_stats import cta_row_stats
from dsagen.kernels.lightning_indexer.common_sm90 import row_bounds

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@cute.jit
def row_stats_out(m, s, lane, n: Int32, sL: cute.Tensor, want_lse: Int32, p_lse_r: cute.Pointer):
    """Warp 0's use of a row's raw-domain statistics (row_stats.cta_row_stats): lane 0 keeps the max and log2(sum)
    in sL and writes the natural-log LSE (want_lse; -inf for an empty row)."""
    if lane == 0:
        ls2 = Float32(0.0)
        if n > 0:
            ls2 = cute.math.log2(s, fastmath=False)
        sL[0] = m
        sL[1] = ls2
        if want_lse != 0:
            v = -Float32.inf
            if n > 0:
                v = m + ls2 * Float32(LN2)
            p_lse_r.store(v)


@cute.jit
def finish_row(p_row: cute.Pointer, p_ids_row: cute.Pointer, p_soft_row: cute.Pointer, p_lse_r: cute.Pointer, n: Int32,
               topk: Int32, base: Int32, want_soft: Int32, want_lse: Int32, global_ids: Int32, tidx: Int32,
               warp: Int32, lane: Int32, sM: cute.Tensor, sS: cute.Tensor, sL: cute.Tensor,
               threads: cutlass.Constexpr):
    """One row's finish by a CTA of `threads` threads (all of them call it): over the row's n valid logits at p_row
    (of its topk slots) the LSE into p_lse_r (want_lse), the softmax into p_soft_row[0, topk) (want_soft; 0 past
    n) and, with global_ids, `base` added to the row's n ids at p_ids_row. sM / sS: `threads // 32` floats of shared
    memory each, sL: 2 (the row's max and log2(sum)). Returns with every thread past its reads of sL; the next
    row's first shared-memory writes (sM / sS) come before its first barrier, after which warp 0 rewrites sL."""
    cta_row_stats(p_row, n, tidx, warp, lane, sM, sS, threads, False, row_stats_out, (lane, n, sL, want_lse, p_lse_r))
    cute.arch.sync_threads()                   # sL holds the row's statistics; sM / sS are free again
    m = sL[0]
    ls2 = sL[1]
    for j in cutlass.range(tidx, topk, threads, unroll=1):
        p = Float32(0.0)
        if j < n:
            p = cute.math.exp2(((p_row + j).load() - m) * Float32(LOG2E) - ls2, fastmath=True)
            if global_ids != 0:
                p_id = p_ids_row + j
                p_id.store(p_id.load() + base)
        if want_soft != 0:
            (p_soft_row + j).store(p)


PARAMS = [
    {"name": "logits", "kind": "ptr", "dtype": "float32", "align": 4},   # (rows, topk) fp32 selected scores
    {"name": "ids", "kind": "ptr", "dtype": "int32", "align": 4},        # (rows, topk) int32, row-local in, out
    {"name": "softmax", "kind": "ptr", "dtype": "float32", "align": 4},  # (rows, topk) fp32 (want_soft)
    {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows,) fp32 (want_lse)
    {"name": "cu_q", "kind": "ptr", "dtype": "int32", "align": 4},       # [n_docs + 1] (packed only)
    {"name": "cu_k", "kind": "ptr", "dtype": "int32", "align": 4},       # [n_docs + 1] (packed only)
    {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},      # [segments] causal offsets (has_off)
    {"name": "n_docs", "kind": "i32"},                                   # 0: not packed
    {"name": "T", "kind": "i32"},                                        # query rows per batch element (packed: all)
    {"name": "S", "kind": "i32"},                                        # keys per batch element (packed: all)
    {"name": "rows", "kind": "i32"},
    {"name": "topk", "kind": "i32"},                                     # slots of a row (the row stride)
    {"name": "ratio", "kind": "i32"},
    {"name": "has_off", "kind": "i32"},
    {"name": "want_soft", "kind": "i32"},
    {"name": "want_lse", "kind": "i32"},
    {"name": "global_ids", "kind": "i32"},
    {"name": "n_ctas", "kind": "i32"},
]


def build(threads: int) -> BuiltKernel:
    """The kernel of IndexerTopkSoftmaxSpec(threads): `threads` (a multiple of 32, <= 1024) per CTA, one row at a
    time. Each call makes new kernel and host functions."""
    THREADS = threads
    NWARPS = threads // 32
    assert THREADS % 32 == 0 and NWARPS <= 32

    @cute.struct
    class Smem:
        red_m: cute.struct.MemRange[Float32, NWARPS]
        red_s: cute.struct.MemRange[Float32, NWARPS]
        row: cute.struct.MemRange[Float32, 2]              # the row's max logit and log2(sum), for every thread

    class K:
        pass

    K.THREADS = THREADS
    K.Smem = Smem

    @cute.kernel
    def kernel(p_logits: cute.Pointer, p_ids: cute.Pointer, p_soft: cute.Pointer, p_lse: cute.Pointer,
               p_cu_q: cute.Pointer, p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32,
               rows: Int32, topk: Int32, ratio: Int32, has_off: Int32, want_soft: Int32, want_lse: Int32,
               global_ids: Int32, n_ctas: Int32):
        c = cta_coords()
        lane = cute.arch.lane_idx()
        st = cutlass.memory.SmemAllocator().allocate(Smem)
        sM = st.red_m.get_tensor(cute.make_layout(NWARPS))
        sS = st.red_s.get_tensor(cute.make_layout(NWARPS))
        sL = st.row.get_tensor(cute.make_layout(2))
        for r in cutlass.range(c.bidx, rows, c.nctas, unroll=1):
            b = r // T
            t = r - b * T
            lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t, T, S, Int32(1), ratio, p_off, has_off, b)
            n = cutlass.min(cutlass.max(hi - lo, Int32(0)), topk)
            at = Int64(r) * Int64(topk)
            p_row = p_logits + at
            finish_row(p_row, p_ids + at, p_soft + at, p_lse + r, n, topk, lo + b * S, want_soft, want_lse,
                       global_ids, c.tidx, c.warp, lane, sM, sS, sL, THREADS)

    @cute.jit
    def host(p_logits: cute.Pointer, p_ids: cute.Pointer, p_soft: cute.Pointer, p_lse: cute.Pointer,
             p_cu_q: cute.Pointer, p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32,
             rows: Int32, topk: Int32, ratio: Int32, has_off: Int32, want_soft: Int32, want_lse: Int32,
             global_ids: Int32, n_ctas: Int32):
        kernel(p_logits, p_ids, p_soft, p_lse, p_cu_q, p_cu_k, p_off, n_docs, T, S, rows, topk, ratio, has_off,
               want_soft, want_lse, global_ids, n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1),
                                                               block=(THREADS, 1, 1), smem=Smem.size_in_bytes())

    K.kernel = kernel
    K.host = host
    return BuiltKernel.of(list(PARAMS), K, "min(rows, n_ctas)")
