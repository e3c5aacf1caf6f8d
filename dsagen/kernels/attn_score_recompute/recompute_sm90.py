"""Fused sparse attention score recompute for Hopper (sm_90a): `AttnScoreRecomputeSm90`, and `build(...)`, which
returns a fresh kernel and host entry of it with a spec's values bound as Python constants, plus the flat ABI
(`params`) and the launch declaration of the rendered kernel module.

An item is one query row t with all its H heads; the grid has min(rows, n_ctas) CTAs and CTA b runs rows b, b + grid,
... Per row, Q (H x D_QK) is loaded once into shared memory and the row's slots [0, kmax) go by in tiles of BN = 64
gathered rows, numbered g over the CTA's rows; tile g goes to KV stage g % STAGES (STAGES = 1 at 128 heads, 2 at
64: what fits beside Q) and to consumer g % 2, which computes it for all H heads while the other consumer runs the
epilogue of its own previous tile (the tensor cores stay busy through the exp2 and the column sums). A stage is NKB
= D_QK / 64 column blocks of 64 rows x 64 columns (8 KB each), each with its own ready / free mbarriers: a consumer
releases block kb as soon as its S k-steps over it retired, so the next tile's gather runs block by block under the
current tile's later k-steps. Q has a ready mbarrier per column block too, so a row's first tile starts on its
first blocks. Per tile, with the tile's rows K:
    P[h, n]  = exp2(scale * log2 e * (Q K^T)[h, n] - lse[t, h] * log2 e), 0 where the slot's id is invalid
    out[t, j] = sum_h P[h, n]                 (j = 64 * tile + n; the host divides by the row's sum over j)

Warpgroups (384 threads):
  WG0  producer   per row: Q block by block (cp.async, once both consumers finished the previous row: q_free, then
                  q_ready[kb] per block); per tile the ids of its rows (with prefetch_ids loaded during the previous
                  tile and range-checked now, the next tile's loads issued); per column block kb: wait until the
                  block of its stage is free (kv_free), before block 0 the ids into sIds[g % 2] (-1 where invalid or
                  past the row's length; ids_mbar[g % 2], 16 arrivals), then the block's 64 x 64 gather, cp.async
                  16-byte chunks zero-filled for invalid ids, completing kv_ready of the block (noinc arrivals).
  WG1, WG2 consumers w = 0, 1, the same code, on the tiles g = w mod 2: the tile's ids, then S on wgmma (SS, one
                  64 x 64 accumulator per 64 heads), one commit group per column block; block kb - 1 is freed once
                  only block kb's group is in flight; P; the column sums of the thread's rows, then over the warp's
                  8 row groups (shuffles), then the 4 warps' partial sums go to sRed[.., (g // 2) % 2, w] and, after
                  the consumer's named barrier BAR_RED + w (128 threads), its threads 0..63 each add one column's 4
                  partial sums in a fixed order and write it.
  mbarriers (it = the row's index among the CTA's rows, u = g // STAGES the stage's use): kv_ready[s][kb] (128
  noinc) waited with parity u % 2; kv_free[s][kb] (128: the tile's consumer, once per use, after its S k-steps over
  the block retired) waited by the producer with parity (u % 2) ^ 1; ids_mbar[g % 2] (16) waited with parity
  (g // 2) % 2; q_ready[kb] (128 noinc) waited with parity it % 2; q_free (256: every consumer thread once per row)
  waited by the producer with parity (it % 2) ^ 1.
  sIds is double-buffered (NIDS = 2): a consumer reads its tile's ids before it frees any of the tile's blocks, and
  the producer writes tile g's ids only after block 0 of tile g's stage was freed by tile g - STAGES, whose gather in
  turn waited for tile g - 2 (STAGES = 1: through tile g - 1) to free its block 0, after its ids were read.
  sRed is double-buffered per consumer: the consumer's tile g + 4 writes buffer (g // 2) % 2 only after its barrier
  of tile g + 2, which its summing threads reach after their reads of tile g.

Every value of the spec is a Python constant of the instance (configuration branches are `cutlass.const_expr`).
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers
from dsagen.kernels.common.sm90.gather import gather_tile_rows, load_row_tile, publish_tile_ids, row_gather_producer
from dsagen.kernels.common.sm90.ids import row_ids_ahead, row_slots, tile_ids, tile_keep_mask
from dsagen.kernels.common.sm90.layout import acc_mn_view, sw128
from dsagen.kernels.common.sm90.reduce import row_group_sum
from dsagen.kernels.common.sm90.ring import ring_mbarriers

LOG2E = math.log2(math.e)


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D_QK), row stride ld_q
        {"name": "kv", "kind": "ptr", "dtype": dtype, "align": 16},           # (n_kv, D_QK), row stride ld_kv
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (rows, topk), row stride ld_idx
        {"name": "topk_length", "kind": "ptr", "dtype": "int32", "align": 4},  # (rows,), read when has_length
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, H) contiguous
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, topk) contiguous, zeroed
        {"name": "rows", "kind": "i32"},
        {"name": "n_kv", "kind": "i32"},
        {"name": "topk", "kind": "i32"},
        {"name": "ld_q", "kind": "i64"},
        {"name": "ld_kv", "kind": "i64"},
        {"name": "ld_idx", "kind": "i64"},
        {"name": "softmax_scale", "kind": "f32"},
        {"name": "has_length", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def build(num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int,
          prefetch_ids: bool = False) -> BuiltKernel:
    """A new score recompute kernel for one AttnScoreRecomputeSpec's values. Each call returns distinct function
    objects, so every rendered module names its own kernel."""
    k = AttnScoreRecomputeSm90(num_heads, d_qk, dtype, regs_producer, regs_consumer, prefetch_ids)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class KernelArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas)."""
    p_q: Any
    p_kv: Any
    p_idx: Any
    p_len: Any
    p_lse: Any
    p_out: Any
    rows: Any
    n_kv: Any
    topk: Any
    ld_q: Any
    ld_kv: Any
    ld_idx: Any
    softmax_scale: Any
    has_length: Any


class Shared(NamedTuple):
    """The CTA's shared tiles and barriers (AttnScoreRecomputeSm90 docstring)."""
    sQ: Any
    sKV: Any
    sIds: Any        # [g % NIDS][row]: the tile's ids, -1 where invalid
    sRed: Any        # [column (64)][consumer warp (4)][(g // 2) % 2][consumer]: partial column sums
    sDen: Any        # the dense form's [slot < 64][consumer][item parity][row of the item] (None in the sparse form)
    kv_ready: Any    # [stage * NKB + column block]
    kv_free: Any     # [stage * NKB + column block]
    ids_mbar: Any    # [g % NIDS]
    q_ready: Any     # [column block]
    q_free: Any


class ConsumerState(NamedTuple):
    """A consumer thread's setup (AttnScoreRecomputeSm90.consumer_state), shared by the sparse and dense forms."""
    w: Any           # 0: WG1, 1: WG2 (run-time: both execute the same code)
    ctid: Any        # the thread in its consumer (0..127)
    cwarp: Any       # the warp in the consumer
    lane: Any
    mma: Any         # the S wgmma (M = 64 heads of a block, N = the tile's 64 rows)
    tSrQ: Any        # per 64-head block: Q's fragment [.., .., k-step]
    tSrK: Any        # the stages' fragment [.., .., k-step, stage]
    accS: Any        # per head block: S accumulator
    sMN: Any         # per head block: its (row, column) view
    cS: Any          # (row, column) coordinates of the accumulator's elements
    NR: Any          # rows per thread (Python int)
    NCOL: Any        # columns per thread (Python int)
    lse_l2: Any      # (NR, head blocks): the row's lse * log2 e
    keep: Any        # (NCOL,): the tile's column holds a valid id


class AttnScoreRecomputeSm90:
    """The kernel of one AttnScoreRecomputeSpec: `kernel` (the @cute.kernel, flat ABI in `params`) and `host` (the
    @cute.jit launch: grid min(rows, n_ctas), 384 threads, `Smem` dynamic smem, min_blocks_per_mp=1).

    Constraints (AttnScoreRecomputeSpec.reasons): num_heads 64 or 128, d_qk 512 or 576, dtype "bfloat16" or
    "float16", register budgets multiples of 8 summing to at most 504. `out` must be zeroed by the caller: slots
    past the row's last tile are not written.
    """

    BN = 64                          # gathered rows per tile
    THREADS = 384
    BAR_RED = 1                      # + w: consumer w's partial column sums are in sRed (128 threads)
    ROW_DENOM = False                # shared memory for per-row denominators (the dense form, dense_sm90)
    DEN_ROWS = 1                     # ... for this many query rows per item
    KV_READY_ARRIVALS = 128          # kv_ready: the gather's noinc arrivals (the dense form's TMA: 1 + bytes)

    def __init__(self, num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int,
                 prefetch_ids: bool = False):
        self.PREFETCH_IDS = prefetch_ids
        self.H = num_heads
        self.NMB = num_heads // 64               # 64-head blocks: one wgmma accumulator (M = 64) each
        self.D_QK = d_qk
        self.NKB = d_qk // 64
        self.STAGES = 1 if num_heads == 128 else 2   # KV stages beside Q in 227 KB of shared memory
        self.NIDS = 2                                # sIds buffers (class docstring)
        self.fp16 = dtype == "float16"
        self.dtype = cutlass.Float16 if self.fp16 else cutlass.BFloat16
        self.regs = (regs_producer, regs_consumer)
        self.Smem = self._smem_struct()
        self.kernel, self.host = self._entry_points()

    def _smem_struct(self):
        DT, H, BN, D_QK, NKB, STAGES = self.dtype, self.H, self.BN, self.D_QK, self.NKB, self.STAGES

        @cute.struct
        class Smem:
            kv_ready: cute.struct.MemRange[Int64, STAGES * NKB]
            kv_free: cute.struct.MemRange[Int64, STAGES * NKB]
            ids_mbar: cute.struct.MemRange[Int64, self.NIDS]
            q_ready: cute.struct.MemRange[Int64, NKB]
            q_free: cute.struct.MemRange[Int64, 1]
            ids: cute.struct.MemRange[Int32, self.NIDS * BN]
            red: cute.struct.MemRange[Float32, 2 * 2 * 4 * BN]
            if self.ROW_DENOM:
                den: cute.struct.MemRange[Float32, 2 * 2 * BN * self.DEN_ROWS]      # the dense form's sDen
            sQ: cute.struct.Align[cute.struct.MemRange[DT, H * D_QK], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[DT, STAGES * BN * D_QK], 1024]

        return Smem

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                   p_lse: cute.Pointer, p_out: cute.Pointer, rows: Int32, n_kv: Int32, topk: Int32, ld_q: Int64,
                   ld_kv: Int64, ld_idx: Int64, softmax_scale: Float32, has_length: Int32, n_ctas: Int32):
            k.body(KernelArgs(p_q, p_kv, p_idx, p_len, p_lse, p_out, rows, n_kv, topk, ld_q, ld_kv, ld_idx,
                              softmax_scale, has_length))

        @cute.jit
        def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                 p_lse: cute.Pointer, p_out: cute.Pointer, rows: Int32, n_kv: Int32, topk: Int32, ld_q: Int64,
                 ld_kv: Int64, ld_idx: Int64, softmax_scale: Float32, has_length: Int32, n_ctas: Int32):
            kernel(p_q, p_kv, p_idx, p_len, p_lse, p_out, rows, n_kv, topk, ld_q, ld_kv, ld_idx, softmax_scale,
                   has_length, n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1),
                                              smem=k.Smem.size_in_bytes(), min_blocks_per_mp=1)

        return kernel, host

    @cute.jit
    def body(self, a):
        """Shared views and barriers, then the roles: WG0 producer, WG1 and WG2 consumers (the sparse form's, or
        the dense form's overrides; `a`: the form's run-time arguments)."""
        DT, H, BN, D_QK = self.dtype, self.H, self.BN, self.D_QK
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (H, D_QK))
        lay_kv = sw128(DT, (BN, D_QK, self.STAGES))
        sh = Shared(sQ=st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner),
                    sKV=st.sKV.get_tensor(lay_kv.outer, swizzle=lay_kv.inner),
                    sIds=st.ids.get_tensor(cute.make_layout(self.NIDS * BN)),
                    sRed=st.red.get_tensor(cute.make_layout((BN, 4, 2, 2), stride=(1, BN, 4 * BN, 8 * BN))),
                    sDen=(st.den.get_tensor(cute.make_layout((BN, 2, 2, self.DEN_ROWS),
                                                             stride=(1, BN, 2 * BN, 4 * BN)))
                          if const_expr(self.ROW_DENOM) else None),
                    kv_ready=st.kv_ready.data_ptr(), kv_free=st.kv_free.data_ptr(), ids_mbar=st.ids_mbar.data_ptr(),
                    q_ready=st.q_ready.data_ptr(), q_free=st.q_free.data_ptr())
        # one ready / free pair per column block of every stage (the ring's stages are the blocks)
        init_mbarriers(c.warp, ring_mbarriers(sh.kv_ready, sh.kv_free, self.STAGES * self.NKB,
                                              self.KV_READY_ARRIVALS, 128)
                       + [(sh.ids_mbar + b, 16) for b in range(self.NIDS)]
                       + [(sh.q_ready + kb, 128) for kb in range(self.NKB)] + [(sh.q_free, 256)])
        if c.wg == 0:
            self.producer(a, sh, st, lay_q, lay_kv, c.tidx, c.bidx, c.nctas)
        else:
            self.consumer(a, sh, c.tidx, c.bidx, c.nctas)

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_kv, tidx, bidx, nctas):
        """Per row: Q block by block (load_row_tile per_block), then per tile its ids (prefetched with prefetch_ids),
        published before block 0, and the gathered rows one 64-column block at a time, each block's stage freed
        separately by the tile's consumer."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sKV, lay_kv, self.BN)
        lanes, ids = p.lanes, p.ids
        raw = cute.make_rmem_tensor(self.BN // 16, Int32)   # prefetch_ids: the next tile's ids, loaded early
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * a.ld_q, self.H, self.D_QK, lanes, p.policy, it,
                          sh.q_free, sh.q_ready, per_block=True)
            mIdx = cute.make_tensor(a.p_idx + Int64(tok) * a.ld_idx, cute.make_layout(a.topk))
            row_ids_ahead(raw, mIdx, ntiles, kmax, lanes.grp, self.PREFETCH_IDS)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                tile_ids(ids, raw, mIdx, j, ntiles, kmax, a.n_kv, lanes.grp, self.BN, self.PREFETCH_IDS)
                self.gather_tile(p, sh, lay_kv, a.p_kv, a.ld_kv, g)
            gt += ntiles
            it += 1

    @cute.jit
    def gather_tile(self, p, sh, lay_kv, p_kv, ld_kv, g):
        """Tile g of the CTA (stage g % STAGES), its ids in p.ids: per 64-column block, once the tile's consumer
        freed the stage's block (kv_free), the ids published before block 0 (sIds[g % 2], ids_mbar), then the
        block's rows (gather_tile_rows, zero-filled for -1) completing kv_ready with noinc arrivals."""
        s = g % self.STAGES
        free_phase = ((g // self.STAGES) % 2) ^ 1
        for kb in cutlass.range_constexpr(self.NKB):
            cute.arch.mbarrier_wait(sh.kv_free + (s * self.NKB + kb), free_phase)
            if const_expr(kb == 0):
                publish_tile_ids(sh.sIds, (g % self.NIDS) * self.BN, p.ids, p.lanes, sh.ids_mbar + (g % self.NIDS))
            gather_tile_rows(p.kv_smem, p.sw_kv, lay_kv, p_kv, ld_kv, p.ids, p.lanes.col0, (kb, kb + 1), stage=s)
            cute.arch.cp_async_mbarrier_arrive_noinc(sh.kv_ready + (s * self.NKB + kb))

    # ------------------------------------------------------------------------------------- consumers (WG1, WG2)
    def consumer_state(self, sh, tidx) -> "ConsumerState":
        """A consumer thread's setup (after its setmaxnreg): its place, the S wgmma with the fragments of Q (per
        64-head block) and of the stages, the accumulators and their (row, column) views, and registers for the
        row's lse and the tile's valid columns."""
        DT, BN, D_QK = self.dtype, self.BN, self.D_QK
        ctid = tidx % 128
        mma = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                (1, 1, 1), tiler_mn=(64, BN))
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(ctid)
        accS = [cute.make_rmem_tensor(thr.partition_shape_C((64, BN)), Float32) for _ in range(self.NMB)]
        sMN = [acc_mn_view(acc) for acc in accS]
        NR = cute.size(sMN[0], mode=[0])
        NCOL = cute.size(sMN[0], mode=[1])
        return ConsumerState(
            w=tidx // 128 - 1, ctid=ctid, cwarp=ctid // 32, lane=ctid % 32, mma=mma,
            tSrQ=[mma.make_fragment_A(thr.partition_A(cute.local_tile(sh.sQ, (64, D_QK), (mb, 0))))
                  for mb in range(self.NMB)],                            # per head block: [.., .., k-step]
            tSrK=mma.make_fragment_B(thr.partition_B(sh.sKV)),           # [.., .., k-step, stage]
            accS=accS, sMN=sMN, cS=acc_mn_view(thr.partition_C(cute.make_identity_tensor((64, BN)))),
            NR=NR, NCOL=NCOL, lse_l2=cute.make_rmem_tensor((NR, self.NMB), Float32),
            keep=cute.make_rmem_tensor(NCOL, cutlass.Boolean))

    def load_row_lse(self, cs: "ConsumerState", p_lse, tok) -> None:
        """lse[tok, h] * log2 e of the thread's rows of every head block into cs.lse_l2 (lse (rows, H) contiguous)."""
        for mb in range(self.NMB):                  # Python loops: unrolled at trace time
            for r in range(cs.NR):
                cs.lse_l2[r, mb] = (p_lse + (Int64(tok) * self.H + 64 * mb + cs.cS[r, 0][0])).load() * LOG2E

    @cute.jit
    def tile_column_sums(self, cs, sh, g, it, scale_log2):
        """Tile g (stage g % STAGES) for all heads: its ids' keep mask, S on wgmma (one commit group per column
        block, block kb - 1 freed once only block kb's group is in flight), P, and the column sums of the thread's
        rows summed over the warp's 8 row groups into sRed[.., (g // 2) % 2, w]; returns after the consumer's named
        barrier BAR_RED + w, so its threads may read the 4 warps' partial sums."""
        BN = self.BN
        s = g % self.STAGES
        ready_phase = (g // self.STAGES) % 2
        # the tile's ids first: sIds[g % 2] is rewritten after this consumer frees the tile's block 0
        cute.arch.mbarrier_wait(sh.ids_mbar + (g % self.NIDS), (g // self.NIDS) % 2)
        tile_keep_mask(cs.keep, sh.sIds, (g % self.NIDS) * BN, cs.cS)
        for mb in cutlass.range_constexpr(self.NMB):
            cs.accS[mb].fill(0.0)
        warpgroup.fence()
        self.tile_products(sh, s, ready_phase, it, cs.mma,
                           [(cs.accS[mb], cs.tSrQ[mb], None, cs.tSrK, s) for mb in range(self.NMB)])
        # P, summed over the thread's rows of every head block, then over the warp's 8 row groups
        buf = (g // 2) % 2
        for c in cutlass.range_constexpr(cs.NCOL):
            t = Float32(0.0)
            for mb in cutlass.range_constexpr(self.NMB):
                for r in cutlass.range_constexpr(cs.NR):
                    t += cute.math.exp2(cs.sMN[mb][r, c] * scale_log2 - cs.lse_l2[r, mb], fastmath=True)
            t = row_group_sum(t if cs.keep[c] else Float32(0.0))
            if cs.lane < 4:
                sh.sRed[cs.cS[0, c][1], cs.cwarp, buf, cs.w] = t
        cute.arch.barrier(barrier_id=self.BAR_RED + cs.w, number_of_threads=128)

    @cute.jit
    def tile_products(self, sh, s, ready_phase, it, mma, terms):
        """A consumer's products of the tile in stage s, block by block: per 64-column block kb, wait for Q's block
        (q_ready, parity it % 2) and the stage's (kv_ready, ready_phase), issue the block's 4 k-steps of every term
        as one commit group, and free block kb - 1 (kv_free) once only block kb's group is in flight; the last block
        is freed after all retired. terms: ((acc, A, A's stage or None, B, B's stage or None), ...), each k-step k a
        wgmma acc += A[.., .., k(, stage)] x B[.., .., k(, stage)] (the sparse form: per 64-head block, Q x the
        stage's keys; the dense form: the stage's keys x Q)."""
        NKB = self.NKB
        for kb in cutlass.range_constexpr(NKB):
            cute.arch.mbarrier_wait(sh.q_ready + kb, it % 2)         # at once after the row's first tile
            cute.arch.mbarrier_wait(sh.kv_ready + (s * NKB + kb), ready_phase)
            cute.arch.fence_proxy("async.shared", space="cta")   # cp.async writes -> wgmma reads
            for kk in cutlass.range_constexpr(4):
                k = 4 * kb + kk
                for acc, a_op, a_st, b_op, b_st in terms:
                    a_k = a_op[None, None, k] if const_expr(a_st is None) else a_op[None, None, k, a_st]
                    b_k = b_op[None, None, k] if const_expr(b_st is None) else b_op[None, None, k, b_st]
                    cute.gemm(mma, acc, a_k, b_k, acc)
            warpgroup.commit_group()
            if const_expr(kb > 0):
                warpgroup.wait_group(1)                            # block kb - 1 retired
                cute.arch.mbarrier_arrive(sh.kv_free + (s * NKB + kb - 1))
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(sh.kv_free + (s * NKB + NKB - 1))

    @cute.jit
    def free_row_q(self, sh, it):
        """A consumer thread's end of row `it`: wait until Q's copies landed (rows without a tile too), then free Q
        (q_free, 256 arrivals) for the producer's next row."""
        for kb in cutlass.range_constexpr(self.NKB):
            cute.arch.mbarrier_wait(sh.q_ready + kb, it % 2)
        cute.arch.mbarrier_arrive(sh.q_free)

    @cute.jit
    def column_total(self, cs, sh, g):
        """Thread ctid < BN: the total of tile g's column ctid (its 4 warps' partial sums in a fixed order)."""
        buf = (g // 2) % 2
        total = Float32(0.0)
        for part in cutlass.range_constexpr(4):
            total += sh.sRed[cs.ctid, part, buf, cs.w]
        return total

    @cute.jit
    def consumer(self, a, sh, tidx, bidx, nctas):
        """Consumer w takes the tiles g = w mod 2 with all H heads: S = Q K^T (one 64 x 64 accumulator per 64 heads),
        P, its column sums, written by its threads 0..63."""
        cute.arch.setmaxregister_increase(self.regs[1])
        cs = self.consumer_state(sh, tidx)
        scale_log2 = a.softmax_scale * LOG2E

        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)
            self.load_row_lse(cs, a.p_lse, tok)
            for j in cutlass.range((gt + cs.w) % 2, ntiles, 2, unroll=1):  # this consumer's tiles of the row
                g = gt + j
                self.tile_column_sums(cs, sh, g, it, scale_log2)
                if cs.ctid < self.BN:
                    slot = j * self.BN + cs.ctid
                    total = self.column_total(cs, sh, g)
                    if slot < a.topk:
                        (a.p_out + (Int64(tok) * a.topk + slot)).store(total)
            self.free_row_q(sh, it)
            gt += ntiles
            it += 1
