"""The split-KV combine of the sparse MLA decode: for query row t and head h, the n_splits FP32 partials of the
split_kv forward kernel (SparseAttnFwdSpec.split_kv: partial row t n_splits + j holds O_j / s_j of slot range j and
its KV-only natural-log LSE l_j, +inf when the range had no valid slot) merged into

    lse[t, h] = log sum_j exp(l_j)                                    (+inf when no range had a valid slot)
    out[t, h] = sum_j exp(l_j) o_j / (sum_j exp(l_j) + exp(sink[h]))  (the sink term only when has_sink; 0 if empty)

which is the unsplit kernel's out and lse up to the order of the FP32 sums. One warp per (t, h), `warps_per_cta`
per CTA: lane j < n_splits (n_splits <= 32) reads l_j, a warp max and sum give the weights, then lane l sums the
partials' 8-column chunks l and l + 32 (16-byte loads) in range order and stores them as bf16 (16-byte stores).

`build(d_v, warps_per_cta)` returns a fresh kernel and host entry with those values bound as Python constants, plus
the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy, pack_f32x2, st_global_v4_b32
from dsagen.kernels.sparse_mla.spec import COMBINE_MAX_SPLITS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_SPLITS = COMBINE_MAX_SPLITS   # one range per lane
CHUNK = 8                  # columns per lane and step: 16-byte bf16 stores, two 16-byte FP32 loads
POS_INF, NEG_INF = float("inf"), float("-inf")


def params() -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    return [
        {"name": "o_part", "kind": "ptr", "dtype": "float32", "align": 16},   # (rows * n_splits, n_heads, d_v)
        {"name": "lse_part", "kind": "ptr", "dtype": "float32", "align": 4},  # (rows * n_splits, n_heads)
        {"name": "sink", "kind": "ptr", "dtype": "float32", "align": 4},      # (n_heads,), read when has_sink
        {"name": "out", "kind": "ptr", "dtype": "bfloat16", "align": 16},     # (rows, n_heads, d_v)
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, n_heads)
        {"name": "rows", "kind": "i32"},
        {"name": "n_heads", "kind": "i32"},
        {"name": "n_splits", "kind": "i32"},                                  # 1..32
        {"name": "has_sink", "kind": "i32"},
    ]


def launch(warps_per_cta: int) -> dict:
    """The launch declaration: one warp per (row, head), `warps_per_cta` per CTA, no shared memory."""
    return {"grid": [f"ceil_div(rows * n_heads, {warps_per_cta})", 1, 1], "block": [warps_per_cta * 32, 1, 1],
            "cluster": [1, 1, 1], "smem": 0}


def build(d_v: int, warps_per_cta: int) -> BuiltKernel:
    """A new combine kernel for rows of `d_v` values (a multiple of 256) and `warps_per_cta` (row, head) pairs per
    CTA. Arguments (the PARAMS order): o_part and lse_part as the split_kv forward wrote them, sink (n_heads,) FP32,
    out (rows, n_heads, d_v) bf16 and lse (rows, n_heads) FP32, contiguous, 16-byte aligned rows; rows, n_heads,
    n_splits in 1..32, has_sink. Each call returns distinct function objects."""
    warps = warps_per_cta
    steps = d_v // (CHUNK * 32)                     # 8-column chunks per lane

    @cute.jit
    def chunk(p_base: cute.Pointer, row, c) -> cute.Tensor:
        """Columns 8 c .. 8 c + 7 of row `row` of a (*, d_v) FP32 matrix at p_base, as (4, 2) 16-byte vectors."""
        p = cute.make_ptr(Float32, (p_base + (Int64(row) * d_v + CHUNK * c)).toint(), cute.AddressSpace.gmem,
                          assumed_align=16)
        return cute.make_tensor(p, cute.make_layout((4, 2)))

    @cute.kernel
    def kernel(p_opart: cute.Pointer, p_lpart: cute.Pointer, p_sink: cute.Pointer, p_out: cute.Pointer,
               p_lse: cute.Pointer, rows: Int32, n_heads: Int32, n_splits: Int32, has_sink: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        w = bidx * warps + warp
        if w < rows * n_heads:                              # warp-uniform
            t = w // n_heads
            h = w - t * n_heads
            x = Float32(NEG_INF)                            # l_j in log2 units, -inf: no range / no valid slot
            if lane < n_splits:
                lj = (p_lpart + (Int64(t * n_splits + lane) * n_heads + h)).load()
                if lj < Float32(POS_INF):
                    x = lj * LOG2E
            m = x
            for sh in cutlass.range_constexpr(5):
                m = cutlass.max(m, cute.arch.shuffle_sync_bfly(m, offset=1 << sh))
            e = Float32(0.0)
            if x > Float32(NEG_INF):
                e = cute.math.exp2(x - m, fastmath=False)
            total = e
            for sh in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << sh)
            denom = total
            if has_sink != 0:
                if m > Float32(NEG_INF):
                    denom = total + cute.math.exp2((p_sink + h).load() * LOG2E - m, fastmath=False)
            wt = Float32(0.0)
            if m > Float32(NEG_INF):
                wt = e / denom
            acc = cute.make_rmem_tensor(cute.make_layout((4, 2, steps)), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
            for j in cutlass.range(n_splits, unroll=1):
                wj = cute.arch.shuffle_sync(wt, j)
                prow = Int64(t * n_splits + j) * n_heads + h
                for v in cutlass.range_constexpr(steps):
                    cute.autovec_copy(chunk(p_opart, prow, 32 * v + lane), part)
                    for a in cutlass.range_constexpr(4):
                        for b in cutlass.range_constexpr(2):
                            acc[a, b, v] = acc[a, b, v] + wj * part[a, b]
            orow = Int64(t) * n_heads + h
            policy = l2_evict_first_policy()
            for v in cutlass.range_constexpr(steps):
                words = [pack_f32x2(acc[2 * i, b, v], acc[2 * i + 1, b, v]) for b in range(2) for i in range(2)]
                st_global_v4_b32(p_out + (orow * d_v + CHUNK * (32 * v + lane)), *words, policy)
            if lane == 0:
                lse = Float32(POS_INF)
                if m > Float32(NEG_INF):
                    lse = (m + cute.math.log2(total, fastmath=False)) * LN2
                (p_lse + orow).store(lse)

    @cute.jit
    def host(p_opart: cute.Pointer, p_lpart: cute.Pointer, p_sink: cute.Pointer, p_out: cute.Pointer,
             p_lse: cute.Pointer, rows: Int32, n_heads: Int32, n_splits: Int32, has_sink: Int32):
        kernel(p_opart, p_lpart, p_sink, p_out, p_lse, rows, n_heads, n_splits, has_sink).launch(
            grid=((rows * n_heads + warps - 1) // warps, 1, 1), block=(warps * 32, 1, 1), smem=0)

    return BuiltKernel(params(), launch(warps_per_cta), kernel, host)
