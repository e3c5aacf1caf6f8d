"""NSA compressed-branch block importance on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one
NsaCmpImportanceSpec. For query token t (flattened over the batch, or packed sequences) and KV head h, with the
compressed forward's natural-log lse of each query head hq of h:

    imp[t - tok_begin, h, c] = sum_{hq of h} exp(scale q[t, hq] . k_cmp[kfirst + c, h] - lse[t, hq])

for the compressed rows c < (t's position in its sequence + 1) // cmp_block that the compressed attention read
(kfirst: the first compressed row of t's sequence), i.e. the probabilities the compressed branch gave its blocks,
summed over the G heads. Entries c >= that count are not written; the selection (cmp_topk_sm90) reads only the
blocks before t's own. Tokens [tok_begin, n_tok) are the launch's (a chunk of the call's tokens, so that the
FP32 scratch stays bounded); imp rows are imp_ld floats apart.

The items, the scheduler (select_common_sm90.make_cmp_schedule), the Q tile and the TMA ring of K tiles are the
compressed forward's (select_fwd_sm90 with compressed=True; no V). Per entry the consumer warpgroup computes S = Q K^T
(wgmma), frees the stage, forms P = exp2(S scale log2e - lse log2e) (0 where the row's token did not list the entry
or the row is past its token's last compressed row), and sums the G rows of each token in a fixed order: lane
shuffles over the rows a warp holds (G <= 8), the thread's two rows (G 16), then shared memory across warps (G 32,
64). The lanes that hold a token's sums store them: the same bits every call.

Constraints (NsaCmpImportanceSpec.reasons): G in 1..64 (a power of two), D 64 or 128, tiles of 64 compressed rows,
at most max_slots tiles per token; q [N, HQ, D], k_cmp [n_keys, H, D] with 16-byte aligned rows.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.mma import issue_gemm, wgmma_tile
from dsagen.kernels.common.sm90.ring import ring_wait_ready
from dsagen.kernels.common.sm90.tma import tma_load_tile, tma_recipe
from dsagen.kernels.nsa.select_common_sm90 import (CMP_PTR_PARAMS, CMP_SCALAR_PARAMS, REGS_CONSUMER, REGS_PRODUCER,
                                                   SMEM_2_CTAS, init_item_barriers, make_cmp_schedule,
                                                   make_kv_producer, row_key_limits, row_tokens, rows_map,
                                                   zero_padding_rows)
from dsagen.kernels.nsa.spec import CMP_TILE, MAX_TOK, item_tokens

LOG2E = math.log2(math.e)
M = 64
BAR_RED = 2                 # named barrier: the warps' partial sums are in shared memory (128 consumer threads)


def build(group: int, head_dim: int, max_slots: int, dtype: str, stages: int):
    """The kernel of NsaCmpImportanceSpec(group, head_dim, max_slots, dtype, stages): returns (kernel, host, PARAMS,
    HOST_ARGS, LAUNCH). Each call makes new kernel and host functions."""
    G, D, BN, ST = group, head_dim, CMP_TILE, stages
    TOK = item_tokens(G)
    ROWS = TOK * G
    NE = TOK * max_slots
    DT = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    KBQ = D // 64
    Q_BYTES = ROWS * D * 2
    NTHREADS = 256
    LOG_G = G.bit_length() - 1
    WARPS_PER_TOK = max(1, G // 16)      # warps holding one token's rows

    PARAMS = [
        {"name": "q_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, TOK])},   # q [N, HQ, D]
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # k_cmp [n_keys, H, D]
    ] + CMP_PTR_PARAMS + [
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [N, HQ] the compressed forward's
        {"name": "imp", "kind": "ptr", "dtype": "float32", "align": 4},      # [n_tok - tok_begin, H, imp_ld]
    ] + CMP_SCALAR_PARAMS + [
        {"name": "tok_begin", "kind": "i32"},                                # the launch's first token
        {"name": "imp_ld", "kind": "i32"},                                   # floats per imp row
        {"name": "scale_log2", "kind": "f32"},                               # softmax scale x log2(e)
    ]
    HOST_ARGS = ([{"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},
                  {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},
                  {"name": "n_q_heads", "kind": "i32"}]
                 + [{"name": n, "kind": "i64"} for n in ("q_st", "q_sh", "k_st", "k_sh")] + PARAMS[2:])

    @cute.struct
    class Smem:
        q_full: cute.struct.MemRange[Int64, 1]
        list_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, ST]
        v_full: cute.struct.MemRange[Int64, ST]              # initialised by init_item_barriers, not used (no V)
        kv_free: cute.struct.MemRange[Int64, ST]
        n_ent: cute.struct.MemRange[Int32, 4]
        tok_first: cute.struct.MemRange[Int32, MAX_TOK]
        tok_pos: cute.struct.MemRange[Int32, MAX_TOK]
        tok_blocks: cute.struct.MemRange[Int32, MAX_TOK]
        start: cute.struct.MemRange[Int32, NE]
        rank: cute.struct.MemRange[Int32, NE]
        ent: cute.struct.MemRange[Int32, 2 * NE]
        red: cute.struct.MemRange[Float32, 2 * 4 * BN]       # per entry parity and warp: its token's column sums
        sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * ST], 1024]

    SMEM_BYTES = Smem.size_in_bytes()
    schedule = make_cmp_schedule(TOK, NE, BN)
    k_producer = make_kv_producer(BN, D, D, ST, NE, with_v=False)
    CTAS_PER_SM = 2 if SMEM_BYTES <= SMEM_2_CTAS else 1
    LAUNCH = {"grid": ["n_groups * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": SMEM_BYTES}

    @cute.jit
    def body(q_tma, k_tma, p_ccu: cute.Pointer, p_cu: cute.Pointer, p_lse: cute.Pointer, p_imp: cute.Pointer,
             n_tok: Int32, seq_len: Int32, n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32,
             cmp_block: Int32, tok_begin: Int32, imp_ld: Int32, scale_log2: Float32):
        coords = cta_coords()
        tidx, bid, warp, wg = coords.tidx, coords.bidx, coords.warp, coords.wg
        lane = cute.arch.lane_idx()
        h = bid // n_groups
        t0 = tok_begin + (bid - h * n_groups) * TOK

        st = cutlass.memory.SmemAllocator().allocate(Smem)
        q_full = st.q_full.data_ptr()
        list_full = st.list_full.data_ptr()
        k_full = st.k_full.data_ptr()
        kv_free = st.kv_free.data_ptr()
        lq, lk = sw128(DT, (M, D)), sw128(DT, (BN, D, ST))
        sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)
        sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)
        s_ent = st.ent.get_tensor(cute.make_layout(2 * NE))
        n_ent = st.n_ent.get_tensor(cute.make_layout(4))
        tok_first = st.tok_first.get_tensor(cute.make_layout(MAX_TOK))
        red = st.red.get_tensor(cute.make_layout((BN, 4, 2)))

        init_item_barriers(warp, st, ST)

        if wg == 0:
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            if warp == 1:
                schedule(st, lane, t0, p_ccu, p_cu, n_tok, seq_len, n_docs, n_slots, cmp_block)
            if warp == 0:
                tma_load_tile(q_tma, ((sQ.iterator, M * 64, KBQ, (h * G, t0)),), q_full, Q_BYTES)
                k_producer(st, lane, h, k_tma, k_tma, sK, sK)
        else:
            cute.arch.setmaxregister_increase(REGS_CONSUMER[CTAS_PER_SM])
            ctid = tidx - 128
            cw = warp - 4                                    # the consumer warp: rows 16 cw .. 16 cw + 15
            qk = wgmma_tile(DT, sQ, sK, (M, BN), ctid)                    # S = Q K^T; B (.., .., k, stage)
            mma_qk, tSrQ, tSrK, accS, sMN, cS = qk.mma, qk.tA, qk.tB, qk.acc, qk.acc_mn, qk.coord_mn
            NR = cute.size(sMN, mode=[0])
            NC = cute.size(sMN, mode=[1])
            row_tok = cute.make_rmem_tensor(NR, Int32)
            row_pos = cute.make_rmem_tensor(NR, Int32)
            row_lim = cute.make_rmem_tensor(NR, Int32)
            row_lse = cute.make_rmem_tensor(NR, Float32)     # log2-domain lse (0 for a row without keys)

            if cutlass.const_expr(ROWS < M):
                zero_padding_rows(ctid, [(sQ, D)], ROWS, M)

            cute.arch.mbarrier_wait(list_full, 0)
            n = n_ent[0]
            row_tokens(st, cS, row_tok, row_pos, G, ROWS)
            row_key_limits(st, row_tok, row_pos, row_lim)
            for r in cutlass.range_constexpr(NR):
                row_lse[r] = Float32(0.0)
                if row_pos[r] >= 0:
                    row = cS[r, 0][0]
                    lse = (p_lse + (Int64(row_pos[r]) * (n_kv * G) + h * G + (row - row_tok[r] * G))).load()
                    if lse > -Float32.inf:
                        row_lse[r] = lse * LOG2E
            # the lanes that keep a token's sums: lane bits 2 .. 1 + min(log2 G, 3) zero (the reduced rows), and
            # for G >= 32 the first warp of the token's warps
            keep_lane = Int32(0)
            keep = Int32(0)
            if (lane >> 2) & ((1 << min(LOG_G, 3)) - 1) == 0:
                keep_lane = Int32(1)
                if cw % WARPS_PER_TOK == 0:
                    keep = Int32(1)
            cute.arch.mbarrier_wait(q_full, 0)
            for e in cutlass.range(n, unroll=1):
                stage = e % ST
                start = s_ent[2 * e]
                mask = s_ent[2 * e + 1]
                ring_wait_ready(k_full, e, ST)
                warpgroup.fence()
                issue_gemm(mma_qk, accS, tSrQ, tSrK, D // 16, stage)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if lane == 0:
                    cute.arch.mbarrier_arrive(kv_free + stage)
                for r in cutlass.range_constexpr(NR):
                    hi = Int32(-1)
                    if row_pos[r] >= 0 and (mask >> row_tok[r]) & 1 != 0:
                        hi = row_lim[r] - start
                    for c in cutlass.range_constexpr(NC):
                        p = cute.math.exp2(sMN[r, c] * scale_log2 - row_lse[r], fastmath=True)
                        if cS[r, c][1] > hi:
                            p = Float32(0.0)
                        sMN[r, c] = p
                # the G rows of a token: lanes (row bits 0..2), the thread's two rows (bit 3), warps (bits 4, 5)
                for c in cutlass.range_constexpr(NC):
                    for r in cutlass.range_constexpr(NR):
                        v = sMN[r, c]
                        for lvl in cutlass.range_constexpr(min(LOG_G, 3)):
                            v += cute.arch.shuffle_sync_bfly(v, offset=4 << lvl)
                        sMN[r, c] = v
                    if cutlass.const_expr(G >= 16):
                        sMN[0, c] = sMN[0, c] + sMN[1, c]
                if cutlass.const_expr(G >= 32):
                    if keep_lane != 0:
                        for c in cutlass.range_constexpr(NC):
                            red[cS[0, c][1], cw, e % 2] = sMN[0, c]
                    cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=128)
                    if keep != 0:
                        for c in cutlass.range_constexpr(NC):
                            col = cS[0, c][1]
                            v = red[col, cw, e % 2]
                            for w2 in cutlass.range_constexpr(1, WARPS_PER_TOK):
                                v = v + red[col, cw + w2, e % 2]
                            sMN[0, c] = v
                if keep != 0:
                    for r in cutlass.range_constexpr(1 if G >= 16 else NR):
                        pos = row_pos[r]
                        if pos >= 0 and (mask >> row_tok[r]) & 1 != 0:
                            tau = row_tok[r]
                            base = (Int64(pos - tok_begin) * n_kv + h) * imp_ld + (start - tok_first[tau])
                            lim = row_lim[r] - start
                            for c in cutlass.range_constexpr(NC):
                                col = cS[r, c][1]
                                if col <= lim:
                                    (p_imp + (base + col)).store(sMN[r, c])

    @cute.kernel
    def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
               p_ccu: cute.Pointer, p_cu: cute.Pointer, p_lse: cute.Pointer, p_imp: cute.Pointer, n_tok: Int32,
               seq_len: Int32, n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32, cmp_block: Int32,
               n_keys: Int32, tok_begin: Int32, imp_ld: Int32, scale_log2: Float32):
        body(q_map.get_ptr(), k_map.get_ptr(), p_ccu, p_cu, p_lse, p_imp, n_tok, seq_len, n_docs, n_kv, n_groups,
             n_slots, cmp_block, tok_begin, imp_ld, scale_log2)

    @cute.jit
    def host(p_q: cute.Pointer, p_k: cute.Pointer, n_q_heads: Int32, q_st: Int64, q_sh: Int64, k_st: Int64,
             k_sh: Int64, p_ccu: cute.Pointer, p_cu: cute.Pointer, p_lse: cute.Pointer, p_imp: cute.Pointer,
             n_tok: Int32, seq_len: Int32, n_docs: Int32, n_kv: Int32, n_groups: Int32, n_slots: Int32,
             cmp_block: Int32, n_keys: Int32, tok_begin: Int32, imp_ld: Int32, scale_log2: Float32):
        """The TMA descriptors of q [N, HQ, D] (rows up to n_tok) and k_cmp [n_keys, H, D], then the launch."""
        tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, TOK)
        tk = rows_map(p_k, DT, D, n_kv, n_keys, k_st, k_sh, 1, BN)
        kernel(tq, tk, p_ccu, p_cu, p_lse, p_imp, n_tok, seq_len, n_docs, n_kv, n_groups, n_slots, cmp_block,
               n_keys, tok_begin, imp_ld, scale_log2).launch(
            grid=(n_groups * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=100)

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
