"""Fused dense attention score recompute for Hopper (sm_90a), the dense warm-up's attention target (cuDNN frontend
DSA §8): `DenseAttnScoreRecomputeSm90` and `build(...)`, as recompute_sm90 (the sparse form) does for its spec.

For query row tok = b * T + t (BSHD, B batch elements of T query rows and S keys each) and its visible keys
s < hi = clamp((q_off[b] + t + 1) // ratio, 0, S) (q_off[b] = 0 without offsets):

    out[tok, s] = sum_h exp2(scale * log2 e * q[tok, h] . k[b, s] - lse[tok, h] * log2 e)   for s < hi
    out[tok, s] = -inf                                                                     for hi <= s < S
    denom[tok]  = sum_{s < hi} out[tok, s]                                                 (0 when hi = 0)

The sparse form's CTA (one query row at a time, persistent over rows; Q resident, cp.async in 64-column blocks with
a ready mbarrier each; the key tiles of 64 rows in the same 64 x 64 column-block stages with ready / free mbarriers
per block; two consumer warpgroups on alternate tiles) with the keys and the products turned around:
  * producer: the row's tiles are the consecutive key rows b * S + 64 j .. + 63, one TMA box per 64-column block
    (warp 0; kv_ready[block] expects 1 arrival plus the box's 8 KB; rows past the key tensor arrive as zeros, rows
    past hi are loaded and never stored); before block 0 it still publishes the tile's ids (b * S + key, -1 past
    hi) on ids_mbar, the consumers' turn guard (class docstring). Against the sparse form's cp.async gather the
    boxes took 4-9% off.
  * consumers: S^T = K Q^T with the keys as the wgmma's M (64, from the stage) and the heads as its N (H, from the
    resident Q): D / 16 instructions of 64 x H x 16 per tile, a 64 x H accumulator, so the shared-memory operands
    are read once per k-step (the sparse form's M = heads reads the 64-key block once per 64 heads). Each thread
    holds two key rows (lane / 4 and + 8 of its warp's 16) over H / 4 heads: P = exp2(S * scale log2 e - lse log2 e)
    summed over its heads, then over its quad (two shuffles): every key's head sum in registers, no shared memory or
    named barrier per tile. Lane 4 m + r writes key row r of the pair when the key is below hi and adds it to its
    running denominator;
  * the row's end: the 64 writing lanes of each consumer put their sums into sDen[slot][consumer][row parity] (slot
    = warp * 16 + (lane / 4) * 2 + lane % 4) and both consumers meet on the named barrier BAR_DEN (256 threads);
    warp 0 of consumer 0 then adds the 128 partial sums in a fixed order (4 per lane, then a butterfly) and writes
    denom[tok]: bitwise repeatable;
  * all 256 consumer threads write -inf to columns hi .. S - 1 (the toolkit's dense_rows.fill_tail: 16-byte
    streaming stores between single fp32 stores at an unaligned row start / end);
  * only then does every consumer thread arrive on q_free, so the producer's next Q (and with it the other
    consumer's next row end, which rewrites sDen[the other parity] anyway) follows the reads of sDen.
Rows without a visible key: no tile, out all -inf, denom 0.

row_pairs (64 heads; DenseAttnScoreRecomputeSpec.row_pairs): an item is two consecutive query rows of a batch element
(the last row of an odd T alone; items = B * ceil(T / 2)); Q holds both rows' heads as rows 0..63 and 64..127 of a
128-row tile (two cp.async row sets per 64-column block, one ready mbarrier each, as one row's), so the wgmma's
N = 128 covers both rows and each key tile, loaded once up to the later row's limit, feeds both: half the key traffic
and shared-memory operand reads per FLOP of the one-row form at 64 heads. The thread's columns c < NCOL / 2 are the
first row's heads (the accumulator's 8-column groups below 64), so each key row gets two head sums; lanes 4 m + r
write the first row's, 4 m + 2 + r the second's, and each row's denominator is summed by its own warp of consumer 0
from sDen[.., .., parity, row]. One stage, as at 128 heads.

Constraints (DenseAttnScoreRecomputeSpec.reasons): those of the sparse form (H 64 or 128, D 512 or 576, bf16 /
fp16, register budgets); the host keeps q rows 16-byte aligned, k as B * S rows of D (the tensormap's view: unit
column stride, 16-byte aligned base and row stride), lse contiguous [rows, H] fp32, out contiguous [rows, ld_out]
fp32 (ld_out >= S), denom [rows] fp32.
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from dsagen.kernels.attn_score_recompute.recompute_sm90 import AttnScoreRecomputeSm90
from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.dense_rows import fill_tail, row_limit
from dsagen.kernels.common.sm90.gather import (cp_async_tiles_rows, load_row_tile, publish_tile_ids,
                                               row_gather_producer)
from dsagen.kernels.common.sm90.layout import acc_mn_view
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.tma import tma_load_box, tma_recipe

LOG2E = math.log2(math.e)


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D_QK), row stride ld_q
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(dtype, [64, 64])},  # kv (B * S, D_QK) -> (D, B S)
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
        {"name": "ld_out", "kind": "i64"},
        {"name": "softmax_scale", "kind": "f32"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def host_args(dtype: str) -> list[dict]:
    """The host entry's arguments (HOST_ARGS): PARAMS with the key tensormap replaced by what `host` encodes it from,
    the key rows' pointer, count and row stride (elements)."""
    p = params(dtype)
    return [p[0], {"name": "kv", "kind": "ptr", "dtype": dtype, "align": 16}, {"name": "n_kv", "kind": "i32"},
            {"name": "ld_kv", "kind": "i64"}] + p[2:]


def build(num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int,
          row_pairs: bool = False) -> BuiltKernel:
    """A new dense score recompute kernel for one DenseAttnScoreRecomputeSpec's values (distinct function objects
    on every call, so every rendered module names its own kernel)."""
    k = DenseAttnScoreRecomputeSm90(num_heads, d_qk, dtype, regs_producer, regs_consumer, row_pairs)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class DenseArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas; k_tma: the key tensormap's address)."""
    p_q: Any
    k_tma: Any
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
    ld_out: Any
    softmax_scale: Any


class DenseAttnScoreRecomputeSm90(AttnScoreRecomputeSm90):
    """The kernel of one DenseAttnScoreRecomputeSpec (module docstring): `kernel` and `host` (grid min(rows,
    n_ctas), 384 threads, min_blocks_per_mp=1); the sparse form's body, shared tiles (plus sDen; its sRed stays
    unused) and barriers, with its own producer (TMA key boxes) and consumer (keys as M, the head sums in registers,
    denominator, -inf tail). The consumers read no ids, but wait for each tile's ids_mbar as the sparse form's do:
    with one stage (H 128) a consumer's next tile g + 2 has the parity of tile g on every kv_ready, so its wait on
    block 0 would pass on tile g's completed phase while tile g + 1's is pending; the producer publishes tile g's
    ids only after tile g - 1 freed block 0, which it frees after its own wait on that block (blocks kb > 0 follow
    by the same chain: tile g + 2's block kb - 1 was loaded after tile g + 1 freed it, after its wait on block
    kb)."""

    BAR_DEN = 3                      # both consumers' partial denominators are in sDen (256 threads)
    ROW_DENOM = True                 # the shared struct gets sDen
    KV_READY_ARRIVALS = 1            # kv_ready: warp 0's TMA arrive + the box's transaction bytes

    def __init__(self, num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int,
                 row_pairs: bool = False):
        self.PAIRS = row_pairs
        self.HR = num_heads                       # heads per query row (lse's row stride)
        self.DEN_ROWS = 2 if row_pairs else 1     # query rows per item
        # the base's H is the Q tile's rows and the wgmma's N: both rows' heads with row_pairs (and one stage)
        super().__init__(2 * num_heads if row_pairs else num_heads, d_qk, dtype, regs_producer, regs_consumer,
                         prefetch_ids=False)

    def _entry_points(self):
        k = self
        DT, D_QK = self.dtype, self.D_QK

        @cute.kernel
        def kernel(p_q: cute.Pointer, k_map: cutlass.GridConstant[xcuda.TensorMap], p_lse: cute.Pointer,
                   p_out: cute.Pointer, p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32,
                   ratio: Int32, has_off: Int32, ld_q: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            k.body(DenseArgs(p_q, k_map.get_ptr(), p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q,
                             ld_out, softmax_scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_kv: cute.Pointer, n_kv: Int32, ld_kv: Int64, p_lse: cute.Pointer,
                 p_out: cute.Pointer, p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32,
                 ratio: Int32, has_off: Int32, ld_q: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            # the key rows (n_kv, D_QK) -> TMA dims (D_QK, n_kv); strides in 16-byte units (8 elements)
            tk = xcuda.create_tensor_map_tiled(global_address=p_kv.toint(), dtype=DT, global_dims=[D_QK, n_kv],
                                               global_strides=[ld_kv // 8], box_dims=[64, k.BN],
                                               swizzle=xcuda.TensorMapSwizzle.s128b)
            kernel(p_q, tk, p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q, ld_out, softmax_scale,
                   n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1),
                                  smem=k.Smem.size_in_bytes(), min_blocks_per_mp=1)

        return kernel, host

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def items(self, a):
        """The number of items: query rows, or with row_pairs pairs of consecutive rows of a batch element (the last
        row of an odd T alone)."""
        n = a.rows
        if const_expr(self.PAIRS):
            n = (a.rows // a.T) * ((a.T + 1) // 2)
        return n

    @cute.jit
    def item_rows(self, a, item):
        """(tok0, tok1, has1) of an item: its first row, its second (tok0 itself when it has none) and whether it
        has one. Without row_pairs: (item, item, False)."""
        if const_expr(not self.PAIRS):
            return item, item, False
        per = (a.T + 1) // 2
        b = item // per
        t0 = 2 * (item - b * per)
        tok0 = b * a.T + t0
        has1 = t0 + 1 < a.T
        tok1 = tok0 + 1 if has1 else tok0
        return tok0, tok1, has1

    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_kv, tidx, bidx, nctas):
        """Per item: Q block by block (cp.async; with row_pairs both rows' heads, rows 0..63 and 64..127 of the
        tile), then the item's tiles, key rows b * S + 64 j .. + 63 up to the later row's limit, one 64-column TMA box
        at a time (warp 0; rows past the key tensor arrive as zeros, rows past a row's limit are loaded and never
        stored for it); before block 0 the tile's ids (b * S + key, -1 past the limit) on ids_mbar, the consumers'
        turn guard (class docstring)."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sKV, lay_kv, self.BN)
        warp = tidx // 32
        gt = Int32(0)
        it = Int32(0)
        for item in cutlass.range(bidx, self.items(a), nctas, unroll=1):
            tok0, tok1, has1 = self.item_rows(a, item)
            b, hi = row_limit(a.p_off, a.has_off, tok0, a.T, a.S, a.ratio)
            if const_expr(self.PAIRS):
                _, hi1 = row_limit(a.p_off, a.has_off, tok1, a.T, a.S, a.ratio)
                hi = cutlass.max(hi, hi1)
            ntiles = (hi + self.BN - 1) // self.BN
            if const_expr(self.PAIRS):
                self.load_pair_q(p, sh, lay_q, a.p_q + Int64(tok0) * a.ld_q, a.p_q + Int64(tok1) * a.ld_q, it)
            else:
                load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok0) * a.ld_q, self.H, self.D_QK, p.lanes, p.policy,
                              it, sh.q_free, sh.q_ready, per_block=True)
            for j in cutlass.range(ntiles, unroll=1):
                for i in cutlass.range_constexpr(self.BN // 16):
                    key = j * self.BN + p.lanes.grp + 16 * i
                    p.ids[i] = b * a.S + key if key < hi else Int32(-1)
                self.load_tile(p, sh, a.k_tma, b * a.S + j * self.BN, warp, gt + j)
            gt += ntiles
            it += 1

    @cute.jit
    def load_pair_q(self, p, sh, lay_q, src0, src1, it):
        """row_pairs: item `it`'s two rows of Q (64 heads each, row stride D) into rows 0..63 and 64..127 of the tile,
        once the consumers freed it (q_free), one ready mbarrier per 64-column block (128 noinc arrivals, as
        load_row_tile's per_block)."""
        cute.arch.mbarrier_wait(sh.q_free, (it % 2) ^ 1)
        half = lay_q.outer((self.HR, 0)) * 2                      # bytes from row 0 to row 64 of a block (affine)
        for kb in cutlass.range_constexpr(self.NKB):
            cp_async_tiles_rows(((p.q_smem, lay_q, src0, self.D_QK, (kb, kb + 1)),
                                 (p.q_smem + half, lay_q, src1, self.D_QK, (kb, kb + 1))),
                                self.HR, p.lanes.grp, p.lanes.col0, p.policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(sh.q_ready + kb)

    @cute.jit
    def load_tile(self, p, sh, k_tma, row0, warp, g):
        """Tile g of the CTA (stage g % STAGES), key rows row0 .. row0 + 63: per 64-column block, once the tile's
        consumer freed the stage's block (kv_free), the tile's ids published before block 0 (sIds[g % 2], ids_mbar:
        the consumers' turn guard, class docstring), then warp 0's TMA box of the block completing kv_ready (1
        arrival + the box's bytes)."""
        s = g % self.STAGES
        free_phase = ((g // self.STAGES) % 2) ^ 1
        stage = sh.sKV[None, None, s].iterator
        for kb in cutlass.range_constexpr(self.NKB):
            cute.arch.mbarrier_wait(sh.kv_free + (s * self.NKB + kb), free_phase)
            if const_expr(kb == 0):
                publish_tile_ids(sh.sIds, (g % self.NIDS) * self.BN, p.ids, p.lanes, sh.ids_mbar + (g % self.NIDS))
            if warp == 0:
                tma_load_box(k_tma, stage + kb * self.BN * 64, (kb * 64, row0), sh.kv_ready + (s * self.NKB + kb),
                             self.BN * 64 * 2)

    # ------------------------------------------------------------------------------------- consumers (WG1, WG2)
    @cute.jit
    def consumer(self, a, sh, tidx, bidx, nctas):
        """Consumer w takes the tiles g = w mod 2 of each item: S^T = K Q^T on wgmma (M = the tile's 64 keys from the
        stage, N = the tile's H columns of resident Q: the row's heads, or with row_pairs both rows' 64), P =
        exp2(S * scale log2 e - lse log2 e) summed over the thread's columns of each row and over its quad (every
        key's head sums in registers; with row_pairs columns c < NCOL / 2 are the first row's), the visible keys
        written by lanes 4 m + r (key row r of the thread's two; with row_pairs lanes 4 m + 2 + r write the second
        row's), then at the item's end the denominators and the -inf tails (module docstring)."""
        BN, H, HR = self.BN, self.H, self.HR
        cute.arch.setmaxregister_increase(self.regs[1])
        # the consumer and its warp as warp-uniform values: ptxas serializes every wgmma of a loop whose trip count or
        # branches it cannot prove uniform within a warp (C7520, "WG.AR in divergent path")
        w = cute.arch.make_warp_uniform(tidx // 128 - 1)
        cwarp = cute.arch.make_warp_uniform((tidx // 32) % 4)
        ctid = tidx % 128
        lane = ctid % 32
        mma = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
                                                Float32, (1, 1, 1), tiler_mn=(BN, H))
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(ctid)
        tKrK = mma.make_fragment_A(thr.partition_A(sh.sKV))          # [.., .., k-step, stage]
        tKrQ = mma.make_fragment_B(thr.partition_B(sh.sQ))           # [.., .., k-step]
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BN, H)), Float32)
        accMN = acc_mn_view(acc)
        cMN = acc_mn_view(thr.partition_C(cute.make_identity_tensor((BN, H))))
        NCOL = cute.size(accMN, mode=[1])
        # with row_pairs the first half of the thread's columns are the first row's heads: accumulator columns go
        # (2 adjacent, then 8-column groups), so columns c < NCOL / 2 are the groups below H / 2
        NC0 = NCOL // 2 if const_expr(self.PAIRS) else NCOL
        lse_l2 = cute.make_rmem_tensor(NCOL, Float32)                # lse * log2 e of the thread's columns
        # its sDen entry: lanes 4 m + r (r < 2) write the first row, with row_pairs 4 m + 2 + r the second
        den_slot = cwarp * 16 + (lane // 4) * 2 + (lane % 2 if const_expr(self.PAIRS) else lane % 4)
        scale_log2 = a.softmax_scale * LOG2E

        gt = Int32(0)
        it = Int32(0)
        for item in cutlass.range(bidx, self.items(a), nctas, unroll=1):
            tok0, tok1, has1 = self.item_rows(a, item)
            _, hi0 = row_limit(a.p_off, a.has_off, tok0, a.T, a.S, a.ratio)
            hi = hi0
            hi1 = Int32(0)                                             # 0: the item has no second row
            if const_expr(self.PAIRS):
                _, hi_next = row_limit(a.p_off, a.has_off, tok1, a.T, a.S, a.ratio)
                hi1 = hi_next if has1 else Int32(0)
                hi = cutlass.max(hi0, hi1)
            ntiles = (hi + BN - 1) // BN
            p_row0 = a.p_out + Int64(tok0) * a.ld_out
            p_row1 = a.p_out + Int64(tok1) * a.ld_out if const_expr(self.PAIRS) else p_row0
            for c in cutlass.range_constexpr(NCOL):
                if const_expr(self.PAIRS):
                    tok_c = tok0 if c < NC0 else tok1
                    lse_l2[c] = (a.p_lse + (Int64(tok_c) * HR + cMN[0, c][1] % HR)).load() * LOG2E
                else:
                    lse_l2[c] = (a.p_lse + (Int64(tok0) * HR + cMN[0, c][1])).load() * LOG2E
            den = Float32(0.0)                                         # the sum of the keys this lane wrote
            for j in cutlass.range((gt + w) % 2, ntiles, 2, unroll=1):  # this consumer's tiles of the item
                g = gt + j
                st = g % self.STAGES
                ready_phase = (g // self.STAGES) % 2
                # the turn guard: tile g's ids are published once tile g - 1 freed block 0 of the stage, so a
                # consumer two tiles ahead never takes the previous phase of kv_ready[0] for its own (STAGES = 1)
                cute.arch.mbarrier_wait(sh.ids_mbar + (g % self.NIDS), (g // self.NIDS) % 2)
                acc.fill(0.0)
                warpgroup.fence()
                self.tile_products(sh, st, ready_phase, it, mma, [(acc, tKrK, st, tKrQ, None)])
                for r in cutlass.range_constexpr(2):
                    part0 = Float32(0.0)
                    for c in cutlass.range_constexpr(NC0):
                        part0 += cute.math.exp2(accMN[r, c] * scale_log2 - lse_l2[c], fastmath=True)
                    total0 = quad_sum(part0)
                    key = j * BN + cMN[r, 0][0]                         # the thread's key rows: lane / 4 (+ 8)
                    if lane % 4 == r and key < hi0:
                        (p_row0 + key).store(total0)
                        den += total0
                    if const_expr(self.PAIRS):
                        part1 = Float32(0.0)
                        for c in cutlass.range_constexpr(NC0, NCOL):
                            part1 += cute.math.exp2(accMN[r, c] * scale_log2 - lse_l2[c], fastmath=True)
                        total1 = quad_sum(part1)
                        if lane % 4 == r + 2 and key < hi1:
                            (p_row1 + key).store(total1)
                            den += total1
            # the item's end: denominators (fixed order), -inf tails, then Q may be replaced
            par = it % 2
            if const_expr(self.PAIRS):
                sh.sDen[den_slot, w, par, (lane % 4) // 2] = den
            elif lane % 4 < 2:
                sh.sDen[den_slot, w, par, 0] = den
            cute.arch.barrier(barrier_id=self.BAR_DEN, number_of_threads=256)
            if w == 0:
                for rr in cutlass.range_constexpr(self.DEN_ROWS):
                    if cwarp == rr:                                       # warp rr sums row rr's 128 partials
                        total = Float32(0.0)
                        for q4 in cutlass.range_constexpr(4):             # values 4 lane + q4 of the 128
                            idx = 4 * lane + q4
                            total += sh.sDen[idx % BN, idx // BN, par, rr]
                        for sh_off in cutlass.range_constexpr(5):
                            total += cute.arch.shuffle_sync_bfly(total, offset=1 << (4 - sh_off))
                        if (lane == 0 if rr == 0 else lane == 0 and has1):
                            (a.p_den + (tok0 if rr == 0 else tok1)).store(total)
            fill_tail(p_row0, hi0, a.S, ctid + 128 * w, 256, uniform_trips=True)
            if const_expr(self.PAIRS):
                if has1:
                    fill_tail(p_row1, hi1, a.S, ctid + 128 * w, 256, uniform_trips=True)
            self.free_row_q(sh, it)
            gt += ntiles
            it += 1
