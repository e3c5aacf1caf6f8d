"""The deterministic row scatter-add kernel: for every accumulator row r < n_acc, acc[r, :] += rows[order[j] - row0, :]
for j = cursor[r], cursor[r] + 1, ... while j < ptr[r + 1] and order[j] < row1, in that order; then cursor[r] is the
first j it did not take. `order` and `ptr` group a whole series of target rows by target (host.RowScatter builds
them, `order` increasing within each group); each launch gets the next slice [row0, row1) of that series as `rows`,
so one reverse index serves every slice and the sums are the same as one launch over the whole series.

One warp per accumulator row, `warps_per_cta` rows per CTA. The warp finds the end of its slice's run 32 entries
of `order` at a time (a ballot), then lane l holds the row's 16-byte vectors l, l + 32, ... in registers: it loads
acc[r] once, adds each contributing row's vectors in j order, and stores the sum. The rows are loaded `unroll` at a
time before they are added, so that several rows' loads are in flight at once. A row with no contribution in the
slice is neither read nor written.

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
        {"name": "order", "kind": "ptr", "dtype": "int32", "align": 4},       # (M,) series rows grouped by target
        {"name": "ptr", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_acc + 1,) group starts
        {"name": "cursor", "kind": "ptr", "dtype": "int32", "align": 4},      # (n_acc,) next j per group, updated
        {"name": "row0", "kind": "i32"},                                      # rows[i] is series row row0 + i
        {"name": "row1", "kind": "i32"},                                      # ... up to row1 (excluded)
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
    rows (row1 - row0, width) float32 contiguous, 16-byte aligned; order (M,) int32, each in [0, M), increasing
    within each group; ptr (n_acc + 1,) int32, nondecreasing, ptr[n_acc] <= M; cursor (n_acc,) int32, cursor[r] in
    [ptr[r], ptr[r + 1]] and order[j] >= row0 from cursor[r] on (read and written); row0 <= row1; n_acc. Each call
    returns distinct function objects, so every rendered module names its own kernel.
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
               p_cursor: cute.Pointer, row0: Int32, row1: Int32, n_acc: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        r = bidx * warps + warp
        if r < n_acc:                                       # warp-uniform
            j0 = (p_cursor + r).load()
            end = (p_ptr + (r + 1)).load()
            # the slice's run: order[j0 .. j1) < row1 (order increases within the group), 32 entries a step
            j1 = j0
            searching = j0 < end
            while searching:
                j = j1 + lane
                beyond = Int32(1)
                if j < end:
                    if (p_order + j).load() < row1:
                        beyond = Int32(0)
                mask = cute.arch.vote_ballot_sync(beyond != 0)
                if mask != 0:
                    j1 = j1 + Int32(cute.arch.popc((mask & (0 - mask)) - 1))   # before the first lane beyond
                    searching = cutlass.Boolean(False)
                else:
                    j1 = j1 + 32
            if j0 < j1:
                if lane == 0:
                    (p_cursor + r).store(j1)
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
                            mRow = row_vectors(p_rows, (p_order + (j + u)).load() - row0)
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
    def host(p_acc: cute.Pointer, p_rows: cute.Pointer, p_order: cute.Pointer, p_ptr: cute.Pointer,
             p_cursor: cute.Pointer, row0: Int32, row1: Int32, n_acc: Int32):
        kernel(p_acc, p_rows, p_order, p_ptr, p_cursor, row0, row1, n_acc).launch(
            grid=((n_acc + warps - 1) // warps, 1, 1), block=(warps * 32, 1, 1), smem=0)

    return BuiltKernel(params(), launch(warps_per_cta), kernel, host)
