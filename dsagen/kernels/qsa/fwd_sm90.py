"""QSA forward on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one QsaFwdSpec.

For query token t and query head hq of KV head g = hq // G (FlashInfer QSA's `qsa_indexed_forward` and bitmap API,
the reference dsagen/reference/qsa.py):

    s_j          = scale * q[t, hq] . k[u_j, g]          for the slots j whose id u_j = idx[t, j] lies in [0, T)
    out[t, hq]   = sum_j exp(s_j - lse) v[u_j, g],   lse[hq, t] = log sum_j exp(s_j)    (natural log)

every other slot (-1 padding, ids out of range) skipped; a row without a valid slot gives out = 0 and lse = -inf;
a repeated id counts once per slot. Outputs: out in q's dtype and out32 in FP32 ([T, Hq, Dv] each), lse [Hq, T].
The bitmap form (bitmap=True) makes the slots itself: t's selected causal four-token blocks of its sequence in
ascending order, four slots each, the own block's tokens after t empty (bitmap_producer), so both forms give the
same bytes on the same blocks listed in that order.

Work item = (query token t, KV head g), one per CTA, the tokens of one head neighbours (their selections overlap in
L2): the 64 rows of the wgmma tile are t's G query heads of g (rows G..63 multiply zeros and are not stored). The
item's slots go in tiles of BN = 64 (the last one partial).
  Producer warpgroup (128 threads, gather.py's groups of 8): the Q rows once (cp.async, rows past G zero-filled),
  then per tile its 64 ids (indexed: the row's slots, past the width -1; bitmap: the tokens of the tile's 16
  blocks, found in the query's bitmap row between producer barriers), the listed tokens' K rows (zero-filled when the id is outside
  [0, T)), the ids into the stage's id slots (the group leaders, 16 more arrivals on k_ready) and the V rows, through
  a ring of `stages` stages: k_ready[s] (128 noinc cp.async arrivals + 16), v_ready[s] (128 noinc), kv_free[s] (one
  arrival per consumer warp, after the tile's PV retired).
  Consumer warpgroup: per tile S = Q K^T (SS wgmma, K-major), the masked online softmax in the log2 domain (a column
  whose id is outside [0, T) is -inf), O += P V (P from registers, V^T MN-major). The next tile's S is issued before
  this tile's PV and waited with the PV in flight, so its softmax runs under the PV; O is rescaled and P replaced
  after the PV retired (NSA's select forward does the same). Every row's sums run in slot order: the same inputs give
  the same bytes on every call, and nothing outside the outputs is written.
  Epilogue: O / rowsum as bf16 (fp16) and FP32 16-byte stores, the LSE (max + log2 sum) ln 2.

Constraints (QsaFwdSpec.reasons): G in 1..64, D and Dv in (64, 128, 256), bf16 / fp16; q [T, Hq, D], k [T, Hkv, D],
v [T, Hkv, Dv] with unit element stride, head stride D (Dv) and a token stride that is a multiple of 8 elements;
16-byte aligned bases; idx int32 [T, W] with unit slot stride.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.epilogue import store_row_f32_v4, store_row_v4
from dsagen.kernels.common.sm90.gather import gather_base, gather_lanes, gather_tile_rows, publish_tile_ids, \
    smem_bytes, wait_gathered_tile
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, issue_accumulate_group, issue_gemm_group, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.softmax import rescale_rows, softmax_step_row
from dsagen.kernels.common.sm90.ring import ring_wait_free
from dsagen.kernels.common.sm90.sequences import token_range

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M = 64                      # rows of an item (wgmma M): one query's G heads, then zero padding
BN = 64                     # index slots per tile (wgmma N of S, K of PV)
MAX_INIT = -1.0e30          # initial running max: finite, so no -inf - -inf; masked scores are -inf
NTHREADS = 256
REGS_PRODUCER = 56
REGS_CONSUMER = 240
PUBLISH_ARRIVALS = 16       # publish_tile_ids: one arrival per group leader
BLOCKS_PER_TILE = BN // 4   # the bitmap form's four-token blocks per tile
BAR_PRODUCER = 1            # named barrier of the producer warpgroup's 128 threads (the bitmap form's search)


def params(dtype: str, bitmap: bool = False) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); bitmap: the bitmap form's selection arguments
    instead of the index rows'."""
    select = [
        {"name": "bm", "kind": "ptr", "dtype": "uint8", "align": 1},        # [T, NB] block bitmap, row stride bm_st
        {"name": "cu", "kind": "ptr", "dtype": "int32", "align": 4},        # [n_docs + 1] packed offsets
        {"name": "blk0", "kind": "ptr", "dtype": "int32", "align": 4},      # [n_docs + 1] first block per sequence
    ] if bitmap else [
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},       # [T, W], row stride idx_st
    ]
    select_scalars = [
        {"name": "n_docs", "kind": "i32"},                                  # 0: one sequence of T tokens
        {"name": "n_blocks", "kind": "i32"},                                # NB (no column past it is read)
        {"name": "bm_st", "kind": "i64"},
    ] if bitmap else [
        {"name": "width", "kind": "i32"},                                   # W
        {"name": "idx_st", "kind": "i64"},
    ]
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hq, D], token stride q_st
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, D], token stride k_st
        {"name": "v", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, Dv], token stride v_st
        *select,
        {"name": "out", "kind": "ptr", "dtype": dtype, "align": 16},         # [T, Hq, Dv] contiguous
        {"name": "out32", "kind": "ptr", "dtype": "float32", "align": 16},   # [T, Hq, Dv] contiguous
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [Hq, T] contiguous
        {"name": "n_tok", "kind": "i32"},                                    # T
        {"name": "n_kv", "kind": "i32"},                                     # Hkv
        *select_scalars,
        {"name": "q_st", "kind": "i64"},
        {"name": "k_st", "kind": "i64"},
        {"name": "v_st", "kind": "i64"},
        {"name": "scale_log2", "kind": "f32"},                               # softmax scale x log2(e)
    ]


def launch(smem: int) -> dict:
    """The launch declaration: one CTA per (token, KV head)."""
    return {"grid": ["n_tok * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": smem}


def build(group: int, head_dim: int, v_dim: int, dtype: str, stages: int, bitmap: bool = False) -> BuiltKernel:
    """The kernel of QsaFwdSpec(group, head_dim, v_dim, dtype, stages, bitmap); each call makes new kernel and host
    functions."""
    G, D, DV, ST = group, head_dim, v_dim, stages
    DT = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    FP16 = dtype == "float16"
    NQ = M // 16                          # Q rows per producer group (rows grp + 16 i)
    NI = BN // 16                         # tile rows per producer group

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
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * ST], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[DT, BN * DV * ST], 1024]

    SMEM_BYTES = Smem.size_in_bytes()

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
                    cute.arch.mbarrier_init(st.kv_free.data_ptr() + i, 4)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    @cute.jit
    def load_q(st, lanes, t, g, p_q, q_st):
        """Q: rows grp + 16 i of the G heads (t, g G ..) into sQ, the rest zero-filled; completes q_full."""
        lq = sw128(DT, (M, D))
        qids = cute.make_rmem_tensor(NQ, Int32)
        for i in cutlass.range_constexpr(NQ):
            r = lanes.grp + 16 * i
            qids[i] = r if r < G else Int32(-1)
        q_rows = p_q + (Int64(t) * q_st + g * (G * D))
        gather_tile_rows(smem_bytes(st.sQ), gather_base(lq, lanes), lq, q_rows, D, qids, lanes.col0, (0, D // 64))
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
    def indexed_producer(st, tidx, t, g, p_q, p_k, p_v, p_idx, n_tok, width, idx_st, q_st, k_st, v_st, n_tiles):
        """The indexed form's gathers of one item: Q, then per tile its 64 slots' ids (slots past W: -1)."""
        lanes = gather_lanes(tidx)
        load_q(st, lanes, t, g, p_q, q_st)
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
    def bitmap_producer(st, tidx, t, g, p_q, p_k, p_v, p_bm, p_cu, p_blk0, n_tok, n_docs, n_blocks, bm_st, q_st,
                        k_st, v_st):
        """The bitmap form's gathers of one item. Query t of the sequence starting at s0 selects its blocks
        b = 0 .. own = (t - s0) // 4 whose byte bm[t, blk0[seq] + b] is nonzero (columns past NB, or before 0, are
        never read: a bitmap narrower than the offsets say selects nothing there); block b holds tokens
        s0 + 4 b + c, c < 4, of which those <= t count. A first pass counts the selected blocks (n_tiles =
        ceil(count / 16), published in sN on list_full); then each tile's 16 blocks are the next selected ones in
        ascending order, found 128 blocks at a time (a ballot per warp, the warps' counts in sCnt, the blocks in
        sBlk), and the tile's 64 rows are their tokens."""
        lanes = gather_lanes(tidx)
        warp, lane = tidx // 32, tidx % 32
        load_q(st, lanes, t, g, p_q, q_st)
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
    def column_ok(sIds, cS, ok, stage, n_tok):
        """ok[c]: whether the id of the thread's accumulator column c in this stage's tile lies in [0, T)."""
        for c in cutlass.range_constexpr(cute.size(ok)):
            u = sIds[stage * BN + cS[0, c][1]]
            good = u >= 0 and u < n_tok
            ok[c] = Int32(1) if good else Int32(0)

    @cute.jit
    def softmax_rows(sMN, ok, row_max, row_sum, corr, scale_log2):
        """One tile's scores turned into P in place, in the log2 domain: a column whose id is invalid is -inf; then
        softmax.softmax_step_row (corr[r]: O's deferred rescale)."""
        nc = cute.size(sMN, mode=[1])
        for r in cutlass.range_constexpr(cute.size(sMN, mode=[0])):
            for c in cutlass.range_constexpr(nc):
                x = sMN[r, c] * scale_log2
                if ok[c] == 0:
                    x = -Float32.inf
                sMN[r, c] = x
            softmax_step_row(sMN, r, nc, row_max, row_sum, corr)

    @cute.jit
    def consumer(st, ctid, lane, t, g, p_out, p_out32, p_lse, n_tok, n_kv, scale_log2, n_tiles):
        """Scores, softmax and PV of the item's tiles, then the epilogue (module docstring)."""
        lq, lk, lv = sw128(DT, (M, D)), sw128(DT, (BN, D, ST)), sw128(DT, (BN, DV, ST))
        sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)            # (64 rows (heads), D)
        sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)            # (BN keys, D, stage)
        sV = st.sV.get_tensor(lv.outer, swizzle=lv.inner)            # (BN keys, DV, stage)
        sVt = cute.composition(sV, cute.make_layout((DV, BN, ST), stride=(BN, 1, BN * DV)))   # V^T (MN-major)
        sIds = st.ids.get_tensor(cute.make_layout(BN * ST))
        k_ready, v_ready, kv_free = st.k_ready.data_ptr(), st.v_ready.data_ptr(), st.kv_free.data_ptr()
        qk = wgmma_tile(DT, sQ, sK, (M, BN), ctid)                    # S = Q K^T; B (.., .., k, stage)
        rP = cute.make_rmem_tensor(qk.acc.layout, DT)
        pv = wgmma_tile(DT, None, sVt, (M, DV), ctid, b_mn_major=True, a_regs=rP)   # O += P V
        mma_qk, tSrQ, tSrK, accS, sMN, cS = qk.mma, qk.tA, qk.tB, qk.acc, qk.acc_mn, qk.coord_mn
        mma_pv, tOrP, tOrV, accO, oMN, cO = pv.mma, pv.tA, pv.tB, pv.acc, pv.acc_mn, pv.coord_mn
        NR = cute.size(sMN, mode=[0])
        row_max = cute.make_rmem_tensor(NR, Float32)
        row_sum = cute.make_rmem_tensor(NR, Float32)
        corr = cute.make_rmem_tensor(NR, Float32)        # exp2(old max - new max) of the latest step
        ok = cute.make_rmem_tensor(cute.size(sMN, mode=[1]), Int32)
        row_max.fill(MAX_INIT)
        row_sum.fill(0.0)
        accO.fill(0.0)

        wait_gathered_tile(st.q_full.data_ptr(), 0, 1)
        # S of the next tile and PV of this one go to the tensor cores back to back; the next tile's softmax runs
        # while this PV does, and O is rescaled (and P replaced) once the PV retired
        if n_tiles > 0:
            wait_gathered_tile(k_ready, 0, ST)
            gemm_tile(mma_qk, accS, tSrQ, tSrK, D // 16, b_stage=0)
            column_ok(sIds, cS, ok, 0, n_tok)
            softmax_rows(sMN, ok, row_max, row_sum, corr, scale_log2)
            rP.store(accS.load().to(DT))
            for e in cutlass.range(n_tiles - 1, unroll=1):      # no wgmma under a branch (ptxas would serialize)
                nxt = e + 1
                wait_gathered_tile(k_ready, nxt, ST)
                issue_gemm_group(mma_qk, accS, tSrQ, tSrK, D // 16, nxt % ST)
                wait_gathered_tile(v_ready, e, ST)
                issue_accumulate_group(mma_pv, accO, tOrP, tOrV, BN // 16, e % ST)
                column_ok(sIds, cS, ok, nxt % ST, n_tok)
                warpgroup.wait_group(1)                         # S of the next tile (PV may still run)
                softmax_rows(sMN, ok, row_max, row_sum, corr, scale_log2)
                warpgroup.wait_group(0)                         # this tile's PV: O and P are free
                rescale_rows(oMN, corr)
                rP.store(accS.load().to(DT))
                if lane == 0:
                    cute.arch.mbarrier_arrive(kv_free + e % ST)
            last = n_tiles - 1
            wait_gathered_tile(v_ready, last, ST)
            issue_accumulate_group(mma_pv, accO, tOrP, tOrV, BN // 16, last % ST)
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(kv_free + last % ST)

        # epilogue: O / rowsum as 16-byte bf16 and FP32 stores, the LSE by lane 0 of each quad
        q4 = ctid % 4
        q_hi = q4 >= 2
        q_odd = q4 % 2 == 1
        policy = l2_evict_first_policy()
        n_q = n_kv * G
        for r in cutlass.range_constexpr(NR):
            s = quad_sum(row_sum[r])
            m = row_max[r]
            row = cS[r, 0][0]
            keep = row < G                                 # padding rows store nothing; every lane shuffles
            hq = g * G + cutlass.min(row, G - 1)
            inv = Float32(0.0) if s == Float32(0.0) else Float32(1.0) / s
            at = (Int64(t) * n_q + hq) * DV
            store_row_v4(p_out + (at + 8 * q4), oMN, r, inv, FP16, q_hi, q_odd, policy, keep=keep)
            store_row_f32_v4(p_out32 + at, oMN, cO, r, inv, keep=keep)
            if keep and q4 == 0:
                (p_lse + (Int64(hq) * n_tok + t)).store(-Float32.inf if s == Float32(0.0)
                                                         else (m + cute.math.log2(s, fastmath=False)) * LN2)

    @cute.jit
    def item_coords():
        """(thread in the CTA, block index, warp, warpgroup, lane); the block is the item (token t, KV head g) with
        bid = g T + t, so the tokens of one head are neighbours."""
        coords = cta_coords()
        return coords.tidx, coords.bidx, coords.warp, coords.wg, cute.arch.lane_idx()

    if bitmap:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_bm: cute.Pointer, p_cu: cute.Pointer,
                   p_blk0: cute.Pointer, p_out: cute.Pointer, p_out32: cute.Pointer, p_lse: cute.Pointer,
                   n_tok: Int32, n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64, q_st: Int64,
                   k_st: Int64, v_st: Int64, scale_log2: Float32):
            tidx, bid, warp, wg, lane = item_coords()
            g = bid // n_tok
            t = bid - g * n_tok
            st = cutlass.memory.SmemAllocator().allocate(Smem)
            init_barriers(warp, st)
            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER)
                bitmap_producer(st, tidx, t, g, p_q, p_k, p_v, p_bm, p_cu, p_blk0, n_tok, n_docs, n_blocks, bm_st,
                                q_st, k_st, v_st)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                cute.arch.mbarrier_wait(st.list_full.data_ptr(), 0)
                n_tiles = st.sN.get_tensor(cute.make_layout(4))[0]
                consumer(st, tidx - 128, lane, t, g, p_out, p_out32, p_lse, n_tok, n_kv, scale_log2, n_tiles)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_bm: cute.Pointer, p_cu: cute.Pointer,
                 p_blk0: cute.Pointer, p_out: cute.Pointer, p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32,
                 n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64,
                 scale_log2: Float32):
            kernel(p_q, p_k, p_v, p_bm, p_cu, p_blk0, p_out, p_out32, p_lse, n_tok, n_kv, n_docs, n_blocks, bm_st,
                   q_st, k_st, v_st, scale_log2).launch(grid=(n_tok * n_kv, 1, 1), block=(NTHREADS, 1, 1),
                                                        smem=SMEM_BYTES, min_blocks_per_mp=1,
                                                        preferred_smem_carveout=100)
    else:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_idx: cute.Pointer, p_out: cute.Pointer,
                   p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, n_kv: Int32, width: Int32, idx_st: Int64,
                   q_st: Int64, k_st: Int64, v_st: Int64, scale_log2: Float32):
            tidx, bid, warp, wg, lane = item_coords()
            g = bid // n_tok
            t = bid - g * n_tok
            n_tiles = (width + BN - 1) // BN
            st = cutlass.memory.SmemAllocator().allocate(Smem)
            init_barriers(warp, st)
            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER)
                indexed_producer(st, tidx, t, g, p_q, p_k, p_v, p_idx, n_tok, width, idx_st, q_st, k_st, v_st,
                                 n_tiles)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                consumer(st, tidx - 128, lane, t, g, p_out, p_out32, p_lse, n_tok, n_kv, scale_log2, n_tiles)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_idx: cute.Pointer, p_out: cute.Pointer,
                 p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, n_kv: Int32, width: Int32, idx_st: Int64,
                 q_st: Int64, k_st: Int64, v_st: Int64, scale_log2: Float32):
            kernel(p_q, p_k, p_v, p_idx, p_out, p_out32, p_lse, n_tok, n_kv, width, idx_st, q_st, k_st, v_st,
                   scale_log2).launch(grid=(n_tok * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES,
                                      min_blocks_per_mp=1, preferred_smem_carveout=100)

    return BuiltKernel(params(dtype, bitmap), launch(SMEM_BYTES), kernel, host)
