"""The compactify kernel (cuDNN frontend DSA, compactify_wrapper): stable compaction of -1-padded top-k rows.

Valid ids (>= 0, before the row's length) move to the front of their row in their original order, -1 fills
the rest, and the count of valid ids is written per row. One warp per row, `warps_per_cta` rows per CTA;
ballot + popc give each valid id its slot. The row width K, the row count and the input row stride are
run-time arguments.

`build(warps_per_cta)` returns a fresh kernel and host entry with the warp count bound as a Python constant,
plus the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dsagen.kernels.built import BuiltKernel


def params() -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    return [
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_rows, ld_idx) input ids
        {"name": "length", "kind": "ptr", "dtype": "int32", "align": 4},      # (n_rows,) optional limits
        {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_rows, k) compacted ids
        {"name": "out_length", "kind": "ptr", "dtype": "int32", "align": 4},  # (n_rows,) valid counts
        {"name": "n_rows", "kind": "i32"},
        {"name": "k", "kind": "i32"},
        {"name": "ld_idx", "kind": "i64"},                                    # input row stride, elements
        {"name": "has_length", "kind": "i32"},                                # 0: `length` is not read
    ]


def launch(warps_per_cta: int) -> dict:
    """The launch declaration: one CTA per `warps_per_cta` rows, `32 * warps_per_cta` threads, no dynamic smem."""
    return {"grid": [f"ceil_div(n_rows, {warps_per_cta})", 1, 1], "block": [warps_per_cta * 32, 1, 1],
            "cluster": [1, 1, 1], "smem": 0}


def build(warps_per_cta: int) -> BuiltKernel:
    """A new compactify kernel for `warps_per_cta` (a power of two in 1..32) warps, i.e. rows, per CTA.

    Arguments of `kernel` and `host` (the PARAMS order): idx (n_rows, ld_idx) int32, length (n_rows,) int32
    (read only when has_length != 0), out (n_rows, k) int32 contiguous, out_length (n_rows,) int32, n_rows,
    k, ld_idx (elements, int64), has_length. Each call returns distinct function objects, so every rendered
    module names its own kernel.
    """
    warps = warps_per_cta

    @cute.kernel
    def kernel(p_idx: cute.Pointer, p_len: cute.Pointer, p_out: cute.Pointer, p_out_len: cute.Pointer,
               n_rows: Int32, k: Int32, ld_idx: Int64, has_length: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * warps + warp
        if row < n_rows:                       # warp-uniform: every lane of a warp has the same row
            src = cute.make_tensor(p_idx + Int64(row) * ld_idx, cute.make_layout(k))
            dst = cute.make_tensor(p_out + Int64(row) * Int64(k), cute.make_layout(k))
            limit = k
            if has_length != 0:
                lens = cute.make_tensor(p_len, cute.make_layout(n_rows))
                limit = cutlass.min(cutlass.max(lens[row], Int32(0)), k)
            below = cute.arch.lanemask_lt()
            count = Int32(0)
            for j0 in cutlass.range(0, limit, 32, unroll=1):
                j = j0 + lane
                v = Int32(-1)
                if j < limit:
                    v = src[j]
                ballot = cute.arch.vote_ballot_sync(v >= 0)
                if v >= 0:
                    dst[count + cute.arch.popc(ballot & below)] = v
                count = count + cute.arch.popc(ballot)
            for j in cutlass.range(count + lane, k, 32, unroll=1):
                dst[j] = Int32(-1)
            if lane == 0:
                counts = cute.make_tensor(p_out_len, cute.make_layout(n_rows))
                counts[row] = count

    @cute.jit
    def host(p_idx: cute.Pointer, p_len: cute.Pointer, p_out: cute.Pointer, p_out_len: cute.Pointer,
             n_rows: Int32, k: Int32, ld_idx: Int64, has_length: Int32):
        kernel(p_idx, p_len, p_out, p_out_len, n_rows, k, ld_idx, has_length).launch(
            grid=((n_rows + warps - 1) // warps, 1, 1), block=(warps * 32, 1, 1))

    return BuiltKernel(params(), launch(warps_per_cta), kernel, host)
