"""Epilogue stores of a wgmma accumulator (viewed by layout.acc_mn_view): 16-byte bf16 / fp16 row stores
(`store_row_v4`), 16-byte FP32 row stores (`store_row_f32_v4`), 16-byte FP32 atomic adds of row pairs into id rows (`add_row_pair_v4`) and streaming stores of
row pairs into per-slot rows (`store_slot_row_pair_v4`).

Called by the consumer warpgroup that owns the accumulator, all 128 threads together (the helpers exchange
values between the lanes of a quad and between adjacent quads with butterfly shuffles, so no lane may be
missing). No barrier is waited on or arrived at.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from dsagen.kernels.common.sm90.ptx import (pack_f32x2, red_add_v4_f32, red_add_v4_f32_evict_last, st_global_v4_b32,
                                           st_global_v4_f32)


@cute.jit
def quad_v4_columns(kMN: cute.Tensor, r: int, k: int, q_odd):
    """Four consecutive columns of row r of an accumulator view `kMN` (acc_mn_view) for one 16-byte FP32 store or
    atomic add: the lanes q, q ^ 1 of a quad swap one column pair of the view's columns 4k .. 4k + 3 (8-column
    groups 2k and 2k + 1), so lane q even holds columns 8 (2k) + 2q + 0..3 and lane q odd 8 (2k + 1) + 2 (q - 1) +
    0..3. Returns (v0, v1, v2, v3, offset): the values in column order and the offset (0 or 6) to add to the
    view column 4k's coordinate for the first one's column."""
    x0 = cute.arch.shuffle_sync_bfly(kMN[r, 4 * k + 0] if q_odd else kMN[r, 4 * k + 2], offset=1)
    x1 = cute.arch.shuffle_sync_bfly(kMN[r, 4 * k + 1] if q_odd else kMN[r, 4 * k + 3], offset=1)
    # q even: own group-2k pair, then the partner's; q odd: the partner's group-2k+1 pair, then own
    v0 = x0 if q_odd else kMN[r, 4 * k + 0]
    v1 = x1 if q_odd else kMN[r, 4 * k + 1]
    v2 = kMN[r, 4 * k + 2] if q_odd else x0
    v3 = kMN[r, 4 * k + 3] if q_odd else x1
    return v0, v1, v2, v3, (Int32(6) if q_odd else Int32(0))


@cute.jit
def pair_v4_segments(kMN: cute.Tensor, cK: cute.Tensor, r: int, kp: int, q_odd):
    """Columns 32 kp .. 32 kp + 31 of row r of an accumulator view (acc_mn_view; cK its coordinate view) as two
    16-byte transactions per lane that each cover 128-byte row segments: after quad_v4_columns a quad holds 16
    consecutive columns of its row, and the quads 2m and 2m + 1 of a warp (lanes l and l ^ 4, the rows n and n ^ 1)
    swap half of them, so that in transaction A the pair's 8 lanes hold 32 consecutive columns of the even row and
    in transaction B those of the odd row. A red.global.add.v4.f32 of 4 x 128 bytes retires faster than one of 8 x
    64 bytes: 3.5 against 3.1 TB/s on an H200 with 8 warps per SM (bench/l2_reduction.cu). Returns (A, B, col): the
    lane's 4 values of the even row, those of the odd row, and their first column's coordinate in the view's tile
    (the same in both)."""
    odd_row = cK[r, 0][0] % 2 == 1
    a0, a1, a2, a3, col_off = quad_v4_columns(kMN, r, 2 * kp, q_odd)
    b0, b1, b2, b3, _ = quad_v4_columns(kMN, r, 2 * kp + 1, q_odd)
    # the even row's lanes send their second 16 columns, the odd row's their first 16
    x0 = cute.arch.shuffle_sync_bfly(a0 if odd_row else b0, offset=4)
    x1 = cute.arch.shuffle_sync_bfly(a1 if odd_row else b1, offset=4)
    x2 = cute.arch.shuffle_sync_bfly(a2 if odd_row else b2, offset=4)
    x3 = cute.arch.shuffle_sync_bfly(a3 if odd_row else b3, offset=4)
    va = (x0 if odd_row else a0, x1 if odd_row else a1, x2 if odd_row else a2, x3 if odd_row else a3)
    vb = (b0 if odd_row else x0, b1 if odd_row else x1, b2 if odd_row else x2, b3 if odd_row else x3)
    col = (cK[r, 4 * (2 * kp + 1)][1] if odd_row else cK[r, 4 * (2 * kp)][1]) + col_off
    return va, vb, col


@cute.jit
def swap_word_pairs(a0, b0, a1, b1, take, offset: int):
    """One butterfly round over the pairs (a0, b0) and (a1, b1): the lane sends a where `take` holds, else b, to lane
    ^ offset, and puts what it gets in the word it sent. Returns the new (a0, b0, a1, b1). Both shuffles issue
    before any select (as store_row_v4's transpose wants them)."""
    x = cute.arch.shuffle_sync_bfly(a0 if take else b0, offset=offset)
    y = cute.arch.shuffle_sync_bfly(a1 if take else b1, offset=offset)
    na0 = x if take else a0
    na1 = y if take else a1
    nb0 = b0 if take else x
    nb1 = b1 if take else y
    return na0, nb0, na1, nb1


@cute.jit
def store_row_v4(dst: cute.Pointer, oMN: cute.Tensor, r: int, scale, fp16: bool, q_hi, q_odd, policy,
                 keep=None) -> None:
    """Row r of an accumulator view `oMN` (acc_mn_view) times `scale` (None: as is), as bf16 (fp16=True: fp16),
    into 16-byte stores at dst + 32 J (dst: this lane's first column, the row's start + 8 q). Lane q of a quad
    holds the row's columns 8 v + 2 q + {0, 1} (view column c = 2 v + e); per group of 4 v's the four packed words
    are transposed over the quad (two butterfly rounds: lanes q, q ^ 2 swap the off-diagonal 2 x 2 blocks, then
    lanes q, q ^ 1 the off-diagonal words of each block), after which lane q holds columns 8 (4 J + q) .. + 8 from
    lanes 0..3 in order. q_hi = q >= 2, q_odd = q odd; policy: the stores' L2 cache policy. keep (None: store):
    a predicate of the row that skips its stores only; every lane of the warp still runs the shuffles, which a row
    branch around the call would split."""
    for jg in cutlass.range_constexpr(cute.size(oMN, mode=[1]) // 8):
        v = [oMN[r, 8 * jg + i] for i in range(8)]
        if const_expr(scale is not None):
            v = [x * scale for x in v]
        w0 = pack_f32x2(v[0], v[1], fp16)
        w1 = pack_f32x2(v[2], v[3], fp16)
        w2 = pack_f32x2(v[4], v[5], fp16)
        w3 = pack_f32x2(v[6], v[7], fp16)
        w0, w2, w1, w3 = swap_word_pairs(w0, w2, w1, w3, q_hi, 2)
        w0, w1, w2, w3 = swap_word_pairs(w0, w1, w2, w3, q_odd, 1)
        if const_expr(keep is None):
            st_global_v4_b32(dst + 32 * jg, w0, w1, w2, w3, policy)
        elif keep:
            st_global_v4_b32(dst + 32 * jg, w0, w1, w2, w3, policy)


@cute.jit
def store_row_f32_v4(dst: cute.Pointer, oMN: cute.Tensor, cO: cute.Tensor, r: int, scale, keep=None) -> None:
    """Row r of an accumulator view `oMN` (acc_mn_view; cO its coordinate view) times `scale`, as FP32 16-byte
    streaming stores at dst + column (dst: the row's first column): quad_v4_columns gives each lane 4 consecutive
    columns per 8-column group pair. keep: as store_row_v4's (the shuffles run on every lane)."""
    q_odd = cute.arch.lane_idx() % 2 == 1
    for k in cutlass.range_constexpr(cute.size(oMN, mode=[1]) // 4):
        v0, v1, v2, v3, off = quad_v4_columns(oMN, r, k, q_odd)
        if const_expr(keep is None):
            st_global_v4_f32(dst + (cO[r, 4 * k][1] + off), v0 * scale, v1 * scale, v2 * scale, v3 * scale)
        elif keep:
            st_global_v4_f32(dst + (cO[r, 4 * k][1] + off), v0 * scale, v1 * scale, v2 * scale, v3 * scale)


_RED_V4 = {False: red_add_v4_f32, True: red_add_v4_f32_evict_last}   # add_row_pair_v4's atomic, by evict_last


@cute.jit
def add_row_pair_v4(kMN: cute.Tensor, cK: cute.Tensor, r: int, q_odd, dst: cute.Pointer, id_even, id_odd,
                    row_len: int, col_base, evict_last: bool = False) -> None:
    """Row r of an FP32 accumulator view `kMN` (cK: its coordinate view) together with the row of the adjacent quad
    (lane l ^ 4), added by 16-byte FP32 atomics (red.global.add.v4.f32) into rows id_even / id_odd of the FP32
    accumulator `dst` (rows of `row_len` elements, 16-byte aligned), columns col_base + the rows' columns; a row
    whose id is negative is skipped. Each transaction covers 128-byte row segments (pair_v4_segments). Addresses
    are formed per transaction from the ids, so no 64-bit pointer stays live across them (the callers run at their
    register limit). evict_last (trace time): the atomics carry an L2 evict_last policy (red_add_v4_f32_evict_last)."""
    red = _RED_V4[bool(evict_last)]
    for kp in cutlass.range_constexpr(cute.size(kMN, mode=[1]) // 8):
        va, vb, col_in = pair_v4_segments(kMN, cK, r, kp, q_odd)
        col = col_base + col_in
        if id_even >= 0:
            red(dst + (Int64(id_even) * row_len + col), *va)
        if id_odd >= 0:
            red(dst + (Int64(id_odd) * row_len + col), *vb)


@cute.jit
def store_slot_row_pair_v4(kMN: cute.Tensor, cK: cute.Tensor, r: int, q_odd, dst: cute.Pointer, group,
                           group_rows, slot0, n_even, slot_end, row_len: int, col_base) -> None:
    """The deterministic form of add_row_pair_v4: the pair's rows go, by streaming stores (st.global.cs.v4.f32:
    written once, read once by a later kernel), to the per-slot rows group * group_rows + slot and + slot + 1 of `dst`
    (slot = slot0 + n_even), each only while its slot is below slot_end. The slot and its 64-bit row are formed
    inside each transaction: formed once before the loop, the compiler merged the stores' branch regions of the
    sparse MLA backward so that its next wgmma issued before the lanes reconverged (compute-sanitizer synccheck:
    warpgroup MMA with a partial mask)."""
    for kp in cutlass.range_constexpr(cute.size(kMN, mode=[1]) // 8):
        va, vb, col_in = pair_v4_segments(kMN, cK, r, kp, q_odd)
        col = col_base + col_in
        slot = slot0 + n_even
        if slot < slot_end:
            st_global_v4_f32(dst + ((Int64(group) * group_rows + slot) * row_len + col), *va)
        if slot + 1 < slot_end:
            st_global_v4_f32(dst + ((Int64(group) * group_rows + slot + 1) * row_len + col), *vb)
