"""QSA backward, dq, on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one QsaDqSpec. With the
forward's natural-log lse and delta[hq, t] = sum(dO * O) of each query row (bwd_common_sm90):

    P_j = exp(scale q[t, hq] . k[u_j] - lse),   dS_j = P_j (dO[t, hq] . v[u_j] - delta),
    dq[t, hq] = scale sum_j dS_j k[u_j]

over the slots j whose id u_j lies in [0, T) (the forward's slots: the index row, or the bitmap form's selected
blocks; a repeated id counts once per slot).

Work items, producer and ring are the forward's (producer_sm90: one CTA per (token t, KV head g), t's G query heads
as the 64 rows, rows G..63 zero), with the item's dO rows gathered once beside its Q rows. Per tile the consumer
warpgroup issues S = Q K^T and dP = dO V^T as one wgmma group (SS, K-major), forms dS = P (dP - delta) in registers
(0 for a slot whose id is outside [0, T); P is 0 on padding rows, lse2 = +inf), and adds dS K into the dq
accumulator (dS from registers, K^T MN-major: 64 x D FP32, 128 registers at D 256, beside S and dP, 32 each); the
stage is freed once that product retired. Epilogue: dq * scale as bf16 / fp16 16-byte stores of rows < G (the
stores predicated, every lane running the quad shuffles). Each row's sum runs in slot order: bitwise the same on
every call; nothing but dq is written.

Constraints: QsaDqSpec.reasons (the forward's, shared memory for Q, dO and `stages` K / V tiles); layouts as the
forward's, dO [T, Hq, Dv] like q.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.epilogue import store_row_v4
from dsagen.kernels.common.sm90.gather import wait_gathered_tile
from dsagen.kernels.common.sm90.mma import issue_accumulate_group, issue_gemm, wgmma_tile, wgmma_tile_sibling
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.qsa.bwd_common_sm90 import REGS_CONSUMER, REGS_PRODUCER, params, row_stats, valid_id
from dsagen.kernels.qsa.producer_sm90 import BN, M, kernel_parts, launch_config, launch_declaration, make_item


def build(group: int, head_dim: int, v_dim: int, dtype: str, stages: int, bitmap: bool = False) -> BuiltKernel:
    """The kernel of QsaDqSpec(group, head_dim, v_dim, dtype, stages, bitmap); each call makes new kernel and host
    functions."""
    G, D, DV, ST = group, head_dim, v_dim, stages
    parts = kernel_parts(G, D, DV, dtype, ST, with_do=True)
    DT, SMEM_BYTES = parts.dtype, parts.smem_bytes
    FP16 = parts.fp16
    PARAMS = params(dtype, bitmap, [{"name": "dq", "kind": "ptr", "dtype": dtype, "align": 16}])  # [T, Hq, D]

    @cute.jit
    def consumer(st, ctid, lane, t, g, n_tiles, p_dq, p_lse, p_delta, n_tok, n_kv, scale_log2, scale):
        """S, dP, dS and dq += dS K of the item's tiles, then dq's stores (module docstring)."""
        sh = parts.prod.tiles(st)
        sIds, k_ready, v_ready, kv_free = sh.sIds, sh.k_ready, sh.v_ready, sh.kv_free
        sKt = cute.composition(sh.sK, cute.make_layout((D, BN, ST), stride=(BN, 1, BN * D)))   # K^T (MN-major)
        qk = wgmma_tile(DT, sh.sQ, sh.sK, (M, BN), ctid)              # S = Q K^T
        mma_s, tSrQ, tSrK, accS, sMN, cS = qk.mma, qk.tA, qk.tB, qk.acc, qk.acc_mn, qk.coord_mn
        dov = wgmma_tile_sibling(qk, sh.sdO, sh.sV)                   # dP = dO V^T
        tPrdO, tPrV, accP, pMN = dov.tA, dov.tB, dov.acc, dov.acc_mn
        rdS = cute.make_rmem_tensor(accS.layout, DT)
        dq = wgmma_tile(DT, None, sKt, (M, D), ctid, b_mn_major=True, a_regs=rdS)   # dq += dS K
        NR = cute.size(sMN, mode=[0])
        NC = cute.size(sMN, mode=[1])
        row_lse2 = cute.make_rmem_tensor(NR, Float32)
        row_dlt = cute.make_rmem_tensor(NR, Float32)
        ok = cute.make_rmem_tensor(NC, Int32)
        for r in cutlass.range_constexpr(NR):
            row_lse2[r], row_dlt[r] = row_stats(p_lse, p_delta, g * G, cS[r, 0][0], t, n_tok, G)
        dq.acc.fill(0.0)

        wait_gathered_tile(st.q_full.data_ptr(), 0, 1)
        for e in cutlass.range(n_tiles, unroll=1):
            s = e % ST
            wait_gathered_tile(k_ready, e, ST)
            warpgroup.fence()
            issue_gemm(mma_s, accS, tSrQ, tSrK, D // 16, s)
            wait_gathered_tile(v_ready, e, ST)
            issue_gemm(mma_s, accP, tPrdO, tPrV, DV // 16, s)
            warpgroup.commit_group()
            for c in cutlass.range_constexpr(NC):
                ok[c] = Int32(1) if valid_id(sIds[s * BN + cS[0, c][1]], n_tok) >= 0 else Int32(0)
            warpgroup.wait_group(0)
            for r in cutlass.range_constexpr(NR):
                for c in cutlass.range_constexpr(NC):
                    p = cute.math.exp2(sMN[r, c] * scale_log2 - row_lse2[r], fastmath=True)
                    ds = p * (pMN[r, c] - row_dlt[r])
                    if ok[c] == 0:
                        ds = Float32(0.0)
                    sMN[r, c] = ds
            rdS.store(accS.load().to(DT))
            issue_accumulate_group(dq.mma, dq.acc, dq.tA, dq.tB, BN // 16, s)
            warpgroup.wait_group(0)
            # the stage's K, V and ids are read: every lane's reads ordered before lane 0's arrival
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(kv_free + s)

        q4 = ctid % 4
        policy = l2_evict_first_policy()
        for r in cutlass.range_constexpr(NR):
            row = cS[r, 0][0]
            at = (Int64(t) * (n_kv * G) + g * G + cutlass.min(row, G - 1)) * D
            store_row_v4(p_dq + (at + 8 * q4), dq.acc_mn, r, scale, FP16, q4 >= 2, q4 % 2 == 1, policy,
                         keep=row < G)

    run_item = make_item(parts, bitmap, (REGS_PRODUCER, REGS_CONSUMER), consumer)
    if bitmap:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_bm: cute.Pointer,
                   p_cu: cute.Pointer, p_blk0: cute.Pointer, p_dq: cute.Pointer, p_lse: cute.Pointer,
                   p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64,
                   q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64, scale_log2: Float32, scale: Float32):
            run_item(((p_q, q_st), (p_do, do_st)), p_k, p_v, (p_bm, p_cu, p_blk0, n_docs, n_blocks, bm_st), n_tok,
                     k_st, v_st, (p_dq, p_lse, p_delta, n_tok, n_kv, scale_log2, scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_bm: cute.Pointer,
                 p_cu: cute.Pointer, p_blk0: cute.Pointer, p_dq: cute.Pointer, p_lse: cute.Pointer,
                 p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64,
                 q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64, scale_log2: Float32, scale: Float32):
            kernel(p_q, p_k, p_v, p_do, p_bm, p_cu, p_blk0, p_dq, p_lse, p_delta, n_tok, n_kv, n_docs, n_blocks,
                   bm_st, q_st, k_st, v_st, do_st, scale_log2, scale).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))
    else:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_idx: cute.Pointer,
                   p_dq: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32,
                   width: Int32, idx_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                   scale_log2: Float32, scale: Float32):
            run_item(((p_q, q_st), (p_do, do_st)), p_k, p_v, (p_idx, width, idx_st), n_tok, k_st, v_st,
                     (p_dq, p_lse, p_delta, n_tok, n_kv, scale_log2, scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_idx: cute.Pointer,
                 p_dq: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32,
                 width: Int32, idx_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                 scale_log2: Float32, scale: Float32):
            kernel(p_q, p_k, p_v, p_do, p_idx, p_dq, p_lse, p_delta, n_tok, n_kv, width, idx_st, q_st, k_st,
                   v_st, do_st, scale_log2, scale).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))

    return BuiltKernel(PARAMS, launch_declaration(SMEM_BYTES), kernel, host)
