"""Device code shared by the lightning-indexer score and top-k kernels and the indexer_scores finishing kernel
(sm_90a): a query token's candidate rows (row_bounds; the ratio-causal limit itself is the toolkit's
dense_rows.causal_count)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from dsagen.kernels.common.sm90.dense_rows import causal_count


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
