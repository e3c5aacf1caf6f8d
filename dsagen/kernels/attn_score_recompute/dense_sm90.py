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
from cutlass import Float32, Int32, Int64

from dsagen.kernels.attn_score_recompute.recompute_sm90 import AttnScoreRecomputeSm90
from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.dense_rows import fill_tail, row_limit
from dsagen.kernels.common.sm90.gather import load_row_tile, row_gather_producer

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


class DenseAttnScoreRecomputeSm90(AttnScoreRecomputeSm90):
    """The kernel of one DenseAttnScoreRecomputeSpec (module docstring): `kernel` and `host` (grid min(rows,
    n_ctas), 384 threads, min_blocks_per_mp=1); the sparse form's body, shared tiles (plus sDen), tile gather and
    tile column sums, with its own producer (computed ids) and consumer (dense row, denominator, -inf tail)."""

    BAR_DEN = 3                      # both consumers' partial denominators are in sDen (256 threads)
    ROW_DENOM = True                 # the shared struct gets sDen

    def __init__(self, num_heads: int, d_qk: int, dtype: str, regs_producer: int, regs_consumer: int):
        super().__init__(num_heads, d_qk, dtype, regs_producer, regs_consumer, prefetch_ids=False)

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_lse: cute.Pointer, p_out: cute.Pointer,
                   p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32,
                   has_off: Int32, ld_q: Int64, ld_kv: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            k.body(DenseArgs(p_q, p_kv, p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q, ld_kv,
                                   ld_out, softmax_scale))

        @cute.jit
        def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_lse: cute.Pointer, p_out: cute.Pointer,
                 p_den: cute.Pointer, p_off: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32,
                 has_off: Int32, ld_q: Int64, ld_kv: Int64, ld_out: Int64, softmax_scale: Float32, n_ctas: Int32):
            kernel(p_q, p_kv, p_lse, p_out, p_den, p_off, rows, T, S, ratio, has_off, ld_q, ld_kv, ld_out,
                   softmax_scale, n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1),
                                                 smem=k.Smem.size_in_bytes(), min_blocks_per_mp=1)

        return kernel, host

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_kv, tidx, bidx, nctas):
        """Per row: Q block by block, then per tile the consecutive key rows' ids (-1 past hi), published before
        block 0, and the rows one 64-column block at a time (the sparse form's producer with computed ids)."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sKV, lay_kv, self.BN)
        lanes, ids = p.lanes, p.ids
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            b, hi = row_limit(a.p_off, a.has_off, tok, a.T, a.S, a.ratio)
            ntiles = (hi + self.BN - 1) // self.BN
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * a.ld_q, self.H, self.D_QK, lanes, p.policy, it,
                          sh.q_free, sh.q_ready, per_block=True)
            for j in cutlass.range(ntiles, unroll=1):
                for i in cutlass.range_constexpr(self.BN // 16):
                    key = j * self.BN + lanes.grp + 16 * i
                    ids[i] = b * a.S + key if key < hi else Int32(-1)
                self.gather_tile(p, sh, lay_kv, a.p_kv, a.ld_kv, gt + j)
            gt += ntiles
            it += 1

    # ------------------------------------------------------------------------------------- consumers (WG1, WG2)
    @cute.jit
    def consumer(self, a, sh, tidx, bidx, nctas):
        """Consumer w takes the tiles g = w mod 2 with all H heads (the sparse form's S, P and column sums), writes
        the visible columns, then at the row's end the denominator and the -inf tail (module docstring)."""
        BN = self.BN
        cute.arch.setmaxregister_increase(self.regs[1])
        cs = self.consumer_state(sh, tidx)
        scale_log2 = a.softmax_scale * LOG2E

        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            _, hi = row_limit(a.p_off, a.has_off, tok, a.T, a.S, a.ratio)
            ntiles = (hi + BN - 1) // BN
            p_row = a.p_out + Int64(tok) * a.ld_out
            self.load_row_lse(cs, a.p_lse, tok)
            den = Float32(0.0)                                             # threads ctid < BN: their columns' sum
            for j in cutlass.range((gt + cs.w) % 2, ntiles, 2, unroll=1):  # this consumer's tiles of the row
                g = gt + j
                self.tile_column_sums(cs, sh, g, it, scale_log2)
                if cs.ctid < BN:
                    key = j * BN + cs.ctid
                    total = self.column_total(cs, sh, g)
                    if key < hi:
                        (p_row + key).store(total)
                        den += total
            # the row's end: denominator (fixed order), -inf tail, then Q may be replaced
            par = it % 2
            if cs.ctid < BN:
                sh.sDen[cs.ctid, cs.w, par] = den
            cute.arch.barrier(barrier_id=self.BAR_DEN, number_of_threads=256)
            if cs.w == 0:
                if cs.ctid < 32:
                    part = Float32(0.0)
                    for q4 in cutlass.range_constexpr(4):                   # values 4 lane + q4 of the 128
                        idx = 4 * cs.lane + q4
                        part += sh.sDen[idx % BN, idx // BN, par]
                    for sh_off in cutlass.range_constexpr(5):
                        part += cute.arch.shuffle_sync_bfly(part, offset=1 << (4 - sh_off))
                    if cs.lane == 0:
                        (a.p_den + tok).store(part)
            fill_tail(p_row, hi, a.S, cs.ctid + 128 * cs.w, 256)
            self.free_row_q(sh, it)
            gt += ntiles
            it += 1
