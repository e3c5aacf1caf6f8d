"""NSA selected-branch forward on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one NsaSelectFwdSpec.

For query token t (flattened over the batch, or packed sequences) and query head hq of KV head h = hq // G:

    o[t, hq] = softmax_j(scale * q[t, hq] . k[j, h]) v[j, h]      over the keys j of the blocks t selected

where token t selected the blocks block_indices[t, h, s] for slots s < count (the per-token count or an int), each
block j0 being the block_size keys [j0 * block_size, (j0 + 1) * block_size) of t's sequence, an id outside [0,
ceil(len / block_size)) an empty slot, keys limited causally to <= t, and a block named by two slots counted twice
(the reference's semantics, dsagen/reference/nsa.py). Also lse[t, hq] = log sum_j exp(scale q . k) (natural log;
-inf and o = 0 where t has no key).

Work item = (KV head h, TOK consecutive tokens): the item's M = 64 rows are its tokens x the G query heads of h
(TOK = min(16, 64 // G); fewer rows are padding when G < 4). The item's tokens share what they selected: warp 1 of
the producer warpgroup (the scheduler) turns their TOK x S slots into a list of distinct entries (first row of the
block in the packed key tensor, occurrence rank) with the bit mask of the tokens that selected each, so a block that
several of the item's tokens chose is loaded and multiplied once; a row takes part in an entry only if its token's
bit is set (the others see -inf). Warp 0 loads the item's Q tile (TMA) and, per entry, the block's K and V tiles
(TMA boxes of block_size contiguous rows of head h) through a ring of `stages` stages. The consumer warpgroup runs,
per entry, S = Q K^T (wgmma, K-major), the mask and the online softmax in the log2 domain, and O += P V (P from
registers, V^T MN-major), then frees the stage; the next entry's S is issued before this entry's PV, so the next
softmax runs while the PV does, and O is rescaled once the PV retired (the operations and their order per row are
those of one entry at a time: the same bytes). At the end it stores O / rowsum (bf16 / fp16) and the LSE. Two CTAs
per SM where the shared memory allows (256 threads, setmaxnreg 40 / 216; else one, 40 / 256): one CTA's softmax
runs under the other's MMA as well.

Constraints (NsaSelectFwdSpec.reasons): G in 1..64 (a power of two), D and Dv in (64, 128), block_size in (32, 64,
128), at most max_slots slots per token; q [N, HQ, D], k [N, H, D], v [N, H, Dv] with 16-byte aligned rows; ids int32.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.epilogue import store_row_v4
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, issue_accumulate_group, issue_gemm_group, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.softmax import rescale_rows, softmax_step_row
from dsagen.kernels.common.sm90.ring import ring_wait_ready
from dsagen.kernels.common.sm90.tma import tma_load_tile, tma_recipe
from dsagen.kernels.nsa.select_common_sm90 import (CMP_PTR_PARAMS, CMP_SCALAR_PARAMS, LIST_PTR_PARAMS,
                                                   LIST_SCALAR_PARAMS, REGS_CONSUMER, REGS_PRODUCER, SMEM_2_CTAS,
                                                   init_item_barriers, make_cmp_schedule, make_kv_producer,
                                                   make_schedule, qkv_host_args, row_key_limits, row_tokens,
                                                   rows_map, zero_padding_rows)
from dsagen.kernels.nsa.spec import MAX_TOK, item_tokens

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M = 64                      # rows of an item (wgmma M): its tokens x the group's query heads
MAX_INIT = -1.0e30          # initial running max: finite, so no -inf - -inf; masked scores are -inf


def build(group: int, head_dim: int, v_dim: int, block_size: int, max_slots: int, dtype: str, stages: int,
          compressed: bool = False):
    """The kernel of NsaSelectFwdSpec(group, head_dim, v_dim, block_size, max_slots, dtype, stages), or with
    compressed=True of NsaCmpFwdSpec (the compressed branch: keys are the compressed rows the scheduler lists itself,
    make_cmp_schedule; block_size is then the tile of compressed rows): returns (kernel, host, PARAMS, HOST_ARGS,
    LAUNCH). Each call makes new kernel and host functions."""
    G, D, DV, BN, ST = group, head_dim, v_dim, block_size, stages
    TOK = item_tokens(G)
    ROWS = TOK * G                       # Q rows the TMA box fills (64, or 16 / 32 when G < 4)
    NE = TOK * max_slots                 # the scheduler's list: at most one entry per (token, slot)
    DT = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    FP16 = dtype == "float16"
    KBQ = D // 64                        # 64-column TMA boxes per Q row
    Q_BYTES = ROWS * D * 2
    NTHREADS = 256

    PARAMS = [
        {"name": "q_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, TOK])},   # q [N, HQ, D] -> (D, HQ, N)
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # k [N, H, D] -> (D, H, N)
        {"name": "v_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # v [N, H, DV] -> (DV, H, N)
    ] + (CMP_PTR_PARAMS if compressed else LIST_PTR_PARAMS) + [
        {"name": "out", "kind": "ptr", "dtype": dtype, "align": 16},         # [N, HQ, DV] contiguous
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [N, HQ] contiguous
    ] + (CMP_SCALAR_PARAMS if compressed else LIST_SCALAR_PARAMS) + [
        {"name": "scale_log2", "kind": "f32"},                               # softmax scale x log2(e)
    ]
    HOST_ARGS = qkv_host_args(dtype, False) + PARAMS[3:]

    @cute.struct
    class Smem:
        q_full: cute.struct.MemRange[Int64, 1]
        list_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, ST]
        v_full: cute.struct.MemRange[Int64, ST]
        kv_free: cute.struct.MemRange[Int64, ST]
        n_ent: cute.struct.MemRange[Int32, 4]
        tok_first: cute.struct.MemRange[Int32, MAX_TOK]    # the token's sequence's first row (packed numbering)
        tok_pos: cute.struct.MemRange[Int32, MAX_TOK]      # the token's row, -1 past the last token
        tok_blocks: cute.struct.MemRange[Int32, MAX_TOK]   # blocks of the token's sequence
        start: cute.struct.MemRange[Int32, NE]             # per (token, slot): first key row, -1 if empty
        rank: cute.struct.MemRange[Int32, NE]              # per (token, slot): earlier slots of its token alike
        ent: cute.struct.MemRange[Int32, 2 * NE]           # the list: (first key row, token mask) per entry
        sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * ST], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[DT, BN * DV * ST], 1024]

    SMEM_BYTES = Smem.size_in_bytes()
    schedule = make_cmp_schedule(TOK, NE, BN) if compressed else make_schedule(TOK, NE, BN)
    kv_producer = make_kv_producer(BN, D, DV, ST, NE)
    CTAS_PER_SM = 2 if SMEM_BYTES <= SMEM_2_CTAS else 1
    LAUNCH = {"grid": ["n_groups * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": SMEM_BYTES}

    @cute.jit
    def softmax_rows(sMN, cS, row_max, row_sum, corr, row_pos, row_lim, row_tok, start, mask, scale_log2):
        """One entry's scores (block rows start.., the tokens of `mask`) turned into P in place, in the log2 domain:
        a row's keys start + c count if its token is in mask and c <= row_lim - start (else -inf); then
        softmax.softmax_step_row (corr[r]: O's deferred rescale)."""
        for r in cutlass.range_constexpr(cute.size(sMN, mode=[0])):
            hi = Int32(-1)
            if row_pos[r] >= 0 and (mask >> row_tok[r]) & 1 != 0:
                hi = row_lim[r] - start
            nc = cute.size(sMN, mode=[1])
            for c in cutlass.range_constexpr(nc):
                v = sMN[r, c] * scale_log2
                if cS[r, c][1] > hi:
                    v = -Float32.inf
                sMN[r, c] = v
            softmax_step_row(sMN, r, nc, row_max, row_sum, corr)

    @cute.jit
    def body(q_tma, k_tma, v_tma, sched, p_out: cute.Pointer, p_lse: cute.Pointer, n_kv: Int32, n_groups: Int32,
             scale_log2: Float32):
        """The kernel; sched: the scheduler's arguments after (st, lane, t0[, h]) (make_cmp_schedule's when
        compressed, else make_schedule's)."""
        coords = cta_coords()
        tidx, bid, warp, wg = coords.tidx, coords.bidx, coords.warp, coords.wg
        lane = cute.arch.lane_idx()
        h = bid // n_groups                      # KV head; the token groups of one head are neighbours
        t0 = (bid - h * n_groups) * TOK          # the item's first token

        st = cutlass.memory.SmemAllocator().allocate(Smem)
        q_full = st.q_full.data_ptr()
        list_full = st.list_full.data_ptr()
        k_full = st.k_full.data_ptr()
        v_full = st.v_full.data_ptr()
        kv_free = st.kv_free.data_ptr()
        lq, lk, lv = sw128(DT, (M, D)), sw128(DT, (BN, D, ST)), sw128(DT, (BN, DV, ST))
        sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)            # (64 rows (token, head), D)
        sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)            # (BN keys, D, stage)
        sV = st.sV.get_tensor(lv.outer, swizzle=lv.inner)            # (BN keys, DV, stage)
        sVt = cute.composition(sV, cute.make_layout((DV, BN, ST), stride=(BN, 1, BN * DV)))   # V^T (MN-major)
        s_ent = st.ent.get_tensor(cute.make_layout(2 * NE))
        n_ent = st.n_ent.get_tensor(cute.make_layout(4))

        init_item_barriers(warp, st, ST)

        if wg == 0:
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            if warp == 1:
                if cutlass.const_expr(compressed):
                    schedule(st, lane, t0, *sched)
                else:
                    schedule(st, lane, t0, h, *sched)
            if warp == 0:
                # TMA: the Q tile now, then per entry its K and V blocks through the ring
                tma_load_tile(q_tma, ((sQ.iterator, M * 64, KBQ, (h * G, t0)),), q_full, Q_BYTES)
                kv_producer(st, lane, h, k_tma, v_tma, sK, sV)
        else:
            cute.arch.setmaxregister_increase(REGS_CONSUMER[CTAS_PER_SM])
            ctid = tidx - 128
            qk = wgmma_tile(DT, sQ, sK, (M, BN), ctid)                    # S = Q K^T; B (.., .., k, stage)
            rP = cute.make_rmem_tensor(qk.acc.layout, DT)
            pv = wgmma_tile(DT, None, sVt, (M, DV), ctid, b_mn_major=True, a_regs=rP)   # O += P V
            mma_qk, tSrQ, tSrK, accS, sMN, cS = qk.mma, qk.tA, qk.tB, qk.acc, qk.acc_mn, qk.coord_mn
            mma_pv, tOrP, tOrV, accO, oMN = pv.mma, pv.tA, pv.tB, pv.acc, pv.acc_mn
            NR = cute.size(sMN, mode=[0])
            row_max = cute.make_rmem_tensor(NR, Float32)
            row_sum = cute.make_rmem_tensor(NR, Float32)
            corr = cute.make_rmem_tensor(NR, Float32)        # exp2(old max - new max) of the latest step
            row_tok = cute.make_rmem_tensor(NR, Int32)       # the row's token within the item (TOK: padding)
            row_pos = cute.make_rmem_tensor(NR, Int32)       # its row in the packed numbering, -1: none
            row_max.fill(MAX_INIT)
            row_sum.fill(0.0)
            accO.fill(0.0)
            q4 = ctid % 4

            if cutlass.const_expr(ROWS < M):
                zero_padding_rows(ctid, [(sQ, D)], ROWS, M)

            cute.arch.mbarrier_wait(list_full, 0)
            n = n_ent[0]
            row_tokens(st, cS, row_tok, row_pos, G, ROWS)
            row_lim = row_pos                                # the row's last key: its own row (causal)
            if cutlass.const_expr(compressed):
                row_lim = cute.make_rmem_tensor(NR, Int32)   # its token's last compressed row
                row_key_limits(st, row_tok, row_pos, row_lim)
            cute.arch.mbarrier_wait(q_full, 0)
            # S of the next entry and PV of this one go to the tensor cores back to back; the next entry's softmax
            # runs while this PV does, and O is rescaled (and P replaced) once the PV retired
            if n > 0:
                ring_wait_ready(k_full, 0, ST)
                gemm_tile(mma_qk, accS, tSrQ, tSrK, D // 16, b_stage=0)
                softmax_rows(sMN, cS, row_max, row_sum, corr, row_pos, row_lim, row_tok, s_ent[0], s_ent[1], scale_log2)
                rP.store(accS.load().to(DT))
                for e in cutlass.range(n - 1, unroll=1):       # no wgmma under a branch (ptxas would serialize)
                    nxt = e + 1
                    ring_wait_ready(k_full, nxt, ST)
                    issue_gemm_group(mma_qk, accS, tSrQ, tSrK, D // 16, nxt % ST)
                    ring_wait_ready(v_full, e, ST)
                    issue_accumulate_group(mma_pv, accO, tOrP, tOrV, BN // 16, e % ST)
                    warpgroup.wait_group(1)                      # S of the next entry (PV may still run)
                    softmax_rows(sMN, cS, row_max, row_sum, corr, row_pos, row_lim, row_tok, s_ent[2 * nxt],
                                 s_ent[2 * nxt + 1], scale_log2)
                    warpgroup.wait_group(0)                      # this entry's PV: O and P are free
                    rescale_rows(oMN, corr)
                    rP.store(accS.load().to(DT))
                    if lane == 0:
                        cute.arch.mbarrier_arrive(kv_free + e % ST)
                last = n - 1
                ring_wait_ready(v_full, last, ST)
                issue_accumulate_group(mma_pv, accO, tOrP, tOrV, BN // 16, last % ST)
                warpgroup.wait_group(0)
                if lane == 0:
                    cute.arch.mbarrier_arrive(kv_free + last % ST)

            # epilogue: O / rowsum as 16-byte stores, the LSE by lane 0 of each quad
            q_hi = q4 >= 2
            q_odd = q4 % 2 == 1
            policy = l2_evict_first_policy()
            for r in cutlass.range_constexpr(NR):
                s = quad_sum(row_sum[r])
                m = row_max[r]
                pos = row_pos[r]
                if pos >= 0:
                    row = cS[r, 0][0]
                    hq = h * G + (row - row_tok[r] * G)
                    inv = Float32(0.0) if s == Float32(0.0) else Float32(1.0) / s
                    at = Int64(pos) * (n_kv * G) + hq
                    store_row_v4(p_out + (at * DV + 8 * q4), oMN, r, inv, FP16, q_hi, q_odd, policy)
                    if q4 == 0:
                        (p_lse + at).store(-Float32.inf if s == Float32(0.0)
                                           else (m + cute.math.log2(s, fastmath=False)) * LN2)

    if compressed:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], p_ccu: cute.Pointer, p_cu: cute.Pointer,
                   p_out: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, seq_len: Int32, n_docs: Int32,
                   n_kv: Int32, n_groups: Int32, n_slots: Int32, cmp_block: Int32, n_keys: Int32,
                   scale_log2: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(),
                 (p_ccu, p_cu, n_tok, seq_len, n_docs, n_slots, cmp_block), p_out, p_lse, n_kv, n_groups, scale_log2)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, n_q_heads: Int32, q_st: Int64,
                 q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, p_ccu: cute.Pointer,
                 p_cu: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, seq_len: Int32,
                 n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32, cmp_block: Int32, n_keys: Int32,
                 scale_log2: Float32):
            """The TMA descriptors of q [N, HQ, D], of the compressed k [n_keys, H, D] and v [n_keys, H, DV], then
            the launch."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, TOK)
            tk = rows_map(p_k, DT, D, n_kv, n_keys, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_keys, v_st, v_sh, 1, BN)
            kernel(tq, tk, tv, p_ccu, p_cu, p_out, p_lse, n_tok, seq_len, n_docs, n_kv, n_groups, n_slots,
                   cmp_block, n_keys, scale_log2).launch(
                grid=(n_groups * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES,
                min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)
    else:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], p_idx: cute.Pointer, p_cnt: cute.Pointer,
                   p_cu: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, seq_len: Int32,
                   n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32, has_cnt: Int32, cnt_all: Int32,
                   idx_st: Int64, idx_sh: Int64, idx_ss: Int64, cnt_st: Int64, cnt_sh: Int64, scale_log2: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(),
                 (p_idx, p_cnt, p_cu, n_tok, seq_len, n_docs, n_slots, has_cnt, cnt_all, idx_st, idx_sh, idx_ss,
                  cnt_st, cnt_sh), p_out, p_lse, n_kv, n_groups, scale_log2)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, n_q_heads: Int32, q_st: Int64,
                 q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, p_idx: cute.Pointer,
                 p_cnt: cute.Pointer, p_cu: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32,
                 seq_len: Int32, n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32, has_cnt: Int32,
                 cnt_all: Int32, idx_st: Int64, idx_sh: Int64, idx_ss: Int64, cnt_st: Int64, cnt_sh: Int64,
                 scale_log2: Float32):
            """The TMA descriptors of q [N, HQ, D] -> (D, HQ, N), k [N, H, D] and v [N, H, DV] (strides in elements,
            given to create_tensor_map_tiled in 16-byte units), then the launch."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, TOK)
            tk = rows_map(p_k, DT, D, n_kv, n_tok, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_tok, v_st, v_sh, 1, BN)
            kernel(tq, tk, tv, p_idx, p_cnt, p_cu, p_out, p_lse, n_tok, seq_len, n_docs, n_kv, n_groups, n_slots,
                   has_cnt, cnt_all, idx_st, idx_sh, idx_ss, cnt_st, cnt_sh, scale_log2).launch(
                grid=(n_groups * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES,
                min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
