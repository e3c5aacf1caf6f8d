"""NSA selected-branch backward, dq, on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one
NsaSelectDqSpec. With the forward's natural-log lse and delta[t, hq] = sum(dO * O) of each row:

    P = exp(scale q . k - lse),  dS = P (dO . v - delta),  dq[t, hq] = scale sum_j dS_j k_j

over the keys j the forward's row attended (select_fwd_sm90's semantics: the selected blocks, causal, each slot
counted). The work items, the scheduler's merged block list (select_common_sm90) and the TMA ring are the
forward's; the item's dO tile loads with its Q tile. Per entry the consumer warpgroup issues S = Q K^T and
dP = dO V^T (SS wgmma, one group), forms dS in registers (0 where the row's token did not choose the entry or the
key is after it), and adds dS K into the dq accumulator (dS from registers, K^T MN-major). At the end dq * scale is
stored (bf16 / fp16). Each row's sum runs over the entries in the list's order: bitwise the same every call.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup
from cutlass.experimental import primitives as prims

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.epilogue import store_row_v4
from dsagen.kernels.common.sm90.layout import acc_mn_view, sw128
from dsagen.kernels.common.sm90.mma import issue_gemm, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.ring import ring_wait_ready
from dsagen.kernels.common.sm90.tma import tma_load_tile, tma_recipe
from dsagen.kernels.nsa.select_common_sm90 import (CMP_PTR_PARAMS, CMP_SCALAR_PARAMS, LIST_PTR_PARAMS,
                                                   LIST_SCALAR_PARAMS, REGS_CONSUMER, REGS_PRODUCER, SMEM_2_CTAS,
                                                   init_item_barriers, make_cmp_schedule, make_kv_producer,
                                                   make_schedule, qkv_host_args, row_key_limits, rows_map,
                                                   zero_padding_rows)
from dsagen.kernels.nsa.spec import MAX_TOK, item_tokens

LOG2E = math.log2(math.e)
M = 64


def build(group: int, head_dim: int, v_dim: int, block_size: int, max_slots: int, dtype: str, stages: int,
          compressed: bool = False):
    """The kernel of NsaSelectDqSpec(group, head_dim, v_dim, block_size, max_slots, dtype, stages), or with
    compressed=True of NsaCmpDqSpec (the compressed branch's dq: keys are the compressed rows make_cmp_schedule
    lists, a row's last key its token's last compressed row; block_size the tile of 64 compressed rows): returns
    (kernel, host, PARAMS, HOST_ARGS, LAUNCH)."""
    G, D, DV, BN, ST = group, head_dim, v_dim, block_size, stages
    TOK = item_tokens(G)
    ROWS = TOK * G
    NE = TOK * max_slots
    DT = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    FP16 = dtype == "float16"
    KBQ, KBV = D // 64, DV // 64
    QDO_BYTES = ROWS * (D + DV) * 2
    NTHREADS = 256

    PARAMS = [
        {"name": "q_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, TOK])},   # q [N, HQ, D]
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # k [N, H, D]
        {"name": "v_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # v [N, H, DV]
        {"name": "do_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, TOK])},  # dO [N, HQ, DV]
    ] + (CMP_PTR_PARAMS if compressed else LIST_PTR_PARAMS) + [
        {"name": "dq", "kind": "ptr", "dtype": dtype, "align": 16},          # [N, HQ, D] contiguous
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [N, HQ] the forward's (natural log)
        {"name": "delta", "kind": "ptr", "dtype": "float32", "align": 4},    # [N, HQ] sum(dO * O)
    ] + (CMP_SCALAR_PARAMS if compressed else LIST_SCALAR_PARAMS) + [
        {"name": "scale_log2", "kind": "f32"},
        {"name": "scale", "kind": "f32"},
    ]
    HOST_ARGS = qkv_host_args(dtype, True) + PARAMS[4:]

    @cute.struct
    class Smem:
        q_full: cute.struct.MemRange[Int64, 1]
        list_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, ST]
        v_full: cute.struct.MemRange[Int64, ST]
        kv_free: cute.struct.MemRange[Int64, ST]
        n_ent: cute.struct.MemRange[Int32, 4]
        tok_first: cute.struct.MemRange[Int32, MAX_TOK]
        tok_pos: cute.struct.MemRange[Int32, MAX_TOK]
        tok_blocks: cute.struct.MemRange[Int32, MAX_TOK]
        start: cute.struct.MemRange[Int32, NE]
        rank: cute.struct.MemRange[Int32, NE]
        ent: cute.struct.MemRange[Int32, 2 * NE]
        sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D], 1024]
        sdO: cute.struct.Align[cute.struct.MemRange[DT, M * DV], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * ST], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[DT, BN * DV * ST], 1024]

    SMEM_BYTES = Smem.size_in_bytes()
    CTAS_PER_SM = 2 if SMEM_BYTES <= SMEM_2_CTAS else 1
    LAUNCH = {"grid": ["n_groups * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": SMEM_BYTES}
    schedule = make_cmp_schedule(TOK, NE, BN) if compressed else make_schedule(TOK, NE, BN)
    kv_producer = make_kv_producer(BN, D, DV, ST, NE)

    @cute.jit
    def body(q_tma, k_tma, v_tma, do_tma, sched, p_dq: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer,
             n_kv: Int32, n_groups: Int32, scale_log2: Float32, scale: Float32):
        """The kernel; sched: the scheduler's arguments after (st, lane, t0[, h]) (make_cmp_schedule's when
        compressed, else make_schedule's)."""
        coords = cta_coords()
        tidx, bid, warp, wg = coords.tidx, coords.bidx, coords.warp, coords.wg
        lane = cute.arch.lane_idx()
        h = bid // n_groups
        t0 = (bid - h * n_groups) * TOK

        st = cutlass.memory.SmemAllocator().allocate(Smem)
        q_full = st.q_full.data_ptr()
        list_full = st.list_full.data_ptr()
        k_full = st.k_full.data_ptr()
        v_full = st.v_full.data_ptr()
        kv_free = st.kv_free.data_ptr()
        lq, ldo = sw128(DT, (M, D)), sw128(DT, (M, DV))
        lk, lv = sw128(DT, (BN, D, ST)), sw128(DT, (BN, DV, ST))
        sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)
        sdO = st.sdO.get_tensor(ldo.outer, swizzle=ldo.inner)
        sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)
        sV = st.sV.get_tensor(lv.outer, swizzle=lv.inner)
        sKt = cute.composition(sK, cute.make_layout((D, BN, ST), stride=(BN, 1, BN * D)))   # K^T (MN-major)
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
                # the Q and dO tiles on one transaction count (tma_load_tile announces both; dO's boxes follow)
                tma_load_tile(q_tma, ((sQ.iterator, M * 64, KBQ, (h * G, t0)),), q_full, QDO_BYTES)
                with cute.arch.elect_one():
                    for kb in cutlass.range_constexpr(KBV):
                        prims.cp_async_bulk_tensor_shared_cta_global(sdO.iterator + kb * M * 64, do_tma,
                                                                     (kb * 64, h * G, t0), q_full)
                kv_producer(st, lane, h, k_tma, v_tma, sK, sV)
        else:
            cute.arch.setmaxregister_increase(REGS_CONSUMER[CTAS_PER_SM])
            ctid = tidx - 128
            s_tile = wgmma_tile(DT, sQ, sK, (M, BN), ctid)               # S = Q K^T (and dP = dO V^T)
            mma_s, tSrQ, tSrK, accS = s_tile.mma, s_tile.tA, s_tile.tB, s_tile.acc
            sMN, cS = s_tile.acc_mn, s_tile.coord_mn
            tPrdO = mma_s.make_fragment_A(s_tile.thr.partition_A(sdO))
            tPrV = mma_s.make_fragment_B(s_tile.thr.partition_B(sV))
            accP = cute.make_rmem_tensor(accS.layout, Float32)
            pMN = acc_mn_view(accP)
            rdS = cute.make_rmem_tensor(accS.layout, DT)
            dq_tile = wgmma_tile(DT, None, sKt, (M, D), ctid, b_mn_major=True, a_regs=rdS)    # dq += dS K
            mma_dq, tQrdS, tQrK, accQ, qMN = dq_tile.mma, dq_tile.tA, dq_tile.tB, dq_tile.acc, dq_tile.acc_mn
            NR = cute.size(sMN, mode=[0])
            NC = cute.size(sMN, mode=[1])
            row_tok = cute.make_rmem_tensor(NR, Int32)
            row_pos = cute.make_rmem_tensor(NR, Int32)
            row_lim = row_pos                                # the row's last key: its own row (causal)
            if cutlass.const_expr(compressed):
                row_lim = cute.make_rmem_tensor(NR, Int32)   # its token's last compressed row
            row_lse = cute.make_rmem_tensor(NR, Float32)     # the row's lse in the log2 domain (0 for an empty row)
            row_dlt = cute.make_rmem_tensor(NR, Float32)     # its delta
            accQ.fill(0.0)
            q4 = ctid % 4

            if cutlass.const_expr(ROWS < M):
                zero_padding_rows(ctid, [(sQ, D), (sdO, DV)], ROWS, M)

            cute.arch.mbarrier_wait(list_full, 0)
            n = n_ent[0]
            tok_pos = st.tok_pos.get_tensor(cute.make_layout(MAX_TOK))
            for r in cutlass.range_constexpr(NR):
                row = cS[r, 0][0]
                tau = row // G
                row_tok[r] = tau
                row_pos[r] = Int32(-1)
                row_lse[r] = Float32(0.0)
                row_dlt[r] = Float32(0.0)
                if row < ROWS:
                    pos = tok_pos[tau]
                    row_pos[r] = pos
                    if pos >= 0:
                        at = Int64(pos) * (n_kv * G) + h * G + (row - tau * G)
                        lse = (p_lse + at).load()
                        if lse > -Float32.inf:
                            row_lse[r] = lse * LOG2E
                        row_dlt[r] = (p_delta + at).load()
            if cutlass.const_expr(compressed):
                row_key_limits(st, row_tok, row_pos, row_lim)
            cute.arch.mbarrier_wait(q_full, 0)
            for e in cutlass.range(n, unroll=1):
                stage = e % ST
                start = s_ent[2 * e]
                mask = s_ent[2 * e + 1]
                ring_wait_ready(k_full, e, ST)
                warpgroup.fence()
                issue_gemm(mma_s, accS, tSrQ, tSrK, D // 16, stage)
                ring_wait_ready(v_full, e, ST)
                issue_gemm(mma_s, accP, tPrdO, tPrV, DV // 16, stage)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                for r in cutlass.range_constexpr(NR):
                    hi = Int32(-1)
                    if row_pos[r] >= 0 and (mask >> row_tok[r]) & 1 != 0:
                        hi = row_lim[r] - start
                    for c in cutlass.range_constexpr(NC):
                        p = cute.math.exp2(sMN[r, c] * scale_log2 - row_lse[r], fastmath=True)
                        ds = p * (pMN[r, c] - row_dlt[r])
                        if cS[r, c][1] > hi:
                            ds = Float32(0.0)
                        sMN[r, c] = ds
                rdS.store(accS.load().to(DT))
                warpgroup.fence()
                for ks in cutlass.range_constexpr(BN // 16):
                    cute.gemm(mma_dq, accQ, tQrdS[None, None, ks], tQrK[None, None, ks, stage], accQ)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if lane == 0:
                    cute.arch.mbarrier_arrive(kv_free + stage)

            q_hi = q4 >= 2
            q_odd = q4 % 2 == 1
            policy = l2_evict_first_policy()
            for r in cutlass.range_constexpr(NR):
                pos = row_pos[r]
                if pos >= 0:
                    row = cS[r, 0][0]
                    at = Int64(pos) * (n_kv * G) + h * G + (row - row_tok[r] * G)
                    store_row_v4(p_dq + (at * D + 8 * q4), qMN, r, scale, FP16, q_hi, q_odd, policy)

    if compressed:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], do_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_ccu: cute.Pointer, p_cu: cute.Pointer, p_dq: cute.Pointer, p_lse: cute.Pointer,
                   p_delta: cute.Pointer, n_tok: Int32, seq_len: Int32, n_docs: Int32, n_kv: Int32,
                   n_groups: Int32, n_slots: Int32, cmp_block: Int32, n_keys: Int32, scale_log2: Float32,
                   scale: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(), do_map.get_ptr(),
                 (p_ccu, p_cu, n_tok, seq_len, n_docs, n_slots, cmp_block), p_dq, p_lse, p_delta, n_kv, n_groups,
                 scale_log2, scale)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, n_q_heads: Int32,
                 q_st: Int64, q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, do_st: Int64,
                 do_sh: Int64, p_ccu: cute.Pointer, p_cu: cute.Pointer, p_dq: cute.Pointer, p_lse: cute.Pointer,
                 p_delta: cute.Pointer, n_tok: Int32, seq_len: Int32, n_docs: Int32, n_kv: Int32, n_groups: Int32,
                 n_slots: Int32, cmp_block: Int32, n_keys: Int32, scale_log2: Float32, scale: Float32):
            """The TMA descriptors of q and dO [N, HQ, ..] and the compressed k, v [n_keys, H, ..], then the
            launch."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, TOK)
            tk = rows_map(p_k, DT, D, n_kv, n_keys, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_keys, v_st, v_sh, 1, BN)
            tdo = rows_map(p_do, DT, DV, n_q_heads, n_tok, do_st, do_sh, G, TOK)
            kernel(tq, tk, tv, tdo, p_ccu, p_cu, p_dq, p_lse, p_delta, n_tok, seq_len, n_docs, n_kv, n_groups,
                   n_slots, cmp_block, n_keys, scale_log2, scale).launch(
                grid=(n_groups * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES,
                min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)
    else:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], do_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_idx: cute.Pointer, p_cnt: cute.Pointer, p_cu: cute.Pointer, p_dq: cute.Pointer,
                   p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, seq_len: Int32, n_docs: Int32,
                   n_kv: Int32, n_groups: Int32, n_slots: Int32, has_cnt: Int32, cnt_all: Int32, idx_st: Int64,
                   idx_sh: Int64, idx_ss: Int64, cnt_st: Int64, cnt_sh: Int64, scale_log2: Float32, scale: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(), do_map.get_ptr(),
                 (p_idx, p_cnt, p_cu, n_tok, seq_len, n_docs, n_slots, has_cnt, cnt_all, idx_st, idx_sh, idx_ss,
                  cnt_st, cnt_sh), p_dq, p_lse, p_delta, n_kv, n_groups, scale_log2, scale)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, n_q_heads: Int32,
                 q_st: Int64, q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, do_st: Int64,
                 do_sh: Int64, p_idx: cute.Pointer, p_cnt: cute.Pointer, p_cu: cute.Pointer, p_dq: cute.Pointer,
                 p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, seq_len: Int32, n_docs: Int32,
                 n_kv: Int32, n_groups: Int32, n_slots: Int32, has_cnt: Int32, cnt_all: Int32, idx_st: Int64,
                 idx_sh: Int64, idx_ss: Int64, cnt_st: Int64, cnt_sh: Int64, scale_log2: Float32, scale: Float32):
            """The TMA descriptors of q, k, v and dO (strides in elements, 16-byte units to the encoder), then the
            launch."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, TOK)
            tk = rows_map(p_k, DT, D, n_kv, n_tok, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_tok, v_st, v_sh, 1, BN)
            tdo = rows_map(p_do, DT, DV, n_q_heads, n_tok, do_st, do_sh, G, TOK)
            kernel(tq, tk, tv, tdo, p_idx, p_cnt, p_cu, p_dq, p_lse, p_delta, n_tok, seq_len, n_docs, n_kv,
                   n_groups, n_slots, has_cnt, cnt_all, idx_st, idx_sh, idx_ss, cnt_st, cnt_sh, scale_log2,
                   scale).launch(
                grid=(n_groups * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES,
                min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
