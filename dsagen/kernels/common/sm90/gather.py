"""The gathered-row producer of the Hopper kernels: cp.async copies of row tiles into SW128 shared tiles, the
mbarrier ring that hands gathered tiles to the consumers, and the per-row operand loads.

Thread roles. One producer warpgroup (128 threads) runs every function here, as 16 groups of 8 threads
(`GatherLanes`): group `grp` owns rows grp + 16 i of a tile, and thread `col0` / 8 of the group one 16-byte chunk
of each 64-column block. A gathered tile is BN = 64 rows x D columns of a 16-bit dtype; row i of it is
`p_rows[ids[i]]` (ids from `ids.py`; -1: a zero-filled row, nothing read).

The ring (ring.py; `gather_ring_tile` fills one stage): the producer waits the stage's free mbarrier, issues the
tile's cp.asyncs and makes kv_ready[s] track their completion with one noinc arrival per thread (128); group
leaders may add metadata arrivals (`publish_tile_ids`: 16 more), so kv_ready's count is 128 + its metadata
arrivals. Consumers fence the async proxy after their wait (cp.async writes -> wgmma reads).
A per-row operand (Q) has its own pair: the producer waits q_free with parity (it % 2) ^ 1 for row `it` of the
CTA, cp.asyncs it and completes q_full (noinc); consumers wait q_full with parity it % 2 (`load_row_tile`).
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int8, Int32, Int64, const_expr
from cutlass.experimental import primitives as prims

from dsagen.kernels.common.sm90.layout import swizzled_byte_offset
from dsagen.kernels.common.sm90.ptx import cp_async_16_policy, l2_evict_first_policy
from dsagen.kernels.common.sm90.ring import ring_wait_free, ring_wait_ready


class GatherLanes(NamedTuple):
    """A producer thread's place in the gather (module docstring): its group and its column chunk."""
    tidx: Any       # the thread's index in the CTA (0..127: the producer warpgroup)
    grp: Any        # tidx // 8: the group, which owns rows grp + 16 i of every tile
    col0: Any       # (tidx % 8) * 8: the first of the thread's 8 elements (16 bytes) in every 64-column block


def gather_lanes(tidx) -> GatherLanes:
    """The GatherLanes of producer thread `tidx` (0..127)."""
    return GatherLanes(tidx=tidx, grp=tidx // 8, col0=(tidx % 8) * 8)


class RowGatherProducer(NamedTuple):
    """What a producer thread of a row-gathering kernel (a per-row operand tile plus a ring of gathered tiles)
    sets up once: its lanes, byte pointers to the operand tile and to the ring, its swizzled ring base, a register
    tensor for one tile's ids and the L2 policy of the per-row operand (read once: evict first)."""
    lanes: GatherLanes
    q_smem: Any          # byte pointer of the per-row operand tile
    kv_smem: Any         # byte pointer of the ring's tiles
    sw_kv: Any           # gather_base of the ring's layout
    ids: Any             # (BN / 16,) int32: the thread's rows of one tile
    policy: Any          # L2 evict_first policy for the per-row operand


def row_gather_producer(tidx, q_mem, kv_mem, lay_kv, bn: int) -> RowGatherProducer:
    """The RowGatherProducer of producer thread `tidx`: q_mem / kv_mem are the shared struct fields of the
    operand tile and of the ring (layout `lay_kv`), bn the tile's rows."""
    lanes = gather_lanes(tidx)
    q_smem = smem_bytes(q_mem)
    kv_smem = smem_bytes(kv_mem)
    sw_kv = gather_base(lay_kv, lanes)
    ids = cute.make_rmem_tensor(bn // 16, Int32)
    return RowGatherProducer(lanes=lanes, q_smem=q_smem, kv_smem=kv_smem, sw_kv=sw_kv, ids=ids,
                             policy=l2_evict_first_policy())


def smem_bytes(mem_range) -> cute.Pointer:
    """A byte pointer to a shared-memory struct field (`st.sQ`), the base the gathers address by byte."""
    return cute.recast_ptr(mem_range.data_ptr(), dtype=Int8)


def gather_base(lay, lanes: GatherLanes):
    """The swizzled byte offset of the thread's first chunk (row grp, column col0, stage 0) in a tile of layout
    `lay` (sw128's, 2 or 3 modes): every other chunk it gathers lies at a constant offset from it
    (gather_tile_rows)."""
    coord = (lanes.grp, lanes.col0) if const_expr(len(lay.outer.shape) == 2) else (lanes.grp, lanes.col0, 0)
    return swizzled_byte_offset(lay.outer(coord) * 2)


@cute.jit
def cp_async_rows(dst: cute.Pointer, lay, src: cute.Pointer, rows: int, width: int, grp, col0, policy,
                  blocks: tuple[int, int] | None = None) -> None:
    """cp.async `rows` rows of `width` elements (16-bit) from `src` (row-major, row stride `width`) into the SW128
    tile at byte pointer `dst` whose layout is `lay` (sw128's), with L2 cache policy `policy`: the 128 threads of a
    warpgroup in 16 groups of 8, group `grp` taking rows grp + 16 i and thread `col0` / 8 of the group one 16-byte
    chunk of each 64-column block (a 64 x D Q tile of the attention kernels); `blocks`: only the 64-column blocks
    [blocks[0], blocks[1]) (None: all)."""
    cp_async_tiles_rows(((dst, lay, src, width, blocks),), rows, grp, col0, policy)


@cute.jit
def cp_async_tiles_rows(tiles, rows: int, grp, col0, policy) -> None:
    """cp_async_rows for several tiles of the same rows (an item's Q and dO), row by row: for each of the thread's
    rows, every tile's chunks in the order given. tiles: ((dst, lay, src, width, blocks), ...) as cp_async_rows
    takes them. Issuing by row keeps one row's addresses live, not a whole tile's (the kernels' producers run on
    a few dozen registers)."""
    for i in cutlass.range_constexpr(rows // 16):
        r = grp + 16 * i
        for t in cutlass.range_constexpr(len(tiles)):
            dst, lay, src, width, blocks = tiles[t]
            kb0, kb1 = (0, width // 64) if const_expr(blocks is None) else blocks
            for kb in cutlass.range_constexpr(kb0, kb1):
                b = lay.outer((r, kb * 64 + col0)) * 2
                cp_async_16_policy(dst + swizzled_byte_offset(b), src + (r * width + kb * 64 + col0), policy)


@cute.jit
def gather_tile_rows(dst: cute.Pointer, sw_base, lay, p_rows: cute.Pointer, ld, ids, col0, blocks: tuple[int, int],
                     stage: int = 0, rows: tuple[int, int] | None = None, n_rows=None) -> None:
    """cp.async the gathered rows grp + 16 i (i < len(ids)) of a KV tile: row i is p_rows[ids[i]] (row stride `ld`),
    zero-filled (nothing read, from a legal address) when ids[i] < 0; column blocks [blocks[0], blocks[1]) of 64;
    `stage`: the tile's stage in `lay` (a (rows, D[, stages]) sw128 layout). `dst` is the tile's byte pointer and
    `sw_base` the thread's swizzled byte offset of (grp, col0) (gather_base): the 128B swizzle XORs byte bits 4-6
    with bits 7-9 = row % 8, which is grp % 8 for every row grp + 16 i, and the row-group, column-block and stage
    offsets only touch bits >= 10, so each chunk lies at a constant offset from it. rows = (first, count): the tile's
    ids are ids[first .. first + count) (None: all of `ids`). n_rows: the ids are raw, and one outside [0, n_rows)
    is zero-filled too (None: they were checked, ids.valid_tile_ids)."""
    first, count = (0, cute.size(ids)) if const_expr(rows is None) else rows
    for i in cutlass.range_constexpr(count):
        kv = ids[first + i]
        ok = kv >= 0
        if const_expr(n_rows is not None):
            ok = kv >= 0 and kv < n_rows
        src = p_rows + Int64(kv if ok else 0) * ld
        nbytes = Int32(16) if ok else Int32(0)
        for kb in cutlass.range_constexpr(*blocks):
            coord = (16 * i, kb * 64) if const_expr(len(lay.outer.shape) == 2) else (16 * i, kb * 64, stage)
            prims.cp_async_shared_global(dst + (sw_base + lay.outer(coord) * 2), src + (kb * 64 + col0), 16, "cg",
                                         cp_size=nbytes)


@cute.jit
def gather_ring_tile(dst: cute.Pointer, sw_base, lay, p_rows: cute.Pointer, ld, ids, col0, blocks: tuple[int, int],
                     g, stages: int, kv_ready, kv_free) -> None:
    """Tile g of a gather ring (stage g % stages): wait until the consumers freed the stage (kv_free, parity of the
    ring's round), cp.async the tile's rows into it (gather_tile_rows; ids -1: zero-filled) and make kv_ready of the
    stage track their arrival (a noinc arrival per thread)."""
    s = g % stages
    ring_wait_free(kv_free, g, stages)
    gather_tile_rows(dst, sw_base, lay, p_rows, ld, ids, col0, blocks, stage=s)
    cute.arch.cp_async_mbarrier_arrive_noinc(kv_ready + s)


@cute.jit
def wait_gathered_tile(ready, g, stages: int) -> None:
    """Consumer side of a gather ring: wait until tile g is in its stage (ring.ring_wait_ready), then fence the
    async proxy, so that the producer's cp.async writes are visible to the wgmma reads that follow."""
    ring_wait_ready(ready, g, stages)
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def publish_tile_ids(sIds: cute.Tensor, base, ids, lanes: GatherLanes, mbar) -> None:
    """The group leaders (tidx % 8 == 0) store their rows' ids into sIds[base + grp + 16 i] and arrive once on
    `mbar` (16 arrivals per tile in all), after which a consumer that waited on `mbar` reads them."""
    if lanes.tidx % 8 == 0:
        for i in cutlass.range_constexpr(cute.size(ids)):
            sIds[base + lanes.grp + 16 * i] = ids[i]
        cute.arch.mbarrier_arrive(mbar)


@cute.jit
def load_row_tile(dst: cute.Pointer, lay, src: cute.Pointer, rows: int, width: int, lanes: GatherLanes, policy,
                  it, free_mbar, full_mbar, per_block: bool = False) -> None:
    """Row `it` of the CTA's operand ring of depth one (module docstring): wait until the consumers freed the buffer
    (free_mbar, parity (it % 2) ^ 1), cp.async the `rows` x `width` tile at `src` into it (cp_async_rows, with L2
    cache policy `policy`) and complete full_mbar with the copies (a noinc arrival per thread). per_block: one
    full mbarrier per 64-column block (full_mbar + kb), so that a consumer starts on the first blocks."""
    cute.arch.mbarrier_wait(free_mbar, (it % 2) ^ 1)
    if const_expr(per_block):
        for kb in cutlass.range_constexpr(width // 64):
            cp_async_rows(dst, lay, src, rows, width, lanes.grp, lanes.col0, policy, blocks=(kb, kb + 1))
            cute.arch.cp_async_mbarrier_arrive_noinc(full_mbar + kb)
    else:
        cp_async_rows(dst, lay, src, rows, width, lanes.grp, lanes.col0, policy)
        cute.arch.cp_async_mbarrier_arrive_noinc(full_mbar)
