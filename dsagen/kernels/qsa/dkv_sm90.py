"""QSA backward, dk and dv, on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one QsaDkvSpec. With
the forward's natural-log lse and delta[hq, t] (bwd_common_sm90), for each slot j of query t whose id u_j lies in
[0, T) and each of t's query heads hq of KV head g:

    P_j = exp(scale q[t, hq] . k[u_j] - lse),   dS_j = P_j (dO[t, hq] . v[u_j] - delta),
    dv[u_j, g] += sum_hq P_j dO[t, hq],   dk[u_j, g] += scale sum_hq dS_j q[t, hq]

(a repeated id adds once per slot). Work items, producer and ring are the forward's (producer_sm90: one CTA per
(token t, KV head g)), the item's dO rows gathered once beside its Q rows. The keys are the wgmma M, so no tile is
transposed through shared memory: per tile the consumer warpgroup issues S^T = K Q^T and dP^T = V dO^T as one group
(M = the 64 slots, N = the 64 head rows), reads the tile's ids into registers and frees the stage (K and V are not
read again), forms P^T and dS^T = scale P^T (dP^T - delta) in the accumulators (head row n: lse2 = +inf on padding
rows, so P^T is 0 there), converts them to 16-bit A operands in registers, then dv_part = P^T dO and dk_part = dS^T Q
one after the other (64 x Dv / 64 x D FP32, 128 registers each at 256, never live together), each added into the
FP32 accumulators dv32 [T, Hkv, Dv] / dk32 [T, Hkv, D] by 16-byte red.global.add.v4.f32 of row pairs
(epilogue.add_row_pair_v4; slots whose id is outside [0, T) skipped).

Not deterministic: different items add into the same key rows in whatever order they run, so dk and dv can differ
in their last bits from call to call (the deterministic form, per key block over the queries that chose it through a
transposed selection bitset, is planned in notes/kernels/qsa.md). The accumulators must be zeroed by the caller,
which converts them to the inputs' dtype.

Constraints: QsaDkvSpec.reasons (as QsaDqSpec's); layouts as the forward's, dO [T, Hq, Dv] like q, dk32 / dv32
contiguous.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.epilogue import add_row_pair_v4
from dsagen.kernels.common.sm90.gather import wait_gathered_tile
from dsagen.kernels.common.sm90.mma import issue_gemm, wgmma_tile, wgmma_tile_sibling
from dsagen.kernels.qsa.bwd_common_sm90 import REGS_CONSUMER, REGS_PRODUCER, params, row_stats, valid_id
from dsagen.kernels.qsa.producer_sm90 import BN, M, kernel_parts, launch_config, launch_declaration, make_item


def build(group: int, head_dim: int, v_dim: int, dtype: str, stages: int, bitmap: bool = False) -> BuiltKernel:
    """The kernel of QsaDkvSpec(group, head_dim, v_dim, dtype, stages, bitmap); each call makes new kernel and host
    functions."""
    G, D, DV, ST = group, head_dim, v_dim, stages
    parts = kernel_parts(G, D, DV, dtype, ST, with_do=True)
    DT, SMEM_BYTES = parts.dtype, parts.smem_bytes
    PARAMS = params(dtype, bitmap, [
        {"name": "dk32", "kind": "ptr", "dtype": "float32", "align": 16},    # [T, Hkv, D] contiguous, zeroed
        {"name": "dv32", "kind": "ptr", "dtype": "float32", "align": 16},    # [T, Hkv, Dv] contiguous, zeroed
    ])

    @cute.jit
    def add_product(prod_tile, rows, row_len, id_even, id_odd, q_odd):
        """prod_tile.acc = A B (A the 16-bit P^T or dS^T in registers, B unstaged; fence, issue, commit, wait), then
        its rows added into the key rows of `rows` (row stride row_len) by 16-byte atomics, invalid ids skipped."""
        warpgroup.fence()
        issue_gemm(prod_tile.mma, prod_tile.acc, prod_tile.tA, prod_tile.tB, M // 16, None)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        for r in cutlass.range_constexpr(cute.size(id_even)):
            add_row_pair_v4(prod_tile.acc_mn, prod_tile.coord_mn, r, q_odd, rows, id_even[r], id_odd[r], row_len, 0)

    @cute.jit
    def consumer(st, ctid, lane, t, g, n_tiles, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, scale_log2, scale):
        """S^T, dP^T, P^T, dS^T, then dv_part and dk_part added into the key rows, per tile (module docstring)."""
        sh = parts.prod.tiles(st)
        sIds, k_ready, v_ready, kv_free = sh.sIds, sh.k_ready, sh.v_ready, sh.kv_free
        sQt = cute.composition(sh.sQ, cute.make_layout((D, M), stride=(M, 1)))       # Q^T (MN-major)
        sdOt = cute.composition(sh.sdO, cute.make_layout((DV, M), stride=(M, 1)))    # dO^T (MN-major)
        kq = wgmma_tile(DT, sh.sK, sh.sQ, (BN, M), ctid)              # S^T = K Q^T
        mma_t, tSrK, tSrQ, accS, sMN, cS = kq.mma, kq.tA, kq.tB, kq.acc, kq.acc_mn, kq.coord_mn
        vdo = wgmma_tile_sibling(kq, sh.sV, sh.sdO)                   # dP^T = V dO^T
        tPrV, tPrdO, accP, pMN = vdo.tA, vdo.tB, vdo.acc, vdo.acc_mn
        rP = cute.make_rmem_tensor(accS.layout, DT)
        rdS = cute.make_rmem_tensor(accS.layout, DT)
        dv = wgmma_tile(DT, None, sdOt, (BN, DV), ctid, b_mn_major=True, a_regs=rP)    # dv_part = P^T dO
        dk = wgmma_tile(DT, None, sQt, (BN, D), ctid, b_mn_major=True, a_regs=rdS)     # dk_part = dS^T Q
        NR = cute.size(sMN, mode=[0])
        NC = cute.size(sMN, mode=[1])
        col_lse2 = cute.make_rmem_tensor(NC, Float32)                # per head row (accumulator column)
        col_dlt = cute.make_rmem_tensor(NC, Float32)
        id_even = cute.make_rmem_tensor(NR, Int32)                   # the ids of the row pairs of the thread's rows
        id_odd = cute.make_rmem_tensor(NR, Int32)
        for c in cutlass.range_constexpr(NC):
            col_lse2[c], col_dlt[c] = row_stats(p_lse, p_delta, g * G, cS[0, c][1], t, n_tok, G)
        q_odd = ctid % 2 == 1
        dk_rows = p_dk + g * D                                       # key row u of head g: + u Hkv D
        dv_rows = p_dv + g * DV

        wait_gathered_tile(st.q_full.data_ptr(), 0, 1)
        for e in cutlass.range(n_tiles, unroll=1):
            s = e % ST
            wait_gathered_tile(k_ready, e, ST)
            warpgroup.fence()
            issue_gemm(mma_t, accS, tSrK, tSrQ, D // 16, None, a_stage=s)
            wait_gathered_tile(v_ready, e, ST)
            issue_gemm(mma_t, accP, tPrV, tPrdO, DV // 16, None, a_stage=s)
            warpgroup.commit_group()
            for r in cutlass.range_constexpr(NR):
                n_even = cS[r, 0][0] - cS[r, 0][0] % 2                # the pair's slots: n_even, n_even + 1
                id_even[r] = valid_id(sIds[s * BN + n_even], n_tok)
                id_odd[r] = valid_id(sIds[s * BN + n_even + 1], n_tok)
            warpgroup.wait_group(0)
            # the stage's K, V and ids are read: every lane's reads ordered before lane 0's arrival
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(kv_free + s)
            for r in cutlass.range_constexpr(NR):
                for c in cutlass.range_constexpr(NC):
                    p = cute.math.exp2(sMN[r, c] * scale_log2 - col_lse2[c], fastmath=True)
                    sMN[r, c] = p
                    pMN[r, c] = p * scale * (pMN[r, c] - col_dlt[c])
            rP.store(accS.load().to(DT))
            rdS.store(accP.load().to(DT))
            add_product(dv, dv_rows, n_kv * DV, id_even, id_odd, q_odd)
            add_product(dk, dk_rows, n_kv * D, id_even, id_odd, q_odd)

    run_item = make_item(parts, bitmap, (REGS_PRODUCER, REGS_CONSUMER), consumer)
    if bitmap:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_bm: cute.Pointer,
                   p_cu: cute.Pointer, p_blk0: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer,
                   p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, n_docs: Int32,
                   n_blocks: Int32, bm_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                   scale_log2: Float32, scale: Float32):
            run_item(((p_q, q_st), (p_do, do_st)), p_k, p_v, (p_bm, p_cu, p_blk0, n_docs, n_blocks, bm_st), n_tok,
                     k_st, v_st, (p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, scale_log2, scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_bm: cute.Pointer,
                 p_cu: cute.Pointer, p_blk0: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer,
                 p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, n_docs: Int32,
                 n_blocks: Int32, bm_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                 scale_log2: Float32, scale: Float32):
            kernel(p_q, p_k, p_v, p_do, p_bm, p_cu, p_blk0, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, n_docs, n_blocks,
                   bm_st, q_st, k_st, v_st, do_st, scale_log2, scale).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))
    else:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_idx: cute.Pointer,
                   p_dk: cute.Pointer, p_dv: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32,
                   n_kv: Int32, width: Int32, idx_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                   scale_log2: Float32, scale: Float32):
            run_item(((p_q, q_st), (p_do, do_st)), p_k, p_v, (p_idx, width, idx_st), n_tok, k_st, v_st,
                     (p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, scale_log2, scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, p_idx: cute.Pointer,
                 p_dk: cute.Pointer, p_dv: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32,
                 n_kv: Int32, width: Int32, idx_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64, do_st: Int64,
                 scale_log2: Float32, scale: Float32):
            kernel(p_q, p_k, p_v, p_do, p_idx, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, width, idx_st, q_st, k_st,
                   v_st, do_st, scale_log2, scale).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))

    return BuiltKernel(PARAMS, launch_declaration(SMEM_BYTES), kernel, host)
