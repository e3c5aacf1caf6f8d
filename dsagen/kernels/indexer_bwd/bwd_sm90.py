"""Fused sparse indexer backward for Hopper (sm_90a): `IndexerBwdSm90`, and `build(...)`, which returns a fresh kernel
and host entry of it with a spec's values bound as Python constants, plus the flat ABI (`params`) and the launch
declaration of the rendered kernel module.

The products of cuDNN frontend DSA §9 (kernel 2 of its three stages). An item is one query row t; the grid has
min(rows, n_ctas) CTAs and CTA b runs rows b, b + grid, ... Given the score gradient dI[t, j] (0 at invalid slots;
the host computes it from the two distributions), per tile of BN = 64 gathered rows K (the row's slots 64 j ..):
    S        = K Q^T                                   (64 slots x H heads; Q = index_q[t], H x D)
    dW[t, h] += sum_n dI[n] relu(S[n, h])
    G[n, h]   = dI[n] w[t, h] [S[n, h] > 0]            (rounded to the input dtype for the two products below)
    dQ[t]    += G^T K                                  (H x D)
    dK[id_n] += (G Q)[n]                               (FP32 atomics, 16 bytes each; invalid ids skipped)
dQ is written in the input dtype and dW in FP32 once per row; dK is the caller's zeroed FP32 accumulator.
With `ordered`, the row's ids come ordered by key window (host.run) and slot j's dI is dI[t, perm[t, j]].

Warpgroups (256 threads; the launch asks for CTAS_PER_SM = 2 resident CTAs per SM, which overlap each other's
MMAs, gathers and atomics):
  WG0  producer   per row: Q (cp.async, once the consumer's last product of the previous row retired: q_free,
                  completing q_full with noinc arrivals); per tile g of the CTA (stage s = g % STAGES): the ids of
                  the tile's rows (-1 where invalid), and once the stage is free (kv_free[s]) the 64 rows into stage s
                  (16-byte cp.async chunks, zero-filled for invalid ids) and, by the group leaders, the ids into
                  sIds[s] and dI into sDI[s]. kv_ready[s] completes on 128 noinc cp.async arrivals plus 16 leader
                  arrivals.
  WG1  consumer   per tile: S on wgmma (SS: A = the tile, M = 64 slots; B = Q, N = H); the thread's two slots' dI and
                  ids; dW partial sums in registers; G in registers (the RS A operand of dK) and in sG (stmatrix, the
                  MN-major A operand of dQ); then one commit group {dQ += G^T K (SS, B = the tile's MN-major view),
                  dK half 0 = G Q[:, :64] (RS, B = Q's MN-major view)}; its retirement frees the stage (kv_free[s]);
                  half 0's atomics; dK half 1 (D = 128); its atomics. Row end: dQ as 16-byte stores, q_free; the dW
                  partials summed over the warp's row groups (shuffles) and the 4 warps (sDW[it % 2], named barrier
                  BAR_DW), threads 0..H-1 write dW.
  Named barrier BAR_G (128, consumer only): every thread's G is in sG before the dQ wgmma reads it; the next tile's
  stmatrix into sG comes after this tile's wait for the dQ wgmma.
  mbarrier phases: kv_ready[s] waited with parity (g // STAGES) % 2; kv_free[s] by the producer with parity
  ((g // STAGES) % 2) ^ 1; q_full waited with parity it % 2; q_free by the producer with parity (it % 2) ^ 1.

Every value of the spec is a Python constant of the instance (configuration branches are `cutlass.const_expr`).
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers
from dsagen.kernels.common.sm90.epilogue import add_row_pair_v4, store_row_v4, store_slot_row_pair_v4
from dsagen.kernels.common.sm90.gather import gather_ring_tile, load_row_tile, row_gather_producer, wait_gathered_tile
from dsagen.kernels.common.sm90.ids import load_tile_ids
from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view, sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.reduce import row_group_sum
from dsagen.kernels.common.sm90.ring import ring_mbarriers


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D) contiguous
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},            # (n_k, D), row stride ld_k
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (rows, topk) contiguous, -1 invalid
        {"name": "d_i", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, topk) contiguous
        {"name": "w", "kind": "ptr", "dtype": "float32", "align": 4},         # (rows, H) contiguous
        {"name": "dq", "kind": "ptr", "dtype": dtype, "align": 16},           # (rows, H, D) contiguous
        {"name": "dw", "kind": "ptr", "dtype": "float32", "align": 4},        # (rows, H) contiguous
        {"name": "dk", "kind": "ptr", "dtype": "float32", "align": 16},       # (n_k, D) zeroed, or (rows, topk, D)
        {"name": "rows", "kind": "i32"},
        {"name": "n_k", "kind": "i32"},
        {"name": "topk", "kind": "i32"},
        {"name": "ld_k", "kind": "i64"},
        {"name": "perm", "kind": "ptr", "dtype": "int32", "align": 4},        # (rows, topk): dI's slot, if ordered
        {"name": "ordered", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def build(num_heads: int, head_dim: int, dtype: str, deterministic: bool, stages: int, regs_producer: int,
          regs_consumer: int) -> BuiltKernel:
    """A new indexer backward kernel for one IndexerBwdSpec's values. Each call returns distinct function objects,
    so every rendered module names its own kernel."""
    k = IndexerBwdSm90(num_heads, head_dim, dtype, deterministic, stages, regs_producer, regs_consumer)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class KernelArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas)."""
    p_q: Any
    p_k: Any
    p_idx: Any
    p_di: Any
    p_w: Any
    p_dq: Any
    p_dw: Any
    p_dk: Any
    rows: Any
    n_k: Any
    topk: Any
    ld_k: Any
    p_perm: Any
    ordered: Any


class Shared(NamedTuple):
    """The CTA's shared tiles and barriers (IndexerBwdSm90 docstring)."""
    sQ: Any          # (H, D)
    sK: Any          # (BN rows, D, STAGES)
    sG: Any          # (BN rows, H): G of the current tile
    sIds: Any        # [stage][row]: the tile's ids, -1 where invalid
    sDI: Any         # [stage][row]: the tile's dI
    sDW: Any         # [head][warp (4)][row parity]: the warps' dW partial sums
    kv_ready: Any
    kv_free: Any
    q_full: Any
    q_free: Any


class IndexerBwdSm90:
    """The kernel of one IndexerBwdSpec: `kernel` (the @cute.kernel, flat ABI in `params`) and `host` (the @cute.jit
    launch: grid min(rows, n_ctas), 256 threads, `Smem` dynamic smem, min_blocks_per_mp = 2).

    Constraints (IndexerBwdSpec.reasons): num_heads 64, head_dim 64 or 128, dtype "bfloat16" or "float16",
    2 <= stages <= 4, register budgets multiples of 8 with regs_producer + regs_consumer <= 256. Ids must be -1 or in
    [0, n_k); dI must be 0 at invalid slots. Deterministic: dk is (rows, topk, D) FP32 and each slot's row of G Q is
    stored there (slots past the row's last tile are not written) instead of added. perm (rows, topk) int32 is read
    at valid slots when ordered != 0 (dI's slot of each slot).
    """

    BN = 64                          # gathered rows (slots) per tile: wgmma M of S and dK
    THREADS = 256
    CTAS_PER_SM = 2
    BAR_G = 1                        # sG holds the tile's G (128 consumer threads)
    BAR_DW = 2                       # the warps' dW partial sums are in sDW (128 consumer threads)

    def __init__(self, num_heads: int, head_dim: int, dtype: str, deterministic: bool, stages: int,
                 regs_producer: int, regs_consumer: int):
        self.H = num_heads
        self.D = head_dim
        self.NKB = head_dim // 64        # 64-column halves of dK
        self.STAGES = stages
        self.deterministic = deterministic
        self.fp16 = dtype == "float16"
        self.dtype = cutlass.Float16 if self.fp16 else cutlass.BFloat16
        self.regs = (regs_producer, regs_consumer)
        self.Smem = self._smem_struct()
        self.kernel, self.host = self._entry_points()

    def _smem_struct(self):
        DT, H, BN, D, STAGES = self.dtype, self.H, self.BN, self.D, self.STAGES

        @cute.struct
        class Smem:
            kv_ready: cute.struct.MemRange[Int64, STAGES]
            kv_free: cute.struct.MemRange[Int64, STAGES]
            q_full: cute.struct.MemRange[Int64, 1]
            q_free: cute.struct.MemRange[Int64, 1]
            ids: cute.struct.MemRange[Int32, STAGES * BN]
            di: cute.struct.MemRange[Float32, STAGES * BN]
            dw: cute.struct.MemRange[Float32, H * 4 * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[DT, H * D], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[DT, BN * H], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * STAGES], 1024]

        return Smem

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_idx: cute.Pointer, p_di: cute.Pointer,
                   p_w: cute.Pointer, p_dq: cute.Pointer, p_dw: cute.Pointer, p_dk: cute.Pointer, rows: Int32,
                   n_k: Int32, topk: Int32, ld_k: Int64, p_perm: cute.Pointer, ordered: Int32, n_ctas: Int32):
            k.body(KernelArgs(p_q, p_k, p_idx, p_di, p_w, p_dq, p_dw, p_dk, rows, n_k, topk, ld_k, p_perm, ordered))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_idx: cute.Pointer, p_di: cute.Pointer,
                 p_w: cute.Pointer, p_dq: cute.Pointer, p_dw: cute.Pointer, p_dk: cute.Pointer, rows: Int32,
                 n_k: Int32, topk: Int32, ld_k: Int64, p_perm: cute.Pointer, ordered: Int32, n_ctas: Int32):
            kernel(p_q, p_k, p_idx, p_di, p_w, p_dq, p_dw, p_dk, rows, n_k, topk, ld_k, p_perm, ordered,
                   n_ctas).launch(
                grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1), smem=k.Smem.size_in_bytes(),
                min_blocks_per_mp=k.CTAS_PER_SM, preferred_smem_carveout=100)

        return kernel, host

    @cute.jit
    def body(self, a: KernelArgs):
        """Shared views and barriers, then the roles: WG0 producer, WG1 consumer."""
        DT, H, BN, D, STAGES = self.dtype, self.H, self.BN, self.D, self.STAGES
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (H, D))
        lay_k = sw128(DT, (BN, D, STAGES))
        lay_g = sw128(DT, (BN, H))
        sh = Shared(sQ=st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner),
                    sK=st.sK.get_tensor(lay_k.outer, swizzle=lay_k.inner),
                    sG=st.sG.get_tensor(lay_g.outer, swizzle=lay_g.inner),
                    sIds=st.ids.get_tensor(cute.make_layout(STAGES * BN)),
                    sDI=st.di.get_tensor(cute.make_layout(STAGES * BN)),
                    sDW=st.dw.get_tensor(cute.make_layout((H, 4, 2), stride=(1, H, 4 * H))),
                    kv_ready=st.kv_ready.data_ptr(), kv_free=st.kv_free.data_ptr(), q_full=st.q_full.data_ptr(),
                    q_free=st.q_free.data_ptr())
        # kv_ready: 128 noinc cp.async arrivals + 16 group leaders after their sIds / sDI stores
        init_mbarriers(c.warp, ring_mbarriers(sh.kv_ready, sh.kv_free, STAGES, 128 + 16, 128)
                       + [(sh.q_full, 128), (sh.q_free, 128)])
        if c.wg == 0:
            self.producer(a, sh, st, lay_q, lay_k, c.tidx, c.bidx, c.nctas)
        else:
            self.consumer(a, sh, c.tidx, c.bidx, c.nctas)

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_k, tidx, bidx, nctas):
        """Per row: Q (load_row_tile), then per tile the gathered key rows into the ring and, by the group leaders,
        the tile's ids and dI (read through perm when the ids come ordered) into sIds / sDI."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sK, lay_k, self.BN)
        lanes, ids, grp = p.lanes, p.ids, p.lanes.grp
        RPG = self.BN // 16
        ntiles = (a.topk + self.BN - 1) // self.BN
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * (self.H * self.D), self.H, self.D, lanes, p.policy,
                          it, sh.q_free, sh.q_full)
            mIdx = cute.make_tensor(a.p_idx + Int64(tok) * a.topk, cute.make_layout(a.topk))
            row_di = a.p_di + Int64(tok) * a.topk
            row_perm = a.p_perm + Int64(tok) * a.topk
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % self.STAGES
                load_tile_ids(ids, mIdx, j * self.BN, a.topk, a.n_k, grp)
                gather_ring_tile(p.kv_smem, p.sw_kv, lay_k, a.p_k, a.ld_k, ids, lanes.col0, (0, self.NKB), g,
                                 self.STAGES, sh.kv_ready, sh.kv_free)
                if tidx % 8 == 0:
                    for i in cutlass.range_constexpr(RPG):
                        slot = j * self.BN + grp + 16 * i
                        di = Float32(0.0)
                        if ids[i] >= 0:
                            src = slot
                            if a.ordered != 0:
                                src = (row_perm + slot).load()
                            di = (row_di + src).load()
                        sh.sIds[s * self.BN + grp + 16 * i] = ids[i]
                        sh.sDI[s * self.BN + grp + 16 * i] = di
                    cute.arch.mbarrier_arrive(sh.kv_ready + s)
            gt += ntiles
            it += 1

    # ------------------------------------------------------------------------------------------- consumer (WG1)
    @cute.jit
    def consumer(self, a, sh, tidx, bidx, nctas):
        """S, dW, G, dQ and dK per tile; dQ and dW per row."""
        DT, BN, H, D, STAGES = self.dtype, self.BN, self.H, self.D, self.STAGES
        cute.arch.setmaxregister_increase(self.regs[1])
        ctid = tidx - 128
        warp = ctid // 32
        lane = ctid % 32
        q4 = lane % 4
        # S = K Q^T: A = the tile (K-major), B = Q (K-major)
        S = wgmma_tile(DT, sh.sK, sh.sQ, (BN, H), ctid)          # tA (.., .., k, stage), tB (.., .., k)
        mma_s, tSrK, tSrQ, accS, sMN, cS = S.mma, S.tA, S.tB, S.acc, S.acc_mn, S.coord_mn
        NCOL = cute.size(sMN, mode=[1])
        rG = cute.make_rmem_tensor(accS.layout, DT)
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), DT), mma_s)
        thr_st = stsm.get_slice(ctid)
        tGsG = thr_st.partition_D(sh.sG)
        tGrG = thr_st.retile(rG)
        # dQ += G^T K: A = sG viewed (h, n) (MN-major), B = the tile viewed (d, n) (MN-major)
        sGt = cute.composition(sh.sG, cute.make_layout((H, BN), stride=(BN, 1)))                  # (h, n) = sG[n, h]
        sKt = cute.composition(sh.sK, cute.make_layout((D, BN, STAGES), stride=(BN, 1, BN * D)))  # (d, n, s)
        mma_q = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                                                  (1, 1, 1), tiler_mn=(H, D))
        thr_q = mma_q.get_slice(ctid)
        tQrG = mma_q.make_fragment_A(thr_q.partition_A(sGt))
        tQrK = mma_q.make_fragment_B(thr_q.partition_B(sKt))                                      # (.., .., k, s)
        accQ = cute.make_rmem_tensor(thr_q.partition_shape_C((H, D)), Float32)
        # dK half c = G Q[:, 64 c:]: A = G (registers), B = Q viewed (d, h) (MN-major)
        sQt = cute.composition(sh.sQ, cute.make_layout((D, H), stride=(H, 1)))                    # (d, h) = sQ[h, d]
        mma_k = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                  (1, 1, 1), tiler_mn=(BN, 64),
                                                  a_source=warpgroup.OperandSource.RMEM)
        thr_k = mma_k.get_slice(ctid)
        tKrG = acc_as_frg_a(rG)
        tKrQ = [mma_k.make_fragment_B(thr_k.partition_B(cute.local_tile(sQt, (64, H), (c, 0))))
                for c in range(self.NKB)]
        accK = cute.make_rmem_tensor(thr_k.partition_shape_C((BN, 64)), Float32)
        cK = acc_mn_view(thr_k.partition_C(cute.make_identity_tensor((BN, 64))))
        mma_q.set(warpgroup.Field.ACCUMULATE, True)
        mma_k.set(warpgroup.Field.ACCUMULATE, True)
        wreg = cute.make_rmem_tensor(NCOL, Float32)
        dw = cute.make_rmem_tensor(NCOL, Float32)
        di = cute.make_rmem_tensor(2, Float32)
        kv = cute.make_rmem_tensor(2, Int32)
        row0 = warp * 16 + lane // 4               # the thread's accumulator rows (slots): row0 and row0 + 8
        policy = l2_evict_first_policy()           # dQ is written once

        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            ntiles = self.row_tiles(a, tok)
            for c in cutlass.range_constexpr(NCOL):
                wreg[c] = (a.p_w + (Int64(tok) * H + cS[0, c][1])).load()
                dw[c] = Float32(0.0)
            accQ.fill(0.0)
            cute.arch.mbarrier_wait(sh.q_full, it % 2)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % STAGES
                wait_gathered_tile(sh.kv_ready, g, STAGES)
                gemm_tile(mma_s, accS, tSrK, tSrQ, D // 16, a_stage=s)
                for r in cutlass.range_constexpr(2):
                    di[r] = sh.sDI[s * BN + row0 + 8 * r]
                    kv[r] = sh.sIds[s * BN + row0 + 8 * r]
                # dW partials and G = dI w [S > 0], in place in the S accumulator
                for r in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(NCOL):
                        x = sMN[r, c]
                        pos = x > Float32(0.0)
                        dw[c] = dw[c] + di[r] * (x if pos else Float32(0.0))
                        sMN[r, c] = di[r] * wreg[c] if pos else Float32(0.0)
                rG.store(accS.load().to(DT))
                cute.copy(stsm, tGrG, tGsG)
                cute.arch.fence_proxy("async.shared", space="cta")   # st.shared G -> wgmma reads
                cute.arch.barrier(barrier_id=self.BAR_G, number_of_threads=128)
                # dQ += G^T K and dK half 0, one commit group; its retirement frees the stage
                warpgroup.fence()
                for kb in cutlass.range_constexpr(BN // 16):
                    cute.gemm(mma_q, accQ, tQrG[None, None, kb], tQrK[None, None, kb, s], accQ)
                accK.fill(0.0)
                for kb in cutlass.range_constexpr(H // 16):
                    cute.gemm(mma_k, accK, tKrG[None, None, kb], tKrQ[0][None, None, kb], accK)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(sh.kv_free + s)
                self.send_dk(a, accK, cK, kv, tok, j, 0, q4)
                for c in cutlass.range_constexpr(1, self.NKB):
                    accK.fill(0.0)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(H // 16):
                        cute.gemm(mma_k, accK, tKrG[None, None, kb], tKrQ[c][None, None, kb], accK)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    self.send_dk(a, accK, cK, kv, tok, j, c, q4)
            cute.arch.mbarrier_arrive(sh.q_free)
            # dQ: 16-byte stores of the thread's two rows (heads)
            oq = acc_mn_view(accQ)
            cq = acc_mn_view(thr_q.partition_C(cute.make_identity_tensor((H, D))))
            for r in cutlass.range_constexpr(2):
                dst = a.p_dq + ((Int64(tok) * H + cq[r, 0][0]) * D + 8 * q4)
                store_row_v4(dst, oq, r, None, self.fp16, q4 >= 2, q4 % 2 == 1, policy)
            # dW: over the warp's 8 row groups (lanes 4 apart), then the 4 warps in a fixed order
            for c in cutlass.range_constexpr(NCOL):
                v = row_group_sum(dw[c])
                if lane < 4:
                    sh.sDW[cS[0, c][1], warp, it % 2] = v
            cute.arch.barrier(barrier_id=self.BAR_DW, number_of_threads=128)
            if ctid < H:
                total = Float32(0.0)
                for w in cutlass.range_constexpr(4):
                    total += sh.sDW[ctid, w, it % 2]
                (a.p_dw + (Int64(tok) * H + ctid)).store(total)
            gt += ntiles
            it += 1

    @cute.jit
    def row_tiles(self, a, tok):
        """The 64-slot tiles of row tok: every row has ceil(topk / 64) (the dense form overrides it)."""
        return (a.topk + self.BN - 1) // self.BN

    @cute.jit
    def send_dk(self, a, accK, cK, kv, tok, j, c: int, q4):
        """dK half c of the tile's two rows of this thread: 16-byte FP32 atomic adds into dk[id] (deterministic:
        stores into dk[tok, slot]); invalid ids are skipped. The quads of two adjacent rows write 128-byte segments
        of one row per transaction (epilogue.add_row_pair_v4 / store_slot_row_pair_v4)."""
        kMN = acc_mn_view(accK)
        for r in cutlass.range_constexpr(2):
            n_even = cK[r, 0][0] - cK[r, 0][0] % 2                  # the pair's rows: n_even, n_even + 1
            if const_expr(self.deterministic):
                store_slot_row_pair_v4(kMN, cK, r, q4 % 2 == 1, a.p_dk, tok, a.topk, j * self.BN, n_even, a.topk,
                                       self.D, c * 64)
            else:
                kv_other = cute.arch.shuffle_sync_bfly(kv[r], offset=4)  # the other row's id (lane l ^ 4)
                odd_row = cK[r, 0][0] % 2 == 1
                kv_even = kv_other if odd_row else kv[r]
                kv_odd = kv[r] if odd_row else kv_other
                add_row_pair_v4(kMN, cK, r, q4 % 2 == 1, a.p_dk, kv_even, kv_odd, self.D, c * 64)
