"""Test-only probe kernels, one per runtime capability that the runtime's own GPU tests launch.

  tma:     out[r, c] = alpha * x[r, c]; each CTA TMA-loads a 32x32 fp32 tile through a runtime CUtensorMap.
  smem:    out[i] = x[block_start + (CHUNK - 1 - j)], chunk-reversed through `smem_bytes` B of dynamic smem
           (CHUNK = smem_bytes / 4 floats per CTA).
  cluster: out[b] = 1000 * cluster_id + rank of CTA b in its 2x1x1 cluster, after a cluster barrier.

`build(feature, smem_bytes)` returns a fresh kernel and host entry for one feature, plus the flat ABI
(`params`), the launch declaration (`launch`) and, where host takes other arguments than the kernel (the tma
probe builds its TensorMap from a pointer), `host_args`.
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
from cutlass import Float32, Int32, Int64
from cutlass.experimental import primitives as prims

BOX = 32         # tma: the tile is BOX x BOX fp32
TMA_THREADS = 128
SMEM_THREADS = 256
CLUSTER_THREADS = 64


class RuntimeProbe(NamedTuple):
    """A built probe kernel: the rendered module's PARAMS, LAUNCH, kernel and host, then HOST_ARGS (None when
    host takes the kernel's PARAMS)."""

    params: list[dict]
    launch: dict
    kernel: Any
    host: Any
    host_args: list[dict] | None


def build(feature: str, smem_bytes: int = 0) -> RuntimeProbe:
    """A new probe kernel for `feature` ("tma", "smem" or "cluster"); `smem_bytes` (a multiple of 1024 in
    (48 KiB, 227 KiB]) is the smem probe's dynamic shared memory and is ignored by the others. Each call
    returns distinct function objects, so every rendered module names its own kernel."""
    if feature == "tma":
        return build_tma()
    if feature == "smem":
        return build_smem(smem_bytes)
    if feature == "cluster":
        return build_cluster()
    raise ValueError(f"feature={feature!r} must be one of 'tma', 'smem', 'cluster'")


def build_tma() -> RuntimeProbe:
    """out (rows, cols) fp32, row stride ld_out = alpha * x (rows, cols) fp32, row stride ld_x (a multiple of
    4 elements; x 16-byte aligned). The kernel takes x as a TensorMap (box 32 x 32, no swizzle, no OOB fill),
    which host builds from the pointer: grid (ceil(cols / 32), ceil(rows / 32)), 128 threads, 32 * 32 * 4 + 8
    bytes of smem (the tile and its mbarrier)."""
    params = [
        {"name": "tmap_x", "kind": "tensormap",
         "encode": {"dtype": "float32", "box": [BOX, BOX], "element_strides": [1, 1], "interleave": "NONE",
                    "swizzle": "NONE", "l2_promotion": "L2_128B", "oob_fill": "NONE"}},
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},
        {"name": "rows", "kind": "i32"},
        {"name": "cols", "kind": "i32"},
        {"name": "ld_out", "kind": "i64"},
        {"name": "alpha", "kind": "f32"},
    ]
    host_args = [
        {"name": "x", "kind": "ptr", "dtype": "float32", "align": 16},
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},
        {"name": "rows", "kind": "i32"},
        {"name": "cols", "kind": "i32"},
        {"name": "ld_x", "kind": "i32"},
        {"name": "ld_out", "kind": "i64"},
        {"name": "alpha", "kind": "f32"},
    ]
    launch = {"grid": [f"ceil_div(cols, {BOX})", f"ceil_div(rows, {BOX})", 1], "block": [TMA_THREADS, 1, 1],
              "cluster": [1, 1, 1], "smem": BOX * BOX * 4 + 8}

    @cute.kernel
    def kernel(tmap_x: cutlass.GridConstant[xcuda.TensorMap], p_out: cute.Pointer, rows: Int32, cols: Int32,
               ld_out: Int64, alpha: Float32):
        tile = cutlass.Array(Float32, BOX * BOX, space=cutlass.AddressSpace.smem, alignment=128)
        mbar = cutlass.Array(Int64, 1, space=cutlass.AddressSpace.smem, alignment=8)
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        if warp == 0:
            if prims.elect_sync():
                prims.mbarrier_init(mbar, 1)
        prims.fence_mbarrier_init()
        prims.barrier_cta_sync(0)
        if warp == 0:
            if prims.elect_sync():
                prims.mbarrier_arrive_expect_tx(mbar, BOX * BOX * 4)
                prims.cp_async_bulk_tensor_shared_cta_global(tile, tmap_x.get_ptr(), (bx * BOX, by * BOX), mbar)
        while not prims.mbarrier_try_wait_parity(mbar, 0, time_limit=10_000_000):
            pass
        out = cute.make_tensor(p_out, cute.make_layout((rows, cols), stride=(ld_out, 1)))
        for it in cutlass.range(BOX * BOX // TMA_THREADS, unroll=1):
            e = it * TMA_THREADS + tidx
            r = by * BOX + e // BOX
            c = bx * BOX + e % BOX
            if r < rows and c < cols:
                out[r, c] = tile[e] * alpha

    @cute.jit
    def host(p_x: cute.Pointer, p_out: cute.Pointer, rows: Int32, cols: Int32, ld_x: Int32, ld_out: Int64,
             alpha: Float32):
        desc = xcuda.create_tensor_map_tiled(
            global_address=p_x.toint(), dtype=Float32, global_dims=[cols, rows], global_strides=[ld_x * 4 // 16],
            box_dims=[BOX, BOX], swizzle=xcuda.TensorMapSwizzle.none)
        kernel(desc, p_out, rows, cols, ld_out, alpha).launch(
            grid=((cols + BOX - 1) // BOX, (rows + BOX - 1) // BOX, 1), block=(TMA_THREADS, 1, 1))

    return RuntimeProbe(params, launch, kernel, host, host_args)


def build_smem(smem_bytes: int) -> RuntimeProbe:
    """out (n,) fp32 = x (n,) fp32 reversed within chunks of smem_bytes / 4 elements, staged through
    `smem_bytes` (a multiple of 1024 in (48 KiB, 227 KiB]) of dynamic smem: grid ceil(n / chunk), 256 threads."""
    chunk = smem_bytes // 4

    @cute.struct
    class Smem:
        buf: cute.struct.Align[cute.struct.MemRange[Float32, chunk], 1024]

    params = [
        {"name": "x", "kind": "ptr", "dtype": "float32", "align": 4},
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},
        {"name": "n", "kind": "i64"},
    ]
    launch = {"grid": [f"ceil_div(n, {chunk})", 1, 1], "block": [SMEM_THREADS, 1, 1], "cluster": [1, 1, 1],
              "smem": smem_bytes}

    @cute.kernel
    def kernel(p_x: cute.Pointer, p_out: cute.Pointer, n: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        st = cutlass.memory.SmemAllocator().allocate(Smem)
        s = st.buf.get_tensor(cute.make_layout(chunk))
        x = cute.make_tensor(p_x, cute.make_layout(n))
        out = cute.make_tensor(p_out, cute.make_layout(n))
        start = Int64(bidx) * chunk
        for j in cutlass.range(tidx, chunk, SMEM_THREADS, unroll=1):
            v = Float32(0.0)
            if start + j < n:
                v = x[start + j]
            s[j] = v
        cute.arch.sync_threads()
        for j in cutlass.range(tidx, chunk, SMEM_THREADS, unroll=1):
            if start + j < n:
                out[start + j] = s[chunk - 1 - j]

    @cute.jit
    def host(p_x: cute.Pointer, p_out: cute.Pointer, n: Int64):
        kernel(p_x, p_out, n).launch(grid=((n + chunk - 1) // chunk, 1, 1), block=(SMEM_THREADS, 1, 1),
                                     smem=Smem.size_in_bytes())

    return RuntimeProbe(params, launch, kernel, host, None)


def build_cluster() -> RuntimeProbe:
    """out (n_blocks,) int32: CTA b writes 1000 * cluster_id + its rank in a 2x1x1 cluster after a cluster
    barrier; grid n_blocks (even), 64 threads, cluster (2, 1, 1)."""
    params = [
        {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},
        {"name": "n_blocks", "kind": "i32"},
    ]
    launch = {"grid": ["n_blocks", 1, 1], "block": [CLUSTER_THREADS, 1, 1], "cluster": [2, 1, 1], "smem": 0}

    @cute.kernel
    def kernel(p_out: cute.Pointer, n_blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        cid, _, _ = cute.arch.cluster_idx()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        out = cute.make_tensor(p_out, cute.make_layout(n_blocks))
        if tidx == 0:
            out[bidx] = cid * 1000 + rank

    @cute.jit
    def host(p_out: cute.Pointer, n_blocks: Int32):
        kernel(p_out, n_blocks).launch(grid=(n_blocks, 1, 1), block=(CLUSTER_THREADS, 1, 1), cluster=(2, 1, 1))

    return RuntimeProbe(params, launch, kernel, host, None)
