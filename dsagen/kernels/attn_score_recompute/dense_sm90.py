"""Fused dense attention score recompute for Hopper (sm_90a), the dense warm-up's attention target (cuDNN frontend
DSA §8): `DenseAttnScoreRecomputeSm90` and `build(...)`, as recompute_sm90 (the sparse form) does for its spec.

For query row tok = b * T + t (BSHD, B batch elements of T query rows and S keys each) and its visible keys
s < hi = clamp((q_off[b] + t + 1) // ratio, 0, S) (q_off[b] = 0 without offsets):

    out[tok, s] = sum_h exp2(scale * log2 e * q[tok, h] . k[b, s] - lse[tok, h] * log2 e)   for s < hi
    out[tok, s] = -inf                                                                     for hi <= s < S
    denom[tok]  = sum_{s < hi} out[tok, s]                                                 (0 when hi = 0)

The sparse form's kernel with the gathered ids replaced by the row's consecutive keys: the producer warpgroup
gathers tile j's rows b * S + 64 j + n (n < 64; -1, zero-filled, past hi) through the same 64 x 64 column-block
stages, so everything the sparse kernel's docstring says about Q, the stages, the two consumers and their mbarriers
holds here. What differs is the consumers' row end:
  * each consumer thread c < 64 keeps the running sum of the column totals it wrote for the row (its tiles in
    order); at the row's end both consumers put them into sDen[row parity][consumer][c] and meet on the named
    barrier BAR_DEN (256 threads); warp 0 of consumer 0 then adds the 128 partial sums in a fixed order (4 per lane,
    then a butterfly) and writes denom[tok]: bitwise repeatable;
  * all 256 consumer threads write -inf to columns hi .. S - 1 (the toolkit's dense_rows.fill_tail: 16-byte
    streaming stores between single fp32 stores at an unaligned row start / end);
  * only then does every consumer thread arrive on q_free, so the producer's next Q (and with it the other
    consumer's next row end, which rewrites sDen[the other parity] anyway) follows the reads of sDen.
Rows without a visible key: no tile, out all -inf, denom 0.

Constraints (DenseAttnScoreRecomputeSpec.reasons): those of the sparse form (H 64 or 128, D 512 or 576, bf16 /
fp16, register budgets); the host keeps q rows 16-byte aligned, k as B * S contiguous rows of D (row stride ld_kv),
lse contiguous [rows, H] fp32, out contiguous [rows, ld_out] fp32 (ld_out >= S), denom [rows] fp32.
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from dsagen.kernels.attn_score_recompute.recompute_sm90 import AttnScoreRecomputeSm90
from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers
from dsagen.kernels.common.sm90.dense_rows import causal_count, fill_tail
from dsagen.kernels.common.sm90.gather import gather_tile_rows, load_row_tile, publish_tile_ids, row_gather_producer
from dsagen.kernels.common.sm90.ids import tile_keep_mask
from dsagen.kernels.common.sm90.layout import acc_mn_view, sw128
from dsagen.kernels.common.sm90.reduce import row_group_sum
from dsagen.kernels.common.sm90.ring import ring_mbarriers

LOG2E = math.log2(math.e)


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D_QK), row stride ld_q
        {"name": "kv", "kind": "ptr", "dtype": dtype, "align": 16},           # (B * S, D_QK), row stride ld_kv
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, H) contiguous
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, ld_out)
        {"name": "denom", "kind": "ptr", "dtype": "float32", "align": 4},     # (rows,)
        {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},       # (B,) causal offsets, read when has_off
        {"name": "rows", "kind": "i32"},                                      # B * T
        {"name": "T", "kind": "i32"},                                         # query rows per batch element
        {"name": "S", "kind": "i32"},                                         # keys per batch element
        {"name": "ratio", "kind": "i32"},
        {"name": "has_off", "kind": "i32"},
        {"name": "ld_q", "kind": "i64"},
        {"name": "ld_kv", "kind": "i64"},
        {"name": "ld_out", "kind": "i64"},
        {"name": "softmax_scale", "kind": "f32"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def build(num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int) -> BuiltKernel:
    """A new dense score recompute kernel for one DenseAttnScoreRecomputeSpec's values (distinct function objects
    on every call, so every rendered module names its own kernel)."""
    k = DenseAttnScoreRecomputeSm90(num_heads, d_qk, dtype, regs_producer, regs_consumer)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class DenseArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas)."""
    p_q: Any
    p_kv: Any
    p_lse: Any
    p_out: Any
    p_den: Any
    p_off: Any
    rows: Any
    T: Any
    S: Any
    ratio: Any
    has_off: Any
    ld_q: Any
    ld_kv: Any
    ld_out: Any
    softmax_scale: Any


class DenseShared(NamedTuple):
    """The CTA's shared tiles and barriers: the sparse form's (recompute_sm90.Shared) and sDen."""
    sQ: Any
    sKV: Any
    sIds: Any
    sRed: Any
    sDen: Any        # [consumer thread c < 64][consumer][row parity]: the row's partial denominators
    kv_ready: Any
    kv_free: Any
    ids_mbar: Any
    q_ready: Any
    q_free: Any


class DenseAttnScoreRecomputeSm90(AttnScoreRecomputeSm90):
    """The kernel of one DenseAttnScoreRecomputeSpec (module docstring): `kernel` and `host` (grid min(rows,
    n_ctas), 384 threads, min_blocks_per_mp=1), the sparse form's shared tiles plus sDen."""

    BAR_DEN = 3                      # both consumers' partial denominators are in sDen (256 threads)

    def __init__(self, num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int):
        super().__init__(num_heads, d_qk, dtype, regs_producer, regs_consumer, prefetch_ids=False)

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
            den: cute.struct.MemRange[Float32, 2 * 2 * BN]
            sQ: cute.struct.Align[cute.struct.MemRange[DT, H * D_QK], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[DT, STAGES * BN * D_QK], 1024]

        return Smem

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_lse: cute.Pointer, p_out: cute.Pointer,
                   p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32,
                   has_off: Int32, ld_q: Int64, ld_kv: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            k.dense_body(DenseArgs(p_q, p_kv, p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q, ld_kv,
                                   ld_out, softmax_scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_lse: cute.Pointer, p_out: cute.Pointer,
                 p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32,
                 has_off: Int32, ld_q: Int64, ld_kv: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            kernel(p_q, p_kv, p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q, ld_kv, ld_out,
                   softmax_scale, n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1),
                                                 smem=k.Smem.size_in_bytes(), min_blocks_per_mp=1)

        return kernel, host

    @cute.jit
    def row_keys(self, a: DenseArgs, tok):
        """(b, hi, ntiles) of row tok: its batch element, its visible keys [0, hi) and their 64-key tiles."""
        b = tok // a.T
        hi = causal_count(a.p_off, a.has_off, b, tok - b * a.T, a.S, a.ratio)
        return b, hi, (hi + self.BN - 1) // self.BN

    @cute.jit
    def dense_body(self, a: DenseArgs):
        """Shared views and barriers, then the roles: WG0 producer, WG1 and WG2 consumers."""
        DT, H, BN, D_QK = self.dtype, self.H, self.BN, self.D_QK
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (H, D_QK))
        lay_kv = sw128(DT, (BN, D_QK, self.STAGES))
        sh = DenseShared(sQ=st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner),
                         sKV=st.sKV.get_tensor(lay_kv.outer, swizzle=lay_kv.inner),
                         sIds=st.ids.get_tensor(cute.make_layout(self.NIDS * BN)),
                         sRed=st.red.get_tensor(cute.make_layout((BN, 4, 2, 2), stride=(1, BN, 4 * BN, 8 * BN))),
                         sDen=st.den.get_tensor(cute.make_layout((BN, 2, 2), stride=(1, BN, 2 * BN))),
                         kv_ready=st.kv_ready.data_ptr(), kv_free=st.kv_free.data_ptr(),
                         ids_mbar=st.ids_mbar.data_ptr(), q_ready=st.q_ready.data_ptr(), q_free=st.q_free.data_ptr())
        init_mbarriers(c.warp, ring_mbarriers(sh.kv_ready, sh.kv_free, self.STAGES * self.NKB, 128, 128)
                       + [(sh.ids_mbar + i, 16) for i in range(self.NIDS)]
                       + [(sh.q_ready + kb, 128) for kb in range(self.NKB)] + [(sh.q_free, 256)])
        if c.wg == 0:
            self.dense_producer(a, sh, st, lay_q, lay_kv, c.tidx, c.bidx, c.nctas)
        else:
            self.dense_consumer(a, sh, c.tidx, c.bidx, c.nctas)

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def dense_producer(self, a, sh, st, lay_q, lay_kv, tidx, bidx, nctas):
        """Per row: Q block by block, then per tile the consecutive key rows' ids (-1 past hi), published before
        block 0, and the rows one 64-column block at a time (the sparse form's producer with computed ids)."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sKV, lay_kv, self.BN)
        lanes, ids = p.lanes, p.ids
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            b, hi, ntiles = self.row_keys(a, tok)
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * a.ld_q, self.H, self.D_QK, lanes, p.policy, it,
                          sh.q_free, sh.q_ready, per_block=True)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % self.STAGES
                free_phase = ((g // self.STAGES) % 2) ^ 1
                for i in cutlass.range_constexpr(self.BN // 16):
                    key = j * self.BN + lanes.grp + 16 * i
                    ids[i] = b * a.S + key if key < hi else Int32(-1)
                for kb in cutlass.range_constexpr(self.NKB):
                    cute.arch.mbarrier_wait(sh.kv_free + (s * self.NKB + kb), free_phase)
                    if const_expr(kb == 0):
                        publish_tile_ids(sh.sIds, (g % self.NIDS) * self.BN, ids, lanes, sh.ids_mbar + (g % self.NIDS))
                    gather_tile_rows(p.kv_smem, p.sw_kv, lay_kv, a.p_kv, a.ld_kv, ids, lanes.col0, (kb, kb + 1),
                                     stage=s)
                    cute.arch.cp_async_mbarrier_arrive_noinc(sh.kv_ready + (s * self.NKB + kb))
            gt += ntiles
            it += 1

    # ------------------------------------------------------------------------------------- consumers (WG1, WG2)
    @cute.jit
    def dense_consumer(self, a, sh, tidx, bidx, nctas):
        """Consumer w takes the tiles g = w mod 2 with all H heads (the sparse form's S, P and column sums), writes
        the visible columns, then at the row's end the denominator and the -inf tail (module docstring)."""
        DT, BN, D_QK, NKB = self.dtype, self.BN, self.D_QK, self.NKB
        cute.arch.setmaxregister_increase(self.regs[1])
        w = tidx // 128 - 1
        ctid = tidx % 128
        cwarp = ctid // 32
        lane = ctid % 32
        mma = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                (1, 1, 1), tiler_mn=(64, BN))
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(ctid)
        tSrQ = [mma.make_fragment_A(thr.partition_A(cute.local_tile(sh.sQ, (64, D_QK), (mb, 0))))
                for mb in range(self.NMB)]
        tSrK = mma.make_fragment_B(thr.partition_B(sh.sKV))
        accS = [cute.make_rmem_tensor(thr.partition_shape_C((64, BN)), Float32) for _ in range(self.NMB)]
        sMN = [acc_mn_view(acc) for acc in accS]
        cS = acc_mn_view(thr.partition_C(cute.make_identity_tensor((64, BN))))
        NR = cute.size(sMN[0], mode=[0])
        NCOL = cute.size(sMN[0], mode=[1])
        lse_l2 = cute.make_rmem_tensor((NR, self.NMB), Float32)
        keep = cute.make_rmem_tensor(NCOL, cutlass.Boolean)
        scale_log2 = a.softmax_scale * LOG2E

        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            _, hi, ntiles = self.row_keys(a, tok)
            p_row = a.p_out + Int64(tok) * a.ld_out
            for mb in cutlass.range_constexpr(self.NMB):
                for r in cutlass.range_constexpr(NR):
                    lse_l2[r, mb] = (a.p_lse + (Int64(tok) * self.H + 64 * mb + cS[r, 0][0])).load() * LOG2E
            den = Float32(0.0)                                             # threads ctid < BN: their columns' sum
            for j in cutlass.range((gt + w) % 2, ntiles, 2, unroll=1):     # this consumer's tiles of the row
                g = gt + j
                s = g % self.STAGES
                ready_phase = (g // self.STAGES) % 2
                cute.arch.mbarrier_wait(sh.ids_mbar + (g % self.NIDS), (g // self.NIDS) % 2)
                tile_keep_mask(keep, sh.sIds, (g % self.NIDS) * BN, cS)
                for mb in cutlass.range_constexpr(self.NMB):
                    accS[mb].fill(0.0)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(NKB):
                    cute.arch.mbarrier_wait(sh.q_ready + kb, it % 2)
                    cute.arch.mbarrier_wait(sh.kv_ready + (s * NKB + kb), ready_phase)
                    cute.arch.fence_proxy("async.shared", space="cta")   # cp.async writes -> wgmma reads
                    for kk in cutlass.range_constexpr(4):
                        for mb in cutlass.range_constexpr(self.NMB):
                            cute.gemm(mma, accS[mb], tSrQ[mb][None, None, 4 * kb + kk],
                                      tSrK[None, None, 4 * kb + kk, s], accS[mb])
                    warpgroup.commit_group()
                    if const_expr(kb > 0):
                        warpgroup.wait_group(1)
                        cute.arch.mbarrier_arrive(sh.kv_free + (s * NKB + kb - 1))
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(sh.kv_free + (s * NKB + NKB - 1))
                buf = (g // 2) % 2
                for c in cutlass.range_constexpr(NCOL):
                    t = Float32(0.0)
                    for mb in cutlass.range_constexpr(self.NMB):
                        for r in cutlass.range_constexpr(NR):
                            t += cute.math.exp2(sMN[mb][r, c] * scale_log2 - lse_l2[r, mb], fastmath=True)
                    t = row_group_sum(t if keep[c] else Float32(0.0))
                    if lane < 4:
                        sh.sRed[cS[0, c][1], cwarp, buf, w] = t
                cute.arch.barrier(barrier_id=self.BAR_RED + w, number_of_threads=128)
                if ctid < BN:
                    key = j * BN + ctid
                    total = Float32(0.0)
                    for part in cutlass.range_constexpr(4):
                        total += sh.sRed[ctid, part, buf, w]
                    if key < hi:
                        (p_row + key).store(total)
                        den += total
            # the row's end: denominator (fixed order), -inf tail, then Q may be replaced
            par = it % 2
            if ctid < BN:
                sh.sDen[ctid, w, par] = den
            cute.arch.barrier(barrier_id=self.BAR_DEN, number_of_threads=256)
            if w == 0:
                if ctid < 32:
                    part = Float32(0.0)
                    for q4 in cutlass.range_constexpr(4):                   # values 4 lane + q4 of the 128
                        idx = 4 * lane + q4
                        part += sh.sDen[idx % BN, idx // BN, par]
                    for sh_off in cutlass.range_constexpr(5):
                        part += cute.arch.shuffle_sync_bfly(part, offset=1 << (4 - sh_off))
                    if lane == 0:
                        (a.p_den + tok).store(part)
            fill_tail(p_row, hi, a.S, ctid + 128 * w, 256)
            for kb in cutlass.range_constexpr(NKB):
                cute.arch.mbarrier_wait(sh.q_ready + kb, it % 2)   # Q's writes are done (rows without a tile too)
            cute.arch.mbarrier_arrive(sh.q_free)
            gt += ntiles
            it += 1
