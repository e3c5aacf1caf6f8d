"""Device helpers for the Hopper attention kernels: SW128 shared-memory layouts, views of a wgmma
accumulator fragment, the SW128 swizzle of a byte offset (for cp.async gathers into a swizzled tile), an L2
evict_first cache policy with the cp.async and 16-byte store that carry it (CuTe-DSL's cp_async_shared_global has
no cache hint), a bf16 / fp16 pair pack, the 16-byte FP32 atomic add and store (red / st .global.v4.f32) and a
bounded grid barrier (`grid_barrier`: the CTAs of a persistent grid walk their items in step, for the cache).

Fragment ownership of a wgmma m64nN accumulator (one warpgroup, thread t = 32 w + l): rows 16 w + l / 4
and 16 w + l / 4 + 8; columns 8 j + 2 (l % 4) + {0, 1}. A row therefore lives in the 4 lanes of a quad.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.experimental import primitives as prims


def sw128(dtype, shape):
    """K-major 128-byte-swizzled layout (a ComposedLayout) for a 16-bit `shape` = (rows, cols[, stages]):
    8 x 64 atoms tiled rows first, then 64-column blocks, then stages. It is the wgmma SW128 operand layout
    and the TMA SWIZZLE_128B box layout."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def acc_mn_view(t):
    """A ((2, 2, V), M, N) accumulator fragment (or its coordinate tensor) viewed as
    (rows = (2, M), cols = (2, V, N)), so that [r, c] walks the rows and columns a thread owns."""
    s, d = t.layout.shape, t.layout.stride
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))))


def acc_as_frg_a(t):
    """An m64nN accumulator ((2, 2, V), 1, 1) viewed as the register A operand ((2, 2, 2), 1, V / 2) of an
    m64nNk16 wgmma: the thread owns the same elements, k16 block j is accumulator column blocks 2j, 2j+1."""
    s, d = t.layout.shape, t.layout.stride
    v = s[0][2]
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((2, 2, 2), s[1], v // 2), stride=((d[0][0], d[0][1], d[0][2]), d[1], 2 * d[0][2])))


def tree_reduce(op, vals):
    """`op` over `vals` (a non-empty list, unrolled at trace time) as a balanced tree: depth ceil(log2(len))
    instead of a len - 1 long dependency chain (row maxima / sums of a softmax)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def swizzled_byte_offset(b):
    """The SW128 (S<3,4,3>) image of a byte offset `b` (Int32, >= 0) from a 1024-byte-aligned tile base."""
    return b ^ ((b >> 3) & 0x70)


def _l2_policy(priority: str, loc, ip) -> Int64:
    """`createpolicy.fractional.L2::<priority>.b64 1.0`: an L2 cache policy for every line it touches."""
    return Int64(llvm.inline_asm(T.i64(), [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """`createpolicy.fractional.L2::evict_first.b64 1.0`: an L2 cache policy for data read or written once (a
    kernel's streamed Q and O), so that it is evicted before the lines other CTAs will read again."""
    return _l2_policy("evict_first", loc, ip)


@dsl_user_op
def cp_async_16_policy(dst: cute.Pointer, src: cute.Pointer, policy: Int64, *, loc=None, ip=None) -> None:
    """16-byte `cp.async.cg.shared.global.L2::cache_hint [dst], [src], 16, policy` (always reads 16 bytes)."""
    llvm.inline_asm(None,
                    [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                     src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;",
                    "r,l,l,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, fp16: bool = False, *, loc=None, ip=None) -> Int32:
    """Two FP32 values rounded to bf16 (fp16=True: fp16) and packed into one 32-bit word, `lo` in the low half
    (the element at the lower address when stored)."""
    op = "cvt.rn.f16x2.f32" if fp16 else "cvt.rn.bf16x2.f32"
    return Int32(llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                                 f"{op} $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def st_global_v4_b32(dst: cute.Pointer, w0: Int32, w1: Int32, w2: Int32, w3: Int32, policy: Int64, *,
                     loc=None, ip=None) -> None:
    """One 16-byte global store `st.global.L2::cache_hint.v4.b32 [dst], {w0, w1, w2, w3}, policy` (`dst` 16-byte
    aligned) with the L2 cache policy `policy` (e.g. l2_evict_first_policy())."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip)
                                                                   for w in (w0, w1, w2, w3)]
    ops.append(Int64(policy).ir_value(loc=loc, ip=ip))
    llvm.inline_asm(None, ops, "st.global.L2::cache_hint.v4.b32 [$0], {$1, $2, $3, $4}, $5;", "l,r,r,r,r,l,~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _v4_f32(ptx: str, dst: cute.Pointer, values, loc, ip) -> None:
    """`ptx [dst], {a, b, c, d}` for four FP32 values (dst 16-byte aligned)."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    llvm.inline_asm(None, ops, f"{ptx} [$0], {{$1, $2, $3, $4}};", "l,f,f,f,f,~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def red_add_v4_f32(dst: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """`red.global.add.v4.f32 [dst], {a, b, c, d}` (dst 16-byte aligned): four FP32 atomic adds, one transaction."""
    _v4_f32("red.global.add.v4.f32", dst, (a, b, c, d), loc, ip)


@dsl_user_op
def st_global_v4_f32(dst: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """`st.global.cs.v4.f32 [dst], {a, b, c, d}` (dst 16-byte aligned): a streaming store (evict-first in L2), for
    the deterministic modes' per-slot rows, which are written once and read once by a later kernel and should not
    push the gathered key pool out of L2."""
    _v4_f32("st.global.cs.v4.f32", dst, (a, b, c, d), loc, ip)


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
def store_row_v4(dst: cute.Pointer, oMN: cute.Tensor, r: int, scale, fp16: bool, q_hi, q_odd, policy) -> None:
    """Row r of an accumulator view `oMN` (acc_mn_view) times `scale` (None: as is), as bf16 (fp16=True: fp16),
    into 16-byte stores at dst + 32 J (dst: this lane's first column, the row's start + 8 q). Lane q of a quad
    holds the row's columns 8 v + 2 q + {0, 1} (view column c = 2 v + e); per group of 4 v's the four packed words
    are transposed over the quad (two butterfly rounds: lanes q, q ^ 2 swap the off-diagonal 2 x 2 blocks, then
    lanes q, q ^ 1 the off-diagonal words of each block), after which lane q holds columns 8 (4 J + q) .. + 8 from
    lanes 0..3 in order. q_hi = q >= 2, q_odd = q odd; policy: the stores' L2 cache policy."""
    for jg in cutlass.range_constexpr(cute.size(oMN, mode=[1]) // 8):
        v = [oMN[r, 8 * jg + i] for i in range(8)]
        if const_expr(scale is not None):
            v = [x * scale for x in v]
        w0 = pack_f32x2(v[0], v[1], fp16)
        w1 = pack_f32x2(v[2], v[3], fp16)
        w2 = pack_f32x2(v[4], v[5], fp16)
        w3 = pack_f32x2(v[6], v[7], fp16)
        x = cute.arch.shuffle_sync_bfly(w0 if q_hi else w2, offset=2)
        y = cute.arch.shuffle_sync_bfly(w1 if q_hi else w3, offset=2)
        w0 = x if q_hi else w0
        w1 = y if q_hi else w1
        w2 = w2 if q_hi else x
        w3 = w3 if q_hi else y
        x = cute.arch.shuffle_sync_bfly(w0 if q_odd else w1, offset=1)
        y = cute.arch.shuffle_sync_bfly(w2 if q_odd else w3, offset=1)
        w0 = x if q_odd else w0
        w2 = y if q_odd else w2
        w1 = w1 if q_odd else x
        w3 = w3 if q_odd else y
        st_global_v4_b32(dst + 32 * jg, w0, w1, w2, w3, policy)


@cute.jit
def cp_async_rows(dst: cute.Pointer, lay, src: cute.Pointer, rows: int, width: int, grp, col0, policy,
                  blocks: tuple[int, int] | None = None) -> None:
    """cp.async `rows` rows of `width` elements (16-bit) from `src` (row-major, row stride `width`) into the SW128
    tile at byte pointer `dst` whose layout is `lay` (sw128's), with L2 cache policy `policy`: the 128 threads of a
    warpgroup in 16 groups of 8, group `grp` taking rows grp + 16 i and thread `col0` / 8 of the group one 16-byte
    chunk of each 64-column block (a 64 x D Q tile of the attention kernels); `blocks`: only the 64-column blocks
    [blocks[0], blocks[1]) (None: all)."""
    kb0, kb1 = (0, width // 64) if const_expr(blocks is None) else blocks
    for i in cutlass.range_constexpr(rows // 16):
        r = grp + 16 * i
        for kb in cutlass.range_constexpr(kb0, kb1):
            b = lay.outer((r, kb * 64 + col0)) * 2
            cp_async_16_policy(dst + swizzled_byte_offset(b), src + (r * width + kb * 64 + col0), policy)


@cute.jit
def load_tile_ids(ids, mIdx: cute.Tensor, slot0, limit, n_rows, grp) -> None:
    """The ids of a gathered tile's rows grp + 16 i (i < len(ids)): ids[i] = mIdx[slot0 + grp + 16 i] where that slot
    is below `limit` and the id lies in [0, n_rows), else -1 (a row gather_tile_rows zero-fills). mIdx: the query
    row's ids (slots). It is load_tile_ids_raw followed by valid_tile_ids."""
    load_tile_ids_raw(ids, mIdx, slot0, limit, grp)
    valid_tile_ids(ids, ids, n_rows)


@cute.jit
def load_tile_ids_raw(ids, mIdx: cute.Tensor, slot0, limit, grp) -> None:
    """The raw ids of a gathered tile's rows grp + 16 i (i < len(ids)): ids[i] = mIdx[slot0 + grp + 16 i] where that
    slot is below `limit`, else -1. Nothing reads the loaded values here, so the loads stay in flight until
    valid_tile_ids checks them: a producer issues the next tile's id loads before it waits for a free stage."""
    for i in cutlass.range_constexpr(cute.size(ids)):
        slot = slot0 + grp + 16 * i
        kv = Int32(-1)
        if slot < limit:
            kv = mIdx[slot]
        ids[i] = kv


@cute.jit
def valid_tile_ids(ids, raw, n_rows) -> None:
    """ids[i] = raw[i] where it lies in [0, n_rows), else -1 (a row gather_tile_rows zero-fills)."""
    for i in cutlass.range_constexpr(cute.size(ids)):
        kv = raw[i]
        ids[i] = kv if kv >= 0 and kv < n_rows else Int32(-1)


@cute.jit
def row_ids_ahead(raw, mIdx: cute.Tensor, ntiles, limit, grp, prefetch: bool) -> None:
    """At a row's start, with prefetch: its first tile's raw ids into `raw` (load_tile_ids_raw), for tile_ids to check;
    nothing without it."""
    if const_expr(prefetch):
        if ntiles > 0:
            load_tile_ids_raw(raw, mIdx, 0, limit, grp)


@cute.jit
def tile_ids(ids, raw, mIdx: cute.Tensor, j, ntiles, limit, n_rows, grp, bn: int, prefetch: bool) -> None:
    """The ids of tile j of a row (bn slots per tile) into `ids`, as load_tile_ids gives them. With prefetch they come
    from `raw`, loaded by the previous call (or row_ids_ahead), and tile j + 1's raw ids are loaded into `raw`: their
    loads are in flight while the producer then waits for tile j's stage. Without it they are loaded here."""
    if const_expr(prefetch):
        valid_tile_ids(ids, raw, n_rows)
        if j + 1 < ntiles:
            load_tile_ids_raw(raw, mIdx, (j + 1) * bn, limit, grp)
    else:
        load_tile_ids(ids, mIdx, j * bn, limit, n_rows, grp)


@cute.jit
def gather_tile_rows(dst: cute.Pointer, sw_base, lay, p_rows: cute.Pointer, ld, ids, col0, blocks: tuple[int, int],
                     stage: int = 0) -> None:
    """cp.async the gathered rows grp + 16 i (i < len(ids)) of a KV tile: row i is p_rows[ids[i]] (row stride `ld`),
    zero-filled (nothing read, from a legal address) when ids[i] < 0; column blocks [blocks[0], blocks[1]) of 64;
    `stage`: the tile's stage in `lay` (a (rows, D[, stages]) sw128 layout). `dst` is the tile's byte pointer and
    `sw_base` the thread's swizzled byte offset of (grp, col0): the 128B swizzle XORs byte bits 4-6 with bits 7-9 =
    row % 8, which is grp % 8 for every row grp + 16 i, and the row-group, column-block and stage offsets only touch
    bits >= 10, so each chunk lies at a constant offset from it."""
    for i in cutlass.range_constexpr(cute.size(ids)):
        kv = ids[i]
        ok = kv >= 0
        src = p_rows + Int64(kv if ok else 0) * ld
        nbytes = Int32(16) if ok else Int32(0)
        for kb in cutlass.range_constexpr(*blocks):
            coord = (16 * i, kb * 64) if const_expr(len(lay.outer.shape) == 2) else (16 * i, kb * 64, stage)
            prims.cp_async_shared_global(dst + (sw_base + lay.outer(coord) * 2), src + (kb * 64 + col0), 16, "cg",
                                         cp_size=nbytes)


@cute.jit
def row_slots(p_len: cute.Pointer, has_length, topk, tok, bn: int):
    """Row tok's valid slots [0, kmax) and its bn-slot tiles: kmax = clamp(p_len[tok], 0, topk) when has_length is
    non-zero, else topk. Returns (kmax, ceil(kmax / bn))."""
    kmax = topk
    if has_length != 0:
        kmax = cutlass.min(cutlass.max((p_len + tok).load(), Int32(0)), topk)
    return kmax, (kmax + bn - 1) // bn


@cute.jit
def init_gather_ring(kv_ready, kv_free, stages: int, q_full, q_free, ready_count: int, free_count: int,
                     q_count: int) -> None:
    """The mbarriers of a gather ring of `stages` stages and its per-row Q buffer (one thread calls it): kv_ready[s]
    (ready_count arrivals: the producer's noinc cp.async arrivals plus any of its metadata arrivals), kv_free[s]
    (free_count: the consumer threads), q_full and q_free (q_count each)."""
    for s in cutlass.range_constexpr(stages):
        cute.arch.mbarrier_init(kv_ready + s, ready_count)
        cute.arch.mbarrier_init(kv_free + s, free_count)
    cute.arch.mbarrier_init(q_full, q_count)
    cute.arch.mbarrier_init(q_free, q_count)


@cute.jit
def gather_ring_tile(dst: cute.Pointer, sw_base, lay, p_rows: cute.Pointer, ld, ids, col0, blocks: tuple[int, int],
                     g, stages: int, kv_ready, kv_free) -> None:
    """Tile g of a gather ring (stage g % stages): wait until the consumers freed the stage (kv_free, parity of the
    ring's round), cp.async the tile's rows into it (gather_tile_rows; ids -1: zero-filled) and make kv_ready of the
    stage track their arrival (a noinc arrival per thread)."""
    s = g % stages
    cute.arch.mbarrier_wait(kv_free + s, ((g // stages) % 2) ^ 1)
    gather_tile_rows(dst, sw_base, lay, p_rows, ld, ids, col0, blocks, stage=s)
    cute.arch.cp_async_mbarrier_arrive_noinc(kv_ready + s)


# ------------------------------------------------------------------------------------------------ grid barrier
@dsl_user_op
def red_release_add_s32(dst: cute.Pointer, v: Int32, *, loc=None, ip=None) -> None:
    """`red.release.gpu.global.add.s32 [dst], v`: an add that orders this thread's earlier memory operations
    before it, GPU-wide."""
    llvm.inline_asm(None, [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
                    "red.release.gpu.global.add.s32 [$0], $1;", "l,r,~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ld_acquire_s32(src: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """`ld.acquire.gpu.global.s32`: a load that orders this thread's later memory operations after it."""
    return Int32(llvm.inline_asm(T.i32(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                 "ld.acquire.gpu.global.s32 $0, [$1];", "=r,l,~{memory}", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """`nanosleep.u32 ns` (a hint: the warp sleeps for about ns nanoseconds)."""
    llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


GRID_BARRIER_SPINS = 4096          # a grid barrier's bound: 4096 sleeps of ~256 ns (~1 ms)


@cute.jit
def grid_barrier(counter: cute.Pointer, tidx, it, n_items, nctas, bar_id: int, threads: int) -> None:
    """Hold the `threads` threads of named barrier `bar_id` (the calling warpgroup; thread `tidx` 0 of the CTA
    counts) at the start of the CTA's item `it` until every CTA got there: round it of a persistent loop over
    `n_items` items, min((it + 1) * nctas, n_items) arrivals on the zeroed int32 `counter` in all. It only orders
    work for the cache (the CTAs then walk the same KV windows together), never for correctness, so the wait is
    bounded: after GRID_BARRIER_SPINS sleeps the CTA goes on, which keeps a grid that is not all resident at once
    (another kernel on some SMs, an MPS or green-context SM limit) from waiting forever."""
    if tidx == 0:
        red_release_add_s32(counter, Int32(1))
        target = cutlass.min((it + 1) * nctas, n_items)
        spins = Int32(0)
        while ld_acquire_s32(counter) < target and spins < GRID_BARRIER_SPINS:
            nanosleep(256)
            spins += 1
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)


__all__ = ["sw128", "store_row_v4", "load_tile_ids", "load_tile_ids_raw", "valid_tile_ids", "row_ids_ahead",
           "tile_ids", "init_gather_ring", "gather_ring_tile", "red_add_v4_f32", "st_global_v4_f32",
           "quad_v4_columns", "pair_v4_segments", "cp_async_rows", "gather_tile_rows", "acc_mn_view", "acc_as_frg_a",
           "tree_reduce", "swizzled_byte_offset", "l2_evict_first_policy", "cp_async_16_policy", "pack_f32x2",
           "st_global_v4_b32", "red_release_add_s32", "ld_acquire_s32", "nanosleep", "GRID_BARRIER_SPINS",
           "grid_barrier"]
