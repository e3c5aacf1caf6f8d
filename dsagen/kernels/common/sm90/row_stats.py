"""A CTA's softmax statistics of one row of FP32 values in global memory (sm_90a device code): each thread's online
(max, sum) over its strided share of the row's first n values (`thread_stats`, UNROLL loads in flight before their
values are used), the warp's merge by butterfly shuffles (`warp_stats`) and the CTA's merge through shared memory
(`cta_row_stats`, after which warp 0 holds the row's statistics).

Two domains, chosen at trace time: log2 (each value x is loaded as x log2 e; m and s = sum of exp2(x - m) are in
that unit) and raw (m is a raw value, s = sum of exp2((x - m) log2 e)). The dense indexer's LSE pass
(lightning_indexer/mask_lse_sm90) works in the first, the top-k finish (lightning_indexer/topk_softmax_sm90.finish_row)
in the second; each keeps its own arithmetic. Every thread of the CTA calls cta_row_stats (it syncs the CTA once).
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from dsagen.kernels.common.sm90.reduce import warp_allreduce_pair
from dsagen.kernels.common.sm90.softmax import merge_softmax_stats

LOG2E = math.log2(math.e)
UNROLL = 4                     # row values a thread loads before it uses them


@cute.jit
def merge_raw_stats(m1, s1, m2, s2):
    """(max, sum) of two partial statistics of raw values (m, s = sum of exp2((x - m) log2 e)); (-inf, 0) for two
    empty ones."""
    m = cute.arch.fmax(m1, m2)
    m_sub = m if m > -Float32.inf else Float32(0.0)
    s = (s1 * cute.math.exp2((m1 - m_sub) * Float32(LOG2E), fastmath=True)
         + s2 * cute.math.exp2((m2 - m_sub) * Float32(LOG2E), fastmath=True))
    return m, s


@cute.jit
def thread_stats(p_row: cute.Pointer, n: Int32, tidx: Int32, threads: cutlass.Constexpr,
                 log2_domain: cutlass.Constexpr):
    """(m, s): this thread's online max and sum over the row values j = tidx + i * threads < n at p_row, in the
    log2 or the raw domain (module docstring); (-inf, 0) for none."""
    m = -Float32.inf
    s = Float32(0.0)
    xs = cute.make_rmem_tensor(cute.make_layout(UNROLL), Float32)
    for j0 in cutlass.range(tidx, n, threads * UNROLL, unroll=1):
        for u in cutlass.range_constexpr(UNROLL):
            xs[u] = -Float32.inf
            if j0 + u * threads < n:
                if cutlass.const_expr(log2_domain):
                    xs[u] = (p_row + (j0 + u * threads)).load() * Float32(LOG2E)
                else:
                    xs[u] = (p_row + (j0 + u * threads)).load()
        mu = cute.arch.fmax(cute.arch.fmax(xs[0], xs[1]), cute.arch.fmax(xs[2], xs[3]))
        m_new = cute.arch.fmax(m, mu)                  # finite: xs[0] is a valid value
        if cutlass.const_expr(log2_domain):
            s = s * cute.math.exp2(m - m_new, fastmath=True)
            for u in cutlass.range_constexpr(UNROLL):
                s += cute.math.exp2(xs[u] - m_new, fastmath=True)
        else:
            s = s * cute.math.exp2((m - m_new) * Float32(LOG2E), fastmath=True)
            for u in cutlass.range_constexpr(UNROLL):
                s += cute.math.exp2((xs[u] - m_new) * Float32(LOG2E), fastmath=True)
        m = m_new
    return m, s


@cute.jit
def warp_stats(m, s, log2_domain: cutlass.Constexpr):
    """The (max, sum) statistics of the whole warp, in every lane (butterfly shuffles)."""
    if cutlass.const_expr(log2_domain):
        return warp_allreduce_pair(m, s, merge_softmax_stats)
    return warp_allreduce_pair(m, s, merge_raw_stats)


@cute.jit
def cta_row_stats(p_row: cute.Pointer, n: Int32, tidx: Int32, warp: Int32, lane: Int32, sM: cute.Tensor,
                  sS: cute.Tensor, threads: cutlass.Constexpr, log2_domain: cutlass.Constexpr, use, use_args):
    """The CTA's (max, sum) over the row's first n values at p_row (`threads` threads, all of them calling it; sM /
    sS: threads // 32 floats of shared memory each, free on entry): each warp's statistics into sM / sS, one CTA
    barrier, then warp 0 merges them and calls use(m, s, *use_args) with the row's statistics (a @cute.jit function
    of the caller, traced in warp 0's branch). sM / sS stay in use until the caller's next CTA barrier."""
    nwarps = threads // 32
    m, s = thread_stats(p_row, n, tidx, threads, log2_domain)
    m, s = warp_stats(m, s, log2_domain)
    if lane == 0:
        sM[warp] = m
        sS[warp] = s
    cute.arch.sync_threads()
    if warp == 0:
        m = -Float32.inf
        s = Float32(0.0)
        if lane < nwarps:
            m = sM[lane]
            s = sS[lane]
        m, s = warp_stats(m, s, log2_domain)
        use(m, s, *use_args)
