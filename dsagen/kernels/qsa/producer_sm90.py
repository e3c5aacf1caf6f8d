"""The QSA kernels' shared memory and producer warpgroup on sm_90a, shared by the forward (fwd_sm90.py) and the
backward's dq and dk / dv kernels (bwd_sm90.py): all three walk the same work items, (query token t, KV head g), one
per CTA, and gather the same tiles, so the backward's tiles are exactly the forward's.

Per item the producer warpgroup (128 threads, gather.py's 16 groups of 8) gathers the item's per-row operands once
into 64-row tiles (rows grp + 16 i of t's G query heads of g; rows G..63 zero-filled): Q for the forward, Q and dO
for the backward, completing q_full with one noinc cp.async arrival per thread. Then per tile of BN = 64 slots: its
ids (the indexed form: the row's slots, -1 past the width; the bitmap form: the tokens of its 16 next selected
four-token blocks, found in the query's bitmap row between producer barriers, n_tiles published in sN on
list_full), the K rows (an id outside [0, T) zero-filled), the ids into the stage's id slots (the group leaders, 16
more arrivals on k_ready) and the V rows, through a ring of `stages` stages: k_ready[s] (128 noinc cp.async arrivals
+ 16), v_ready[s] (128 noinc), kv_free[s] (one arrival per consumer warp, CONSUMER_WARPS).
"""
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.gather import gather_base, gather_lanes, gather_tile_rows, publish_tile_ids, \
    smem_bytes
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.ring import ring_wait_free
from dsagen.kernels.common.sm90.sequences import token_range

M = 64                      # rows of an item's operand tiles (wgmma M or N): one query's G heads, then zero padding
BN = 64                     # index slots per tile
PUBLISH_ARRIVALS = 16       # publish_tile_ids: one arrival per group leader
CONSUMER_WARPS = 4          # kv_free's arrivals: lane 0 of each consumer warp
BLOCKS_PER_TILE = BN // 4   # the bitmap form's four-token blocks per tile
BAR_PRODUCER = 1            # named barrier of the producer warpgroup's 128 threads (the bitmap form's search)
NI = BN // 16               # tile rows per producer group
NQ = M // 16                # operand rows per producer group
NTHREADS = 256              # the producer warpgroup, then the consumer warpgroup


def select_params(bitmap: bool) -> list[dict]:
    """The pointer parameters of the item's selection (a new list on every call): the index rows, or the bitmap
    form's bitmap, packed offsets and first blocks."""
    if bitmap:
        return [
            {"name": "bm", "kind": "ptr", "dtype": "uint8", "align": 1},        # [T, NB] block bitmap, row stride bm_st
            {"name": "cu", "kind": "ptr", "dtype": "int32", "align": 4},        # [n_docs + 1] packed offsets
            {"name": "blk0", "kind": "ptr", "dtype": "int32", "align": 4},      # [n_docs + 1] first block per sequence
        ]
    return [{"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4}]       # [T, W], row stride idx_st


def select_scalar_params(bitmap: bool) -> list[dict]:
    """The scalar parameters of the item's selection, placed after n_tok and n_kv (a new list on every call)."""
    if bitmap:
        return [
            {"name": "n_docs", "kind": "i32"},                                  # 0: one sequence of T tokens
            {"name": "n_blocks", "kind": "i32"},                                # NB (no column past it is read)
            {"name": "bm_st", "kind": "i64"},
        ]
    return [
        {"name": "width", "kind": "i32"},                                       # W
        {"name": "idx_st", "kind": "i64"},
    ]


def make_smem(dtype, head_dim: int, v_dim: int, stages: int, with_do: bool):
    """The kernels' shared-memory struct: mbarriers, the tiles' ids, the bitmap form's search state, then (1024-byte
    aligned) the 64-row Q tile, with_do the 64-row dO tile, and the K and V rings of `stages` 64-row tiles."""
    D, DV, ST, DT = head_dim, v_dim, stages, dtype

    @cute.struct
    class Smem:
        q_full: cute.struct.MemRange[cutlass.Int64, 1]
        k_ready: cute.struct.MemRange[cutlass.Int64, ST]
        v_ready: cute.struct.MemRange[cutlass.Int64, ST]
        kv_free: cute.struct.MemRange[cutlass.Int64, ST]
        ids: cute.struct.MemRange[Int32, BN * ST]          # the tiles' ids, per stage
        list_full: cute.struct.MemRange[cutlass.Int64, 1]  # bitmap form: n_tiles is in sN
        sN: cute.struct.MemRange[Int32, 4]                 # bitmap form: the item's tile count
        sCnt: cute.struct.MemRange[Int32, 4]               # bitmap form: selected blocks per producer warp
        sBlk: cute.struct.MemRange[Int32, BLOCKS_PER_TILE + 1]   # bitmap form: a tile's blocks, then the cursor
        sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D], 1024]
        if with_do:
            sdO: cute.struct.Align[cute.struct.MemRange[DT, M * DV], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * ST], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[DT, BN * DV * ST], 1024]

    return Smem


class ItemCoords(NamedTuple):
    """The calling thread's place: its index in the CTA, warp, warpgroup, lane, and the CTA's item (t, g)."""
    tidx: Any
    warp: Any
    wg: Any
    lane: Any
    t: Any
    g: Any


class ItemTiles(NamedTuple):
    """A consumer's views of the item's shared tiles (QsaProducer.tiles): the operand tiles (sdO None without it),
    the rings (their last mode the stage), the ids per stage and the ring's mbarriers."""
    sQ: Any              # (64 head rows, D)
    sdO: Any             # (64 head rows, Dv)
    sK: Any              # (BN slots, D, stage)
    sV: Any              # (BN slots, Dv, stage)
    sIds: Any            # (BN * stages,): tile slot n of stage s at s BN + n
    k_ready: Any
    v_ready: Any
    kv_free: Any


class QsaProducer(NamedTuple):
    """The producer side of one QSA kernel (make_producer): its @cute.jit functions."""
    item_coords: Any       # (n_tok) -> ItemCoords; block bid = g T + t, so the tokens of one head are neighbours
    init_barriers: Any     # (warp, st): the mbarriers, then a CTA barrier
    indexed: Any           # (st, tidx, t, g, rows, p_k, p_v, p_idx, n_tok, width, idx_st, k_st, v_st, n_tiles)
    bitmap: Any            # (st, tidx, t, g, rows, p_k, p_v, p_bm, p_cu, p_blk0, n_tok, n_docs, n_blocks, bm_st,
    #                         k_st, v_st)
    bitmap_tiles: Any      # (st) -> n_tiles: the consumer's wait for the bitmap form's tile count
    tiles: Any             # (st) -> ItemTiles


def make_producer(group: int, head_dim: int, v_dim: int, stages: int, dtype) -> QsaProducer:
    """The producer functions of a kernel with G = group, D = head_dim, Dv = v_dim, `stages` ring stages and 16-bit
    `dtype`. `rows`, the per-row operands gathered once per item: ((p_q, q_st),) or ((p_q, q_st), (p_do, do_st))
    (the struct then has sdO): token-strided [T, Hq, D] / [T, Hq, Dv] rows, heads D (Dv) apart."""
    G, D, DV, ST, DT = group, head_dim, v_dim, stages, dtype
    ROW_TILES = (("sQ", D), ("sdO", DV))       # the per-row operands' struct fields and widths, in `rows` order

    def item_coords(n_tok) -> ItemCoords:
        """The calling thread's ItemCoords (trace-time Python: inlined into the kernel like a @cute.jit helper)."""
        coords = cta_coords()
        g = coords.bidx // n_tok
        return ItemCoords(tidx=coords.tidx, warp=coords.warp, wg=coords.wg, lane=cute.arch.lane_idx(),
                          t=coords.bidx - g * n_tok, g=g)

    def tiles(st) -> ItemTiles:
        """The consumer's ItemTiles of the struct `st` (trace-time views, no instructions)."""
        lq, ldo = sw128(DT, (M, D)), sw128(DT, (M, DV))
        lk, lv = sw128(DT, (BN, D, ST)), sw128(DT, (BN, DV, ST))
        sdO = st.sdO.get_tensor(ldo.outer, swizzle=ldo.inner) if hasattr(st, "sdO") else None
        return ItemTiles(sQ=st.sQ.get_tensor(lq.outer, swizzle=lq.inner), sdO=sdO,
                         sK=st.sK.get_tensor(lk.outer, swizzle=lk.inner),
                         sV=st.sV.get_tensor(lv.outer, swizzle=lv.inner),
                         sIds=st.ids.get_tensor(cute.make_layout(BN * ST)), k_ready=st.k_ready.data_ptr(),
                         v_ready=st.v_ready.data_ptr(), kv_free=st.kv_free.data_ptr())

    @cute.jit
    def init_barriers(warp, st):
        """The mbarriers, by one elected thread of warp 0, then the init fence and a CTA barrier."""
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(st.q_full.data_ptr(), 128)
                cute.arch.mbarrier_init(st.list_full.data_ptr(), 1)
                for i in cutlass.range_constexpr(ST):
                    cute.arch.mbarrier_init(st.k_ready.data_ptr() + i, 128 + PUBLISH_ARRIVALS)
                    cute.arch.mbarrier_init(st.v_ready.data_ptr() + i, 128)
                    cute.arch.mbarrier_init(st.kv_free.data_ptr() + i, CONSUMER_WARPS)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    @cute.jit
    def load_rows(st, lanes, t, g, rows):
        """The item's per-row operands (Q, then dO when `rows` has two entries): rows grp + 16 i of the G heads
        (t, g G ..), the rest zero-filled; completes q_full."""
        qids = cute.make_rmem_tensor(NQ, Int32)
        for i in cutlass.range_constexpr(NQ):
            r = lanes.grp + 16 * i
            qids[i] = r if r < G else Int32(-1)
        for o in cutlass.range_constexpr(len(rows)):
            name, width = ROW_TILES[o]
            mem = getattr(st, name)
            lay = sw128(DT, (M, width))
            src = rows[o][0] + (Int64(t) * rows[o][1] + g * (G * width))
            gather_tile_rows(smem_bytes(mem), gather_base(lay, lanes), lay, src, width, qids, lanes.col0,
                             (0, width // 64))
        cute.arch.cp_async_mbarrier_arrive_noinc(st.q_full.data_ptr())

    @cute.jit
    def gather_tile(st, lanes, j, ids, k_rows, v_rows, k_st, v_st, n_tok):
        """Tile j (stage j % ST) of the ring: once the stage is free, the K rows of `ids` (the thread's rows), the
        ids into the stage's id slots, the V rows (an id outside [0, T) zero-filled)."""
        lk, lv = sw128(DT, (BN, D, ST)), sw128(DT, (BN, DV, ST))
        sIds = st.ids.get_tensor(cute.make_layout(BN * ST))
        k_ready, v_ready, kv_free = st.k_ready.data_ptr(), st.v_ready.data_ptr(), st.kv_free.data_ptr()
        s = j % ST
        ring_wait_free(kv_free, j, ST)
        gather_tile_rows(smem_bytes(st.sK), gather_base(lk, lanes), lk, k_rows, k_st, ids, lanes.col0, (0, D // 64),
                         stage=s, n_rows=n_tok)
        cute.arch.cp_async_mbarrier_arrive_noinc(k_ready + s)
        publish_tile_ids(sIds, s * BN, ids, lanes, k_ready + s)
        gather_tile_rows(smem_bytes(st.sV), gather_base(lv, lanes), lv, v_rows, v_st, ids, lanes.col0, (0, DV // 64),
                         stage=s, n_rows=n_tok)
        cute.arch.cp_async_mbarrier_arrive_noinc(v_ready + s)

    @cute.jit
    def indexed(st, tidx, t, g, rows, p_k, p_v, p_idx, n_tok, width, idx_st, k_st, v_st, n_tiles):
        """The indexed form's gathers of one item: the per-row operands, then per tile its 64 slots' ids (slots past
        W: -1)."""
        lanes = gather_lanes(tidx)
        load_rows(st, lanes, t, g, rows)
        idx_row = p_idx + Int64(t) * idx_st
        ids = cute.make_rmem_tensor(NI, Int32)
        for j in cutlass.range(n_tiles, unroll=1):
            for i in cutlass.range_constexpr(NI):
                slot = j * BN + lanes.grp + 16 * i
                u = Int32(-1)
                if slot < width:
                    u = (idx_row + slot).load()
                ids[i] = u
            gather_tile(st, lanes, j, ids, p_k + g * D, p_v + g * DV, k_st, v_st, n_tok)

    @cute.jit
    def producer_sum(st, warp, lane, x):
        """The sum of x over the 128 producer threads, given to all of them (warp shuffles, then the warps' sums in
        sCnt between two producer barriers)."""
        sCnt = st.sCnt.get_tensor(cute.make_layout(4))
        for sh in cutlass.range_constexpr(5):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << sh)
        if lane == 0:
            sCnt[warp] = x
        cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=128)
        total = sCnt[0] + sCnt[1] + sCnt[2] + sCnt[3]
        cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=128)
        return total

    @cute.jit
    def warp_counts(st, warp, lane, wcnt):
        """(the count of the producer warps before this one, of all four) of each warp's `wcnt`: the counts in sCnt,
        then a producer barrier; the caller syncs the producer again before sCnt is written next."""
        sCnt = st.sCnt.get_tensor(cute.make_layout(4))
        if lane == 0:
            sCnt[warp] = wcnt
        cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=128)
        c0, c1, c2, c3 = sCnt[0], sCnt[1], sCnt[2], sCnt[3]
        before = Int32(0)
        if warp > 0:
            before = before + c0
        if warp > 1:
            before = before + c1
        if warp > 2:
            before = before + c2
        return before, c0 + c1 + c2 + c3

    @cute.jit
    def bitmap(st, tidx, t, g, rows, p_k, p_v, p_bm, p_cu, p_blk0, n_tok, n_docs, n_blocks, bm_st, k_st, v_st):
        """The bitmap form's gathers of one item. Query t of the sequence starting at s0 selects its blocks
        b = 0 .. own = (t - s0) // 4 whose byte bm[t, blk0[seq] + b] is nonzero (columns past NB, or before 0, are
        never read: a bitmap narrower than the offsets say selects nothing there); block b holds tokens
        s0 + 4 b + c, c < 4, of which those <= t count. A first pass counts the selected blocks (n_tiles =
        ceil(count / 16), published in sN on list_full); then each tile's 16 blocks are the next selected ones in
        ascending order, found 128 blocks at a time (a ballot per warp, the warps' counts in sCnt, the blocks in
        sBlk), and the tile's 64 rows are their tokens."""
        lanes = gather_lanes(tidx)
        warp, lane = tidx // 32, tidx % 32
        load_rows(st, lanes, t, g, rows)
        s0, _, seq = token_range(p_cu, n_docs, n_tok, t)
        base = (p_blk0 + seq).load()
        own = cutlass.min((t - s0) // 4, n_blocks - 1 - base)
        if base < 0:
            own = Int32(-1)
        row = p_bm + (Int64(t) * bm_st + base)
        # pass 1: the number of selected blocks
        cnt = Int32(0)
        for b in cutlass.range(tidx, own + 1, 128, unroll=1):
            if (row + b).load() != 0:
                cnt += 1
        n_sel = producer_sum(st, warp, lane, cnt)
        n_tiles = (n_sel + BLOCKS_PER_TILE - 1) // BLOCKS_PER_TILE
        sN = st.sN.get_tensor(cute.make_layout(4))
        sBlk = st.sBlk.get_tensor(cute.make_layout(BLOCKS_PER_TILE + 1))
        if tidx == 0:
            sN[0] = n_tiles
            cute.arch.mbarrier_arrive(st.list_full.data_ptr())
        lt_mask = cute.arch.lanemask_lt()
        ids = cute.make_rmem_tensor(NI, Int32)
        cursor = Int32(0)                      # the first block not yet looked at
        for j in cutlass.range(n_tiles, unroll=1):
            found = Int32(0)
            while found < BLOCKS_PER_TILE and cursor <= own:
                b = cursor + tidx
                sel = Int32(0)
                if b <= own:
                    if (row + b).load() != 0:
                        sel = Int32(1)
                ballot = cute.arch.vote_ballot_sync(sel != 0)
                before, total = warp_counts(st, warp, lane, Int32(cute.arch.popc(ballot)))
                rank = found + before + Int32(cute.arch.popc(ballot & lt_mask))
                if sel != 0:
                    if rank < BLOCKS_PER_TILE:
                        sBlk[rank] = b
                    if rank == BLOCKS_PER_TILE - 1:
                        sBlk[BLOCKS_PER_TILE] = b + 1          # the next tile looks on after it
                cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=128)   # sBlk written, sCnt read
                if found + total >= BLOCKS_PER_TILE:
                    cursor = sBlk[BLOCKS_PER_TILE]
                    found = Int32(BLOCKS_PER_TILE)
                else:
                    cursor = cursor + 128
                    found = found + total
            for i in cutlass.range_constexpr(NI):
                r = lanes.grp + 16 * i
                u = Int32(-1)
                if r // 4 < found:
                    u = s0 + 4 * sBlk[r // 4] + r % 4
                    if u > t:
                        u = Int32(-1)
                ids[i] = u
            # every thread read sBlk before the next tile's search writes it (its first barrier)
            gather_tile(st, lanes, j, ids, p_k + g * D, p_v + g * DV, k_st, v_st, n_tok)

    @cute.jit
    def bitmap_tiles(st):
        cute.arch.mbarrier_wait(st.list_full.data_ptr(), 0)
        return st.sN.get_tensor(cute.make_layout(4))[0]

    return QsaProducer(item_coords=item_coords, init_barriers=init_barriers, indexed=indexed, bitmap=bitmap,
                       bitmap_tiles=bitmap_tiles, tiles=tiles)


class KernelParts(NamedTuple):
    """What every QSA kernel's build() starts from (kernel_parts)."""
    dtype: Any           # the cutlass 16-bit element type
    fp16: bool
    Smem: Any            # make_smem's struct
    smem_bytes: int
    prod: QsaProducer


def kernel_parts(group: int, head_dim: int, v_dim: int, dtype: str, stages: int, with_do: bool) -> KernelParts:
    """The element type, shared-memory struct (with_do: the backward's dO tile) and producer of a QSA kernel."""
    dt = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    smem = make_smem(dt, head_dim, v_dim, stages, with_do)
    return KernelParts(dtype=dt, fp16=dtype == "float16", Smem=smem, smem_bytes=smem.size_in_bytes(),
                       prod=make_producer(group, head_dim, v_dim, stages, dt))


def make_item(parts: KernelParts, bitmap: bool, regs: tuple[int, int], consumer):
    """The body of a QSA kernel (the CTA's one item): coordinates, shared memory, mbarriers, then the producer
    warpgroup (setmaxnreg regs[0]) gathers the per-row operands `rows` and the tiles of the form's selection `sel`,
    and the consumer warpgroup (regs[1]) runs consumer(st, ctid, lane, t, g, n_tiles, *cargs). sel: (p_idx, width,
    idx_st) for the indexed form, (p_bm, p_cu, p_blk0, n_docs, n_blocks, bm_st) for the bitmap form, whose tile
    count the consumer waits for."""
    prod, smem = parts.prod, parts.Smem

    @cute.jit
    def run_item(rows, p_k, p_v, sel, n_tok, k_st, v_st, cargs):
        c = prod.item_coords(n_tok)
        n_tiles = Int32(0)
        if const_expr(not bitmap):
            n_tiles = (sel[1] + BN - 1) // BN
        st = cutlass.memory.SmemAllocator().allocate(smem)
        prod.init_barriers(c.warp, st)
        if c.wg == 0:
            cute.arch.setmaxregister_decrease(regs[0])
            if const_expr(bitmap):
                prod.bitmap(st, c.tidx, c.t, c.g, rows, p_k, p_v, sel[0], sel[1], sel[2], n_tok, sel[3], sel[4],
                            sel[5], k_st, v_st)
            else:
                prod.indexed(st, c.tidx, c.t, c.g, rows, p_k, p_v, sel[0], n_tok, sel[1], sel[2], k_st, v_st,
                             n_tiles)
        else:
            cute.arch.setmaxregister_increase(regs[1])
            if const_expr(bitmap):
                consumer(st, c.tidx - 128, c.lane, c.t, c.g, prod.bitmap_tiles(st), *cargs)
            else:
                consumer(st, c.tidx - 128, c.lane, c.t, c.g, n_tiles, *cargs)

    return run_item


def launch_declaration(smem: int) -> dict:
    """The rendered module's LAUNCH: one CTA per (token, KV head), 256 threads, `smem` dynamic bytes."""
    return {"grid": ["n_tok * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": smem}


def launch_config(n_tok, n_kv, smem: int) -> dict:
    """The host's launch arguments of a QSA kernel: one CTA per (token, KV head), one CTA per SM."""
    return dict(grid=(n_tok * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=smem, min_blocks_per_mp=1,
                preferred_smem_carveout=100)
