"""NSA selected-branch backward, dk and dv, on Hopper tensor cores (sm_90a): `build(...)` makes the kernel of one
NsaSelectDkvSpec. Key blocks outer: CTA i takes dense block i of KV head h = i // nbd (a block = block_size key rows
of one sequence, first row `start`) and the tokens that selected it, in ascending token order (a token that named
the block twice is listed twice), from the host's sorted list (host.inverse_index). With the forward's lse and
delta = sum(dO * O) per query row:

    P^T = exp(scale k . q - lse),  dS^T = P^T (v . dO - delta),  dv = sum P^T dO,  dk = scale sum dS^T q

over the listed tokens' G query heads, keys after a token masked. Everything is computed with the keys as the wgmma M
(S^T = K Q^T, dP^T = V dO^T from shared memory, then dv += P^T dO and dk += dS^T Q with P^T and dS^T straight from
the accumulator registers), so no tile is transposed through shared memory. The CTA's K and V load once (TMA); the
listed tokens come in chunks of TOKB = 64 // max(G, 8) tokens whose Q and dO rows (one TMA box of G heads per token,
8-row aligned slots: G < 8 leaves zero rows) fill a ring of `stages` chunk tiles; warp 1 writes each chunk's
per-row position, lse and delta. With `overlap` the next chunk's S^T and dP^T are issued before this chunk's dv
and dk, and the next P^T / dS^T are formed while those run (the forward's order of S and PV). The sums run over the
list in its order: dk and dv are bitwise the same every call, with no atomics (each key row belongs to one block).
Rows of the block past its sequence's end are not stored.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.experimental import primitives as prims

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.epilogue import store_row_v4
from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view, sw128
from dsagen.kernels.common.sm90.mma import issue_gemm
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.ring import ring_wait_free, ring_wait_ready
from dsagen.kernels.common.sm90.tma import tma_load_tile, tma_recipe
from dsagen.kernels.nsa.select_common_sm90 import qkv_host_args, rows_map

LOG2E = math.log2(math.e)
NQ = 64                     # chunk rows (the wgmma N of S^T and dP^T, the K of dv and dk)
REGS_PRODUCER = 40
REGS_CONSUMER = 256         # one CTA per SM: dk and dv accumulators (64 + 64) beside S^T, dP^T, P^T and dS^T


def chunk_tokens(group: int) -> int:
    """Tokens per chunk: 64 rows of 8-row aligned slots of max(G, 8) rows."""
    return NQ // max(group, 8)


def build(group: int, head_dim: int, v_dim: int, block_size: int, dtype: str, stages: int, compressed: bool = False,
          overlap: bool = False):
    """The kernel of NsaSelectDkvSpec(group, head_dim, v_dim, block_size, dtype, stages, overlap), or with
    compressed=True of NsaCmpDkvSpec: the compressed branch's dk / dv over tiles of 64 compressed rows, each list
    entry carrying its token's last compressed row (`lims`, the mask's bound in place of the token's own row), the
    lists shared by the heads (off [nbd + 1]: CTA h * nbd + i takes list i for head h), and CTA i of head h storing
    its rows at (i * block_size + r) of a partial [nbd * block_size, H, ..] pair of outputs (a tile's tokens come in
    several lists, each its own CTA; the host sums the partials in a fixed order). overlap: the consumer issues the
    next chunk's S^T / dP^T before this chunk's dv / dk and forms the next P^T / dS^T while those run (the same
    products in the same order, so the same bytes); False: one chunk at a time.
    Returns (kernel, host, PARAMS, HOST_ARGS, LAUNCH)."""
    G, D, DV, BN, ST = group, head_dim, v_dim, block_size, stages
    SLOT = max(G, 8)                     # rows per token slot in a chunk tile
    TOKB = NQ // SLOT
    DT = cutlass.Float16 if dtype == "float16" else cutlass.BFloat16
    FP16 = dtype == "float16"
    KBQ, KBV = D // 64, DV // 64
    KV_BYTES = BN * (D + DV) * 2
    TOK_BYTES = G * (D + DV) * 2         # one token's Q and dO rows
    NTHREADS = 256

    PARAMS = [
        {"name": "q_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, 1])},     # q [N, HQ, D]
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # k [N, H, D]
        {"name": "v_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 1, BN])},    # v [N, H, DV]
        {"name": "do_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, G, 1])},    # dO [N, HQ, DV]
        {"name": "off", "kind": "ptr", "dtype": "int32", "align": 4},        # [n_blocks + 1] list offsets
        {"name": "toks", "kind": "ptr", "dtype": "int32", "align": 4},       # [L] tokens, by block, ascending
        {"name": "starts", "kind": "ptr", "dtype": "int32", "align": 4},     # [L] the entry's block's first key row
        {"name": "ends", "kind": "ptr", "dtype": "int32", "align": 4},       # [L] its end (the sequence's, if less)
    ] + ([{"name": "lims", "kind": "ptr", "dtype": "int32", "align": 4}] if compressed else []) + [   # [L] last key row
        {"name": "dk", "kind": "ptr", "dtype": dtype, "align": 16},          # [N, H, D] contiguous, zeroed
        {"name": "dv", "kind": "ptr", "dtype": dtype, "align": 16},          # [N, H, DV] contiguous, zeroed
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [N, HQ] the forward's (natural log)
        {"name": "delta", "kind": "ptr", "dtype": "float32", "align": 4},    # [N, HQ]
        {"name": "n_tok", "kind": "i32"},
        {"name": "n_kv", "kind": "i32"},
        {"name": "nbd", "kind": "i32"},                                      # dense blocks per KV head
    ] + ([{"name": "n_keys", "kind": "i32"}] if compressed else []) + [      # rows of k / v (compressed)
        {"name": "scale_log2", "kind": "f32"},
        {"name": "scale", "kind": "f32"},
    ]
    HOST_ARGS = qkv_host_args(dtype, True) + PARAMS[4:]

    @cute.struct
    class Smem:
        kv_full: cute.struct.MemRange[Int64, 1]
        c_full: cute.struct.MemRange[Int64, ST]
        c_free: cute.struct.MemRange[Int64, ST]
        c_pos: cute.struct.MemRange[Int32, ST * NQ]        # per chunk row: its token's row (-1: none)
        c_lse: cute.struct.MemRange[Float32, ST * NQ]      # its lse, log2 domain
        c_dlt: cute.struct.MemRange[Float32, ST * NQ]      # its delta
        sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[DT, BN * DV], 1024]
        sQ: cute.struct.Align[cute.struct.MemRange[DT, NQ * D * ST], 1024]
        sdO: cute.struct.Align[cute.struct.MemRange[DT, NQ * DV * ST], 1024]

    SMEM_BYTES = Smem.size_in_bytes()
    LAUNCH = {"grid": ["nbd * n_kv", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": SMEM_BYTES}

    @cute.jit
    def issue_scores(mma_t, accS, accP, tSrK, tSrQ, tPrV, tPrdO, c_full, c: Int32):
        """Wait for chunk c's tiles, then issue S^T = K Q^T and dP^T = V dO^T as one wgmma group."""
        stage = c % ST
        ring_wait_ready(c_full, c, ST)
        warpgroup.fence()
        issue_gemm(mma_t, accS, tSrK, tSrQ, D // 16, stage)
        issue_gemm(mma_t, accP, tPrV, tPrdO, DV // 16, stage)
        warpgroup.commit_group()

    @cute.jit
    def probabilities(sMN, pMN, cS, c_pos, c_lse, c_dlt, start: Int32, scale_log2: Float32, stage: Int32):
        """P^T and dS^T of the stage's chunk in place of S^T and dP^T (sMN / pMN: their (key, chunk row) views), 0
        for keys after a row's token and for rows without a token."""
        for cc in cutlass.range_constexpr(cute.size(sMN, mode=[1])):
            col = cS[0, cc][1]
            pos = c_pos[stage * NQ + col]
            l2 = c_lse[stage * NQ + col]
            dl = c_dlt[stage * NQ + col]
            for r in cutlass.range_constexpr(cute.size(sMN, mode=[0])):
                p = cute.math.exp2(sMN[r, cc] * scale_log2 - l2, fastmath=True)
                ds = p * (pMN[r, cc] - dl)
                if start + cS[r, cc][0] > pos:           # a key after the token (pos -1: no row)
                    p = Float32(0.0)
                    ds = Float32(0.0)
                sMN[r, cc] = p
                pMN[r, cc] = ds

    @cute.jit
    def issue_grads(mma_v, mma_k, accV, accK, tVrP, tVrdO, tKrdS, tKrQ, stage: Int32):
        """dv += P^T dO and dk += dS^T Q over the stage's 64 chunk rows (P^T, dS^T from registers), one wgmma
        group."""
        warpgroup.fence()
        for ks in cutlass.range_constexpr(NQ // 16):
            cute.gemm(mma_v, accV, tVrP[None, None, ks], tVrdO[None, None, ks, stage], accV)
        for ks in cutlass.range_constexpr(NQ // 16):
            cute.gemm(mma_k, accK, tKrdS[None, None, ks], tKrQ[None, None, ks, stage], accK)
        warpgroup.commit_group()

    @cute.jit
    def body(q_tma, k_tma, v_tma, do_tma, p_off: cute.Pointer, p_toks: cute.Pointer, p_starts: cute.Pointer,
             p_ends: cute.Pointer, p_lims: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer,
             p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, nbd: Int32, scale_log2: Float32,
             scale: Float32):
        coords = cta_coords()
        tidx, bid, warp, wg = coords.tidx, coords.bidx, coords.warp, coords.wg
        lane = cute.arch.lane_idx()
        h = bid // nbd
        li = bid                                     # the CTA's list: per (head, block); compressed: per block
        if cutlass.const_expr(compressed):
            li = bid - h * nbd
        off = (p_off + li).load()
        cnt = (p_off + li + 1).load() - off
        if cnt > 0:
            start = (p_starts + off).load()
            end = (p_ends + off).load()
            n_chunks = (cnt + TOKB - 1) // TOKB
            hq0 = h * G
            n_hq = n_kv * G

            st = cutlass.memory.SmemAllocator().allocate(Smem)
            kv_full = st.kv_full.data_ptr()
            c_full = st.c_full.data_ptr()
            c_free = st.c_free.data_ptr()
            c_pos = st.c_pos.get_tensor(cute.make_layout(ST * NQ))
            c_lse = st.c_lse.get_tensor(cute.make_layout(ST * NQ))
            c_dlt = st.c_dlt.get_tensor(cute.make_layout(ST * NQ))
            lk, lv = sw128(DT, (BN, D)), sw128(DT, (BN, DV))
            lq, ldo = sw128(DT, (NQ, D, ST)), sw128(DT, (NQ, DV, ST))
            sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)
            sV = st.sV.get_tensor(lv.outer, swizzle=lv.inner)
            sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)            # (chunk rows, D, stage)
            sdO = st.sdO.get_tensor(ldo.outer, swizzle=ldo.inner)        # (chunk rows, DV, stage)
            sQt = cute.composition(sQ, cute.make_layout((D, NQ, ST), stride=(NQ, 1, NQ * D)))       # Q^T
            sdOt = cute.composition(sdO, cute.make_layout((DV, NQ, ST), stride=(NQ, 1, NQ * DV)))   # dO^T

            # zero the chunk tiles once: rows no TMA box writes (slots of G < 8 rows, a last chunk's empty slots
            # before any chunk filled them) then multiply 0 (a NaN there would survive the 0 of a masked P)
            for i in cutlass.range(tidx, NQ * (D + DV) * ST, NTHREADS, unroll=1):
                if i < NQ * D * ST:
                    sQ[i % NQ, (i // NQ) % D, i // (NQ * D)] = DT(0.0)
                else:
                    j = i - NQ * D * ST
                    sdO[j % NQ, (j // NQ) % DV, j // (NQ * DV)] = DT(0.0)
            cute.arch.fence_proxy("async.shared", space="cta")
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(kv_full, 1)
                    for i in cutlass.range_constexpr(ST):
                        cute.arch.mbarrier_init(c_full + i, 33)      # the TMA warp's arrive + warp 1's 32 lanes
                        cute.arch.mbarrier_init(c_free + i, 128)    # every consumer thread: it read the row info
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER)
                if warp == 0:
                    # K and V of the block on one transaction count, then each chunk's tokens' Q and dO rows
                    tma_load_tile(k_tma, ((sK.iterator, BN * 64, KBQ, (h, start)),), kv_full, KV_BYTES)
                    with cute.arch.elect_one():
                        for kb in cutlass.range_constexpr(KBV):
                            prims.cp_async_bulk_tensor_shared_cta_global(sV.iterator + kb * BN * 64, v_tma,
                                                                         (kb * 64, h, start), kv_full)
                    for c in cutlass.range(n_chunks, unroll=1):
                        stage = c % ST
                        ring_wait_free(c_free, c, ST)
                        ntc = cutlass.min(cnt - c * TOKB, Int32(TOKB))
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(c_full + stage, ntc * TOK_BYTES)
                            for j in cutlass.range(ntc, unroll=1):
                                tok = (p_toks + off + c * TOKB + j).load()
                                row0 = j * SLOT * 64
                                for kb in cutlass.range_constexpr(KBQ):
                                    prims.cp_async_bulk_tensor_shared_cta_global(
                                        sQ[None, None, stage].iterator + (kb * NQ * 64 + row0), q_tma,
                                        (kb * 64, hq0, tok), c_full + stage)
                                for kb in cutlass.range_constexpr(KBV):
                                    prims.cp_async_bulk_tensor_shared_cta_global(
                                        sdO[None, None, stage].iterator + (kb * NQ * 64 + row0), do_tma,
                                        (kb * 64, hq0, tok), c_full + stage)
                if warp == 1:
                    # per chunk row: its token's row, lse (log2 domain) and delta; -1 where no row of a listed token
                    for c in cutlass.range(n_chunks, unroll=1):
                        stage = c % ST
                        ring_wait_free(c_free, c, ST)
                        for half in cutlass.range_constexpr(2):
                            col = lane + 32 * half
                            j = col // SLOT
                            g = col - j * SLOT
                            pos = Int32(-1)
                            l2 = Float32(0.0)
                            dl = Float32(0.0)
                            if g < G and c * TOKB + j < cnt:
                                tok = (p_toks + off + c * TOKB + j).load()
                                at = Int64(tok) * n_hq + hq0 + g
                                lse = (p_lse + at).load()
                                if lse > -Float32.inf:
                                    pos = tok
                                    if cutlass.const_expr(compressed):     # the token's last compressed row
                                        pos = (p_lims + off + c * TOKB + j).load()
                                    l2 = lse * LOG2E
                                    dl = (p_delta + at).load()
                            c_pos[stage * NQ + col] = pos
                            c_lse[stage * NQ + col] = l2
                            c_dlt[stage * NQ + col] = dl
                        cute.arch.mbarrier_arrive(c_full + stage)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                ctid = tidx - 128
                mma_t = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                          (1, 1, 1), tiler_mn=(BN, NQ))
                mma_k = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                          (1, 1, 1), tiler_mn=(BN, D),
                                                          a_source=warpgroup.OperandSource.RMEM)
                mma_v = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                          (1, 1, 1), tiler_mn=(BN, DV),
                                                          a_source=warpgroup.OperandSource.RMEM)
                thr_t = mma_t.get_slice(ctid)
                thr_k = mma_k.get_slice(ctid)
                thr_v = mma_v.get_slice(ctid)
                tSrK = mma_t.make_fragment_A(thr_t.partition_A(sK))
                tSrQ = mma_t.make_fragment_B(thr_t.partition_B(sQ))           # (.., .., k, stage)
                tPrV = mma_t.make_fragment_A(thr_t.partition_A(sV))
                tPrdO = mma_t.make_fragment_B(thr_t.partition_B(sdO))
                tKrQ = mma_k.make_fragment_B(thr_k.partition_B(sQt))          # Q^T: (D, rows, stage)
                tVrdO = mma_v.make_fragment_B(thr_v.partition_B(sdOt))        # dO^T: (DV, rows, stage)
                accS = cute.make_rmem_tensor(thr_t.partition_shape_C((BN, NQ)), Float32)    # S^T, then P^T
                accP = cute.make_rmem_tensor(thr_t.partition_shape_C((BN, NQ)), Float32)    # dP^T, then dS^T
                accK = cute.make_rmem_tensor(thr_k.partition_shape_C((BN, D)), Float32)
                accV = cute.make_rmem_tensor(thr_v.partition_shape_C((BN, DV)), Float32)
                rP = cute.make_rmem_tensor(accS.layout, DT)
                rdS = cute.make_rmem_tensor(accP.layout, DT)
                tVrP = acc_as_frg_a(rP)
                tKrdS = acc_as_frg_a(rdS)
                sMN, pMN = acc_mn_view(accS), acc_mn_view(accP)
                kMN, vMN = acc_mn_view(accK), acc_mn_view(accV)
                cS = acc_mn_view(thr_t.partition_C(cute.make_identity_tensor((BN, NQ))))
                accK.fill(0.0)
                accV.fill(0.0)
                mma_k.set(warpgroup.Field.ACCUMULATE, True)
                mma_v.set(warpgroup.Field.ACCUMULATE, True)
                q4 = ctid % 4

                scores = (mma_t, accS, accP, tSrK, tSrQ, tPrV, tPrdO, c_full)
                probs = (sMN, pMN, cS, c_pos, c_lse, c_dlt, start, scale_log2)
                grads = (mma_v, mma_k, accV, accK, tVrP, tVrdO, tKrdS, tKrQ)
                cute.arch.mbarrier_wait(kv_full, 0)
                if cutlass.const_expr(overlap):
                    # S^T / dP^T of the next chunk and dv / dk of this one go to the tensor cores back to back: the
                    # next chunk's P^T / dS^T are formed while this chunk's products run and replace its register
                    # operands once those retired (every product, and each accumulator's order, as the serial loop's)
                    issue_scores(*scores, Int32(0))
                    warpgroup.wait_group(0)
                    probabilities(*probs, Int32(0))
                    rP.store(accS.load().to(DT))
                    rdS.store(accP.load().to(DT))
                    for c in cutlass.range(n_chunks - 1, unroll=1):      # no wgmma under a branch (ptxas serializes)
                        nxt = c + 1
                        issue_scores(*scores, nxt)
                        issue_grads(*grads, c % ST)
                        warpgroup.wait_group(1)                          # the next chunk's S^T and dP^T
                        probabilities(*probs, nxt % ST)
                        warpgroup.wait_group(0)                          # this chunk's dv / dk: P^T, dS^T free
                        cute.arch.mbarrier_arrive(c_free + c % ST)
                        rP.store(accS.load().to(DT))
                        rdS.store(accP.load().to(DT))
                    last = n_chunks - 1
                    issue_grads(*grads, last % ST)
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(c_free + last % ST)
                else:
                    for c in cutlass.range(n_chunks, unroll=1):
                        issue_scores(*scores, c)
                        warpgroup.wait_group(0)
                        probabilities(*probs, c % ST)
                        rP.store(accS.load().to(DT))
                        rdS.store(accP.load().to(DT))
                        issue_grads(*grads, c % ST)
                        warpgroup.wait_group(0)
                        # every thread arrives: its own loads of the chunk's row info (c_pos / c_lse / c_dlt, which
                        # warp 1 rewrites for the stage's next chunk) are then ordered before that write
                        cute.arch.mbarrier_arrive(c_free + c % ST)

                # the block's key rows before its end: dk * scale and dv, 16-byte stores
                q_hi = q4 >= 2
                q_odd = q4 % 2 == 1
                policy = l2_evict_first_policy()
                cK = acc_mn_view(thr_k.partition_C(cute.make_identity_tensor((BN, D))))
                for r in cutlass.range_constexpr(cute.size(kMN, mode=[0])):
                    key = start + cK[r, 0][0]
                    if key < end:
                        at = Int64(key) * n_kv + h
                        if cutlass.const_expr(compressed):                 # the CTA's rows of the partials
                            at = Int64(li * BN + cK[r, 0][0]) * n_kv + h
                        store_row_v4(p_dk + (at * D + 8 * q4), kMN, r, scale, FP16, q_hi, q_odd, policy)
                        store_row_v4(p_dv + (at * DV + 8 * q4), vMN, r, None, FP16, q_hi, q_odd, policy)

    if compressed:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], do_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_off: cute.Pointer, p_toks: cute.Pointer, p_starts: cute.Pointer, p_ends: cute.Pointer,
                   p_lims: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer, p_lse: cute.Pointer,
                   p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, nbd: Int32, n_keys: Int32, scale_log2: Float32,
                   scale: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(), do_map.get_ptr(), p_off, p_toks, p_starts,
                 p_ends, p_lims, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, nbd, scale_log2, scale)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, n_q_heads: Int32,
                 q_st: Int64, q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, do_st: Int64,
                 do_sh: Int64, p_off: cute.Pointer, p_toks: cute.Pointer, p_starts: cute.Pointer,
                 p_ends: cute.Pointer, p_lims: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer,
                 p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, nbd: Int32, n_keys: Int32,
                 scale_log2: Float32, scale: Float32):
            """The TMA descriptors of q and dO [N, HQ, ..] and the compressed k, v [n_keys, H, ..], then the
            launch."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, 1)
            tk = rows_map(p_k, DT, D, n_kv, n_keys, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_keys, v_st, v_sh, 1, BN)
            tdo = rows_map(p_do, DT, DV, n_q_heads, n_tok, do_st, do_sh, G, 1)
            kernel(tq, tk, tv, tdo, p_off, p_toks, p_starts, p_ends, p_lims, p_dk, p_dv, p_lse, p_delta, n_tok,
                   n_kv, nbd, n_keys, scale_log2, scale).launch(
                grid=(nbd * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1,
                preferred_smem_carveout=100)
    else:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   v_map: cutlass.GridConstant[xcuda.TensorMap], do_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_off: cute.Pointer, p_toks: cute.Pointer, p_starts: cute.Pointer, p_ends: cute.Pointer,
                   p_dk: cute.Pointer, p_dv: cute.Pointer, p_lse: cute.Pointer, p_delta: cute.Pointer, n_tok: Int32,
                   n_kv: Int32, nbd: Int32, scale_log2: Float32, scale: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), v_map.get_ptr(), do_map.get_ptr(), p_off, p_toks, p_starts,
                 p_ends, p_toks, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, nbd, scale_log2, scale)

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_do: cute.Pointer, n_q_heads: Int32,
                 q_st: Int64, q_sh: Int64, k_st: Int64, k_sh: Int64, v_st: Int64, v_sh: Int64, do_st: Int64,
                 do_sh: Int64, p_off: cute.Pointer, p_toks: cute.Pointer, p_starts: cute.Pointer,
                 p_ends: cute.Pointer, p_dk: cute.Pointer, p_dv: cute.Pointer, p_lse: cute.Pointer,
                 p_delta: cute.Pointer, n_tok: Int32, n_kv: Int32, nbd: Int32, scale_log2: Float32, scale: Float32):
            """The TMA descriptors of q, k, v and dO (strides in elements, 16-byte units to the encoder), then the
            launch (one CTA per SM: 255 registers at launch, so the consumer's 256 fit the CTA's pool)."""
            tq = rows_map(p_q, DT, D, n_q_heads, n_tok, q_st, q_sh, G, 1)
            tk = rows_map(p_k, DT, D, n_kv, n_tok, k_st, k_sh, 1, BN)
            tv = rows_map(p_v, DT, DV, n_kv, n_tok, v_st, v_sh, 1, BN)
            tdo = rows_map(p_do, DT, DV, n_q_heads, n_tok, do_st, do_sh, G, 1)
            kernel(tq, tk, tv, tdo, p_off, p_toks, p_starts, p_ends, p_dk, p_dv, p_lse, p_delta, n_tok, n_kv, nbd,
                   scale_log2, scale).launch(
                grid=(nbd * n_kv, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1,
                preferred_smem_carveout=100)

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
