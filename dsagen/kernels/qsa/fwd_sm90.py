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
  Producer warpgroup (producer_sm90.py, shared with the backward's kernels): the Q rows once (cp.async, rows past G
  zero-filled), then per tile its 64 ids (indexed: the row's slots, past the width -1; bitmap: the tokens of the
  tile's 16 blocks, found in the query's bitmap row between producer barriers), the listed tokens' K rows
  (zero-filled when the id is outside [0, T)), the ids into the stage's id slots and the V rows, through a ring of
  `stages` stages: k_ready[s], v_ready[s], kv_free[s] (one arrival per consumer warp, after the tile's PV retired).
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
from dsagen.kernels.common.sm90.epilogue import store_row_f32_v4, store_row_v4
from dsagen.kernels.common.sm90.gather import wait_gathered_tile
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, issue_accumulate_group, issue_gemm_group, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.softmax import rescale_rows, softmax_step_row
from dsagen.kernels.qsa.producer_sm90 import BN, M, kernel_parts, launch_config, launch_declaration, make_item, \
    select_params, select_scalar_params

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_INIT = -1.0e30          # initial running max: finite, so no -inf - -inf; masked scores are -inf
REGS_PRODUCER = 56
REGS_CONSUMER = 240


def params(dtype: str, bitmap: bool = False) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); bitmap: the bitmap form's selection arguments
    instead of the index rows'."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hq, D], token stride q_st
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, D], token stride k_st
        {"name": "v", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, Dv], token stride v_st
        *select_params(bitmap),
        {"name": "out", "kind": "ptr", "dtype": dtype, "align": 16},         # [T, Hq, Dv] contiguous
        {"name": "out32", "kind": "ptr", "dtype": "float32", "align": 16},   # [T, Hq, Dv] contiguous
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [Hq, T] contiguous
        {"name": "n_tok", "kind": "i32"},                                    # T
        {"name": "n_kv", "kind": "i32"},                                     # Hkv
        *select_scalar_params(bitmap),
        {"name": "q_st", "kind": "i64"},
        {"name": "k_st", "kind": "i64"},
        {"name": "v_st", "kind": "i64"},
        {"name": "scale_log2", "kind": "f32"},                               # softmax scale x log2(e)
    ]


def build(group: int, head_dim: int, v_dim: int, dtype: str, stages: int, bitmap: bool = False) -> BuiltKernel:
    """The kernel of QsaFwdSpec(group, head_dim, v_dim, dtype, stages, bitmap); each call makes new kernel and host
    functions."""
    G, D, DV, ST = group, head_dim, v_dim, stages
    parts = kernel_parts(G, D, DV, dtype, ST, with_do=False)
    DT, FP16, SMEM_BYTES = parts.dtype, parts.fp16, parts.smem_bytes

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
    def consumer(st, ctid, lane, t, g, n_tiles, p_out, p_out32, p_lse, n_tok, n_kv, scale_log2):
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

    run_item = make_item(parts, bitmap, (REGS_PRODUCER, REGS_CONSUMER), consumer)
    if bitmap:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_bm: cute.Pointer, p_cu: cute.Pointer,
                   p_blk0: cute.Pointer, p_out: cute.Pointer, p_out32: cute.Pointer, p_lse: cute.Pointer,
                   n_tok: Int32, n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64, q_st: Int64,
                   k_st: Int64, v_st: Int64, scale_log2: Float32):
            run_item(((p_q, q_st),), p_k, p_v, (p_bm, p_cu, p_blk0, n_docs, n_blocks, bm_st), n_tok, k_st, v_st,
                     (p_out, p_out32, p_lse, n_tok, n_kv, scale_log2))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_bm: cute.Pointer, p_cu: cute.Pointer,
                 p_blk0: cute.Pointer, p_out: cute.Pointer, p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32,
                 n_kv: Int32, n_docs: Int32, n_blocks: Int32, bm_st: Int64, q_st: Int64, k_st: Int64, v_st: Int64,
                 scale_log2: Float32):
            kernel(p_q, p_k, p_v, p_bm, p_cu, p_blk0, p_out, p_out32, p_lse, n_tok, n_kv, n_docs, n_blocks, bm_st,
                   q_st, k_st, v_st, scale_log2).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))
    else:
        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_idx: cute.Pointer, p_out: cute.Pointer,
                   p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, n_kv: Int32, width: Int32, idx_st: Int64,
                   q_st: Int64, k_st: Int64, v_st: Int64, scale_log2: Float32):
            run_item(((p_q, q_st),), p_k, p_v, (p_idx, width, idx_st), n_tok, k_st, v_st,
                     (p_out, p_out32, p_lse, n_tok, n_kv, scale_log2))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_idx: cute.Pointer, p_out: cute.Pointer,
                 p_out32: cute.Pointer, p_lse: cute.Pointer, n_tok: Int32, n_kv: Int32, width: Int32, idx_st: Int64,
                 q_st: Int64, k_st: Int64, v_st: Int64, scale_log2: Float32):
            kernel(p_q, p_k, p_v, p_idx, p_out, p_out32, p_lse, n_tok, n_kv, width, idx_st, q_st, k_st, v_st,
                   scale_log2).launch(**launch_config(n_tok, n_kv, SMEM_BYTES))

    return BuiltKernel(params(dtype, bitmap), launch_declaration(SMEM_BYTES), kernel, host)
