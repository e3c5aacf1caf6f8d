"""The deterministic row scatter-add kernel: acc[r, :] += rows[order[j], :] for j = ptr[r] .. ptr[r + 1] - 1, in that
order, for every accumulator row r < n_acc (host.scatter_add_rows builds `order` and `ptr` from the rows' targets).

One warp per accumulator row, `warps_per_cta` rows per CTA. The row's WIDTH FP32 values are WIDTH / 4 16-byte
vectors; lane l holds vectors l, l + 32, ... in registers: it loads acc[r] once, adds each contributing row's
vectors in j order, and stores the sum. The rows are loaded `unroll` at a time before they are added, so that
several rows' loads are in flight at once. A row with no contribution (ptr[r] == ptr[r + 1]) is neither read nor
written.

`build(width, warps_per_cta)` returns a fresh kernel and host entry with those values bound as Python constants,
plus the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel

VEC = 4                    # FP32 values per 16-byte vector


def params() -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    return [
        {"name": "acc", "kind": "ptr", "dtype": "float32", "align": 16},      # (n_acc, width) contiguous, updated
        {"name": "rows", "kind": "ptr", "dtype": "float32", "align": 16},     # (m, width) contiguous
        {"name": "order", "kind": "ptr", "dtype": "int32", "align": 4},       # (m,) rows grouped by target
        {"name": "ptr", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_acc + 1,) group starts
        {"name": "n_acc", "kind": "i32"},
    ]


def launch(warps_per_cta: int) -> dict:
    """The launch declaration: one CTA per `warps_per_cta` accumulator rows, no shared memory."""
    return {"grid": [f"ceil_div(n_acc, {warps_per_cta})", 1, 1], "block": [warps_per_cta * 32, 1, 1],
            "cluster": [1, 1, 1], "smem": 0}


def build(width: int, warps_per_cta: int, unroll: int = 4) -> BuiltKernel:
    """A new scatter-add kernel for rows of `width` FP32 values (a multiple of 4), `warps_per_cta` (a power of
    two in 1..32) accumulator rows per CTA and `unroll` contributing rows loaded before they are added.

    Arguments of `kernel` and `host` (the PARAMS order): acc (n_acc, width) float32 contiguous, 16-byte aligned;
    rows (m, width) float32 contiguous, 16-byte aligned; order (m,) int32, each in [0, m); ptr (n_acc + 1,) int32,
    nondecreasing, ptr[n_acc] <= m; n_acc. Each call returns distinct function objects, so every rendered module
    names its own kernel.
    """
    warps, UNROLL = warps_per_cta, unroll
    nvec = width // VEC                           # 16-byte vectors per row
    per_lane = (nvec + 31) // 32                  # vectors per lane (the last one on the first nvec % 32 lanes)

    @cute.jit
    def row_vectors(p_base: cute.Pointer, row) -> cute.Tensor:
        """Row `row` of a (*, width) FP32 matrix at p_base as (VEC, nvec) 16-byte vectors."""
        p = cute.make_ptr(Float32, (p_base + Int64(row) * width).toint(), cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(p, cute.make_layout((VEC, nvec)))

    @cute.kernel
    def kernel(p_acc: cute.Pointer, p_rows: cute.Pointer, p_order: cute.Pointer, p_ptr: cute.Pointer,
               n_acc: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        r = bidx * warps + warp
        if r < n_acc:                                       # warp-uniform
            j0 = (p_ptr + r).load()
            j1 = (p_ptr + (r + 1)).load()
            if j0 < j1:
                mAcc = row_vectors(p_acc, r)
                total = cute.make_rmem_tensor(cute.make_layout((VEC, per_lane)), Float32)
                for v in cutlass.range_constexpr(per_lane):
                    if 32 * v + lane < nvec:
                        cute.autovec_copy(mAcc[None, 32 * v + lane], total[None, v])
                part = cute.make_rmem_tensor(cute.make_layout((VEC, per_lane, UNROLL)), Float32)
                for j in cutlass.range(j0, j1, UNROLL, unroll=1):
                    # UNROLL rows' loads first, then their sums in j order
                    for u in cutlass.range_constexpr(UNROLL):
                        if j + u < j1:
                            mRow = row_vectors(p_rows, (p_order + (j + u)).load())
                            for v in cutlass.range_constexpr(per_lane):
                                if 32 * v + lane < nvec:
                                    cute.autovec_copy(mRow[None, 32 * v + lane], part[None, v, u])
                    for u in cutlass.range_constexpr(UNROLL):
                        if j + u < j1:
                            for v in cutlass.range_constexpr(per_lane):
                                for e in cutlass.range_constexpr(VEC):
                                    total[e, v] = total[e, v] + part[e, v, u]
                for v in cutlass.range_constexpr(per_lane):
                    if 32 * v + lane < nvec:
                        cute.autovec_copy(total[None, v], mAcc[None, 32 * v + lane])

    @cute.jit
    def host(p_acc: cute.Pointer, p_rows: cute.Pointer, p_order: cute.Pointer, p_ptr: cute.Pointer, n_acc: Int32):
        kernel(p_acc, p_rows, p_order, p_ptr, n_acc).launch(grid=((n_acc + warps - 1) // warps, 1, 1),
                                                            block=(warps * 32, 1, 1), smem=0)

    return BuiltKernel(params(), launch(warps_per_cta), kernel, host)
