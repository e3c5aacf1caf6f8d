"""Lightning-indexer scores on Hopper tensor cores (sm_90a), written into a bounded fp32 slab (ping-pong schedule):
`build(num_heads, head_dim, dtype, stages)` makes the kernel of one IndexerScoreSpec.

    slab[r, s - lo_r] = sum_h w[b, t, h] * scale * relu(q[b, t, h, :] . k[b, s, :])   for lo_r <= s < hi_r

for the query rows r = (b, t) of `nblk` consecutive token blocks starting at block `blk0` (a token block is
128 // H consecutive tokens of one batch element), where [lo_r, hi_r) are the candidates row r may select (causal
limit, packed document). Nothing outside those ranges is written.

Work item = (token block in the slab, chunk of `chunk` candidate rows); item w is chunk w // nblk, block w % nblk.
CTA i of the `n_ctas` CTAs (about one per SM) takes items i, i + n_ctas, ... With longest_first (a build flag), round
j of the CTAs takes the items N - 1 - (j n_ctas + p) (N = nblk * n_chunks items), p = i in even rounds and
n_ctas - 1 - i in odd ones: the last blocks (the longest causal rows) first, and each CTA's sum of item lengths
balanced by the snake, so the launch does not end on the CTAs that drew the longest rows last.
Warpgroup 0: warp 1 (scheduler) computes each item's row bounds, skips items without candidates and publishes the
rest (bounds, fp32 weights x scale, header) into a 2-entry smem ring; warp 0 (TMA) loads each published item's Q
tile into one of 2 Q buffers, then the item's 64-row K tiles through a 2 * stages-slot ring. Warpgroups 1, 2 and 3
(ping-pong) take the 64-row tiles of an item in turn (wgmma M = 64, N = 128 (token, head) columns, K = D); named
barriers make each warpgroup issue its wgmmas only after the previous one issued its own, so the tensor cores run
one warpgroup's MMA while the others run their ReLU x weight + head-sum epilogue (as CUTLASS's sm90 ping-pong GEMM).

The dense_scores form (IndexerScoreSpec.dense_scores, dsagen.indexer_scores) is the same kernel with per-segment
causal offsets in the row bounds (row_bounds' p_off: row r of segment g may select s < (q_off[g] + t + 1) // ratio)
and the caller's [rows, S_k] score matrix as the slab (ld_slab = its width); the host passes scale 1. With
fill = 1 (indexer_scores) the producer warpgroup's otherwise idle warp 2 writes -inf past each of the launch's rows'
valid columns while the consumers compute (row rr of the slab by CTA rr % n_ctas; dense_rows.fill_tail), so the
masked half of a causal score matrix costs no pass of its own; fill = 0 (indexer_forward_topk's slabs, whose top-k
reads only the valid columns) leaves them. The LSE, when asked, is mask_lse_sm90's pass after it.

The FP8 form (E4M3 q / k with fp32 descales, dense_scores, D = 128) issues QGMMA k32 steps and does the weighted
head sum on the tensor cores as well (build's docstring): with the MMA half as long as in bf16, the CUDA-core
epilogue (64 FMNMX + 64 FFMA per thread and tile) set the tile period.

Constraints (IndexerScoreSpec.reasons): H in 8..128 dividing 128, D in (64, 128), bf16 / fp16 inputs (FP8: H >= 16,
D = 128, dense_scores), 2 <= stages and the smem of 2 Q tiles + 2 * stages K tiles within 220 KiB.
"""
import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.experimental import primitives as prims

from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view, sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, wgmma_tile
from dsagen.kernels.common.sm90.ring import ring_wait_free
from dsagen.kernels.common.sm90.tma import tma_load_tile, tma_recipe
from dsagen.kernels.common.sm90.dense_rows import fill_tail
from dsagen.kernels.lightning_indexer.common_sm90 import row_bounds

BN = 128                      # wgmma N: QC tokens x H heads
BM = 64                       # K rows per tile (wgmma M)
NCOL = BN // 4                # accumulator columns per thread (2 rows x NCOL values)
FP8_KSCALE_ROWS = 4096        # FP8: k_scale rows staged per item slot (host.FP8_MAX_CHUNK_ROWS keeps chunk <= it)
HDR = 8                       # header words per item slot: ntiles (0 = stop), bx, b, t0, kv_lo, kv_hi
BAR_WG0 = 1                   # named barrier: consumer warpgroup 0 may issue (arrived by warpgroup 1)
BAR_WG1 = 2                   # named barrier: consumer warpgroup 1 may issue (arrived by warpgroup 0)
BAR_WG2 = 3                   # named barrier: consumer warpgroup 2 may issue (arrived by warpgroup 1)


@cute.jit
def hdr_word(sHdr: cute.Tensor, i: Int32, lane: Int32) -> Int32:
    """Header word i as read by lane 0 of the calling warp, given to every lane by a shuffle."""
    v = Int32(0)
    if lane == 0:
        v = sHdr[i]
    return cute.arch.shuffle_sync(v, 0)


def fp8_params() -> list:
    """The FP8 form's extra params (after q_off / has_off): fp32 weights through a second pointer, the descales and
    their strides (in elements)."""
    return [
        {"name": "w32", "kind": "ptr", "dtype": "float32", "align": 4},          # the weights when w_f32 != 0
        {"name": "w_f32", "kind": "i32"},                                        # 1: weights are fp32 (w32), 0: bf16 (w)
        {"name": "q_scale", "kind": "ptr", "dtype": "float32", "align": 4},      # [B, T, H] q descales
        {"name": "qs_sb", "kind": "i64"},
        {"name": "qs_st", "kind": "i64"},
        {"name": "qs_sh", "kind": "i64"},
        {"name": "k_scale", "kind": "ptr", "dtype": "float32", "align": 4},      # [B, S] k descales
        {"name": "ks_sb", "kind": "i64"},
        {"name": "ks_ss", "kind": "i64"},
    ]


def paged_params() -> list:
    """The paged form's extra params (after the others): the block table and its row stride (in elements), the
    page count."""
    return [
        {"name": "bt", "kind": "ptr", "dtype": "int32", "align": 4},             # [B, max_pages] page of each 64 rows
        {"name": "bt_sb", "kind": "i64"},
        {"name": "n_pages", "kind": "i32"},
    ]


def build(num_heads: int, head_dim: int, dtype: str, stages: int, dense_scores: bool = False, consumers: int = 3,
          longest_first: bool = False, q_tiles: int = 1, paged: bool = False):
    """The score kernel of IndexerScoreSpec(num_heads, head_dim, dtype, stages, dense_scores): returns
    (kernel, host, PARAMS, HOST_ARGS, LAUNCH). Each call makes new kernel and host functions (every rendered module
    names its own kernel).

    num_heads: H (divides 128).  head_dim: D (64 or 128).  dtype: "bfloat16" or "float16" (q, k, weights).
    stages: K buffering in 128-row units (2 * stages 64-row slots).
    dense_scores: the indexer_scores form: two more params, q_off (per batch element / document causal offsets,
    int32) and has_off (0: no offsets, q_off never read), enter the causal limit (row_bounds); the slab is rows of
    the caller's score matrix, whose base need only be 4-byte aligned (every store is one fp32 word). False: the
    lightning indexer's kernel, unchanged.
    dtype "float8_e4m3fn" (dense_scores, D = 128 only): q and k are E4M3 (TMA moves them as uint8, one 128-column
    box per row, wgmma k32 steps); fp8_params() follow has_off: the scheduler stages w * q_scale (w bf16 or fp32,
    chosen at run time by w_f32) as a block-diagonal bf16 matrix (column COLSTEP * jj holds token jj's heads) and
    the item's k_scale rows (cp.async, completing on the item's info_full); the epilogue packs ReLU(S) to bf16
    (F2FP.RELU), computes the head sums as a second wgmma (m64 n8 k16, A from registers) and multiplies each key
    row's sum by k_scale, which equals the un-factored sum_h w * relu(q_scale * k_scale * q8 . k8) for positive
    descales up to the bf16 rounding of ReLU(S) and of the weights (FP32 accumulation). Work items take at most
    FP8_KSCALE_ROWS candidates.
    consumers: consumer warpgroups taking the K tiles in turn: 3 (setmaxnreg 152), or 4 at 104 registers (FP8 form
    only, whose tensor-core head sum needs fewer registers): 640 threads.
    longest_first: the scheduler takes the items in reverse order, in a snake over the CTAs (module docstring);
    False generates the code it had before the flag.
    q_tiles: Q tiles per work item (NQ): 1, or 2 (FP8 form with 4 consumers only): the item holds 2 * 128 / H
    tokens and each K tile is multiplied by both Q tiles, by the two warpgroups of a consumer pair (warpgroup c takes
    Q tile c % 2 and the item's tiles p, p + 2, ... with p = c // 2), so every K tile is read from L2 once per twice
    as many query tokens.
    paged (dense_scores only): k is a paged cache, viewed as [n_pages, 64, D] (the TMA map's (D, 64, n_pages)): row s
    of batch element b is row s % 64 of page bt[b, s // 64]; paged_params() follow the others (the block table, its
    row stride, n_pages); the FP8 form's k_scale is then the pages' descales [n_pages, 64] (ks_sb: the page stride),
    its page clamped to [0, n_pages) (a TMA load of a page outside it reads zeros). False generates the code the
    kernel had before the flag."""
    NQ = q_tiles
    assert not paged or dense_scores, "paged K: the dense_scores form only"
    assert NQ == 1 or (NQ == 2 and consumers == 4 and dtype == "float8_e4m3fn"), "q_tiles=2: FP8 with 4 consumers"
    FP8 = dtype == "float8_e4m3fn"
    NC = consumers                # consumer warpgroups taking the tiles in turn: 3, or 4 (FP8 form)
    assert NC == 3 or (NC == 4 and FP8), "4 consumer warpgroups fit the registers of the FP8 form only"
    NTHREADS = 128 * (1 + NC)
    # setmaxnreg moves registers within the CTA's pool (USETMAXREG.*.CTAPOOL), which holds what the launch gave every
    # thread: 65536 / NTHREADS rounded down to 8. A consumer's count must keep 128 * (40 + NC * REGS_C) inside it, or
    # its increase waits forever: 3 consumers: 512 x 128 -> 152; 4: 640 x 96 = 61440 -> 104 (112 hung the kernel).
    REGS_LAUNCH = 65536 // NTHREADS // 8 * 8
    REGS_C = min(152, (REGS_LAUNCH * NTHREADS // 128 - 40) // NC // 8 * 8)
    DT = cutlass.Float8E4M3FN if FP8 else (cutlass.BFloat16 if dtype == "bfloat16" else cutlass.Float16)
    ELEM = 1 if FP8 else 2        # bytes per q / k element
    BOXC = 128 // ELEM            # columns per 128-byte swizzled TMA box
    W_DT = "bfloat16" if FP8 else dtype
    H = num_heads
    D = head_dim
    QC = BN // H                  # query tokens per Q tile
    ITEM_TOK = NQ * QC            # query tokens per work item (token block)
    TPR = NC // NQ                # K tiles per round of the consumers' turns (NQ warpgroups multiply each tile)
    KSLOTS = 2 * stages           # 64-row K buffers in the ring
    KB = D // BOXC                # 128-byte TMA boxes per row
    Q_BYTES = BN * D * ELEM
    K_TILE_BYTES = BM * D * ELEM
    NK = D // (32 if FP8 else 16)  # wgmmas per tile (k16 for 16-bit inputs, k32 for FP8)
    TMA_DT = "uint8" if FP8 else dtype
    # info_full: the scheduler warp's 32 arrivals; FP8 adds its 32 cp.async arrivals (the item's k_scale rows)
    INFO_FULL_ARRIVALS = 64 if FP8 else 32
    # FP8 epilogue: the weighted head sum on the tensor cores (the QGMMA takes half the HGMMA's time, so the CUDA-core
    # epilogue's 64 FMNMX + 64 FFMA per thread and tile would set the tile period): bf16(ReLU(S)) from registers
    # times a block-diagonal bf16 weight matrix in smem, N = NB2 columns (token jj's in column COLSTEP * jj, the rest 0)
    NB2 = 8                       # head-sum wgmma N (>= QC = 128 / H, at most 8 for H >= 16)
    COLSTEP = 2 if QC <= 4 else 1  # token jj's column of the head sum: COLSTEP * jj (quad lane jj owns it at QC <= 4)

    PARAMS = [
        {"name": "q_map", "kind": "tensormap", "encode": tma_recipe(TMA_DT, [BOXC, H, QC, 1])},   # q [B, T, H, D] -> (D, H, T, B)
        {"name": "k_map", "kind": "tensormap", "encode": tma_recipe(TMA_DT, [BOXC, BM, 1])},      # k [B, S, D] -> (D, S, B)
        {"name": "w", "kind": "ptr", "dtype": W_DT, "align": 2},                # weights [B, T, H], any strides
        {"name": "slab", "kind": "ptr", "dtype": "float32", "align": 4 if dense_scores else 16},  # (nblk * ITEM_TOK, ld_slab) fp32
        {"name": "cu_q", "kind": "ptr", "dtype": "int32", "align": 4},           # [n_docs + 1] (packed only)
        {"name": "cu_k", "kind": "ptr", "dtype": "int32", "align": 4},           # [n_docs + 1] (packed only)
        {"name": "n_docs", "kind": "i32"},                                       # 0: not packed
        {"name": "T", "kind": "i32"},
        {"name": "S", "kind": "i32"},
        {"name": "n_tblk", "kind": "i32"},                                       # token blocks per batch element
        {"name": "blk0", "kind": "i32"},                                         # first token block of the slab
        {"name": "nblk", "kind": "i32"},                                         # token blocks in the slab
        {"name": "chunk", "kind": "i32"},                                        # candidate rows per work item
        {"name": "n_chunks", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},                                       # grid size (CTAs)
        {"name": "causal", "kind": "i32"},
        {"name": "ratio", "kind": "i32"},
        {"name": "w_sb", "kind": "i64"},
        {"name": "w_st", "kind": "i64"},
        {"name": "w_sh", "kind": "i64"},
        {"name": "ld_slab", "kind": "i64"},
        {"name": "scale", "kind": "f32"},
    ]
    if dense_scores:
        PARAMS += [
            {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},      # [n_segments] causal offsets
            {"name": "has_off", "kind": "i32"},                                  # 0: q_off is not read
            {"name": "fill", "kind": "i32"},                                     # 1: -inf past each row's valid columns
        ]
    if FP8:
        PARAMS += fp8_params()
    if paged:
        PARAMS += paged_params()
    HOST_ARGS = [
        {"name": "q", "kind": "ptr", "dtype": TMA_DT, "align": 16},
        {"name": "k", "kind": "ptr", "dtype": TMA_DT, "align": 16},
        {"name": "B", "kind": "i32"},
        {"name": "q_sh", "kind": "i64"},
        {"name": "q_st", "kind": "i64"},
        {"name": "q_sb", "kind": "i64"},
        {"name": "k_ss", "kind": "i64"},
        {"name": "k_sb", "kind": "i64"},
    ] + PARAMS[2:]

    @cute.struct
    class Smem:
        k_full: cute.struct.MemRange[Int64, KSLOTS]      # TMA tx (1 arrival)
        k_empty: cute.struct.MemRange[Int64, KSLOTS]     # one arrival per consuming warp
        q_full: cute.struct.MemRange[Int64, 2]           # TMA tx (1 arrival)
        info_full: cute.struct.MemRange[Int64, 2]        # INFO_FULL_ARRIVALS: the scheduler warp
        info_empty: cute.struct.MemRange[Int64, 2]       # 128 * NC arrivals: the consumer warpgroups, item done
        hdr: cute.struct.MemRange[Int32, 2 * HDR]
        bounds: cute.struct.MemRange[Int32, 2 * 2 * ITEM_TOK]
        wts: cute.struct.MemRange[Float32, 2 * NQ * BN]  # w * scale per (token, head) column
        sQ: cute.struct.Align[cute.struct.MemRange[DT, 2 * NQ * BN * D], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[DT, KSLOTS * BM * D], 1024]
        if FP8:
            kscale: cute.struct.MemRange[Float32, 2 * FP8_KSCALE_ROWS]   # k_scale of each item slot's rows (cp.async)
            wb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, 2 * NQ * NB2 * BN], 1024]   # head-sum B

    SMEM_BYTES = Smem.size_in_bytes()
    LAUNCH = {"grid": ["n_ctas", 1, 1], "block": [NTHREADS, 1, 1], "cluster": [1, 1, 1], "smem": SMEM_BYTES}

    @cute.jit
    def body(q_tma, k_tma, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
             n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
             n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64, w_sh: Int64,
             ld_slab: Int64, scale: Float32, p_off, has_off, fill, p_w32, w_f32, p_qs, qs_sb, qs_st, qs_sh, p_ks,
             ks_sb, ks_ss, p_bt=None, bt_sb=None, n_pages=None):
        """The kernel (all forms): q_tma / k_tma are the tensormaps' addresses; p_off / has_off / fill the causal
        offsets and the tail fill (None at trace time: the lightning indexer's kernel); p_w32 .. ks_ss the FP8 form's
        fp8_params (None otherwise); p_bt .. n_pages the paged form's (None otherwise)."""
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        lane = cute.arch.lane_idx()

        st = cutlass.memory.SmemAllocator().allocate(Smem)
        k_full = st.k_full.data_ptr()
        k_empty = st.k_empty.data_ptr()
        q_full = st.q_full.data_ptr()
        info_full = st.info_full.data_ptr()
        info_empty = st.info_empty.data_ptr()
        sHdr = st.hdr.get_tensor(cute.make_layout(2 * HDR))
        sBounds = st.bounds.get_tensor(cute.make_layout((2 * ITEM_TOK, 2), stride=(1, 2 * ITEM_TOK)))  # (lo/hi x token, slot)
        sW = st.wts.get_tensor(cute.make_layout((NQ * BN, 2), stride=(1, NQ * BN)))                  # (column, slot)
        lq, lk = sw128(DT, (BN, D, 2 * NQ)), sw128(DT, (BM, D, KSLOTS))
        sQ = st.sQ.get_tensor(lq.outer, swizzle=lq.inner)            # (BN (token, head), D, item slot x Q tile)
        sK = st.sK.get_tensor(lk.outer, swizzle=lk.inner)            # (64 rows, D, slot)
        sKs = None
        sWb = None
        if cutlass.const_expr(FP8):
            sKs = st.kscale.get_tensor(cute.make_layout(2 * FP8_KSCALE_ROWS))     # (row + slot * FP8_KSCALE_ROWS)
            lw = sw128(cutlass.BFloat16, (NB2, BN, 2 * NQ))
            sWb = st.wb.get_tensor(lw.outer, swizzle=lw.inner)           # (NB2 tokens, BN (token, head) columns,
            #                                                              item slot x Q tile)

        if warp == 0:
            prims.prefetch_tensormap(q_tma)
            prims.prefetch_tensormap(k_tma)
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(KSLOTS):
                    cute.arch.mbarrier_init(k_full + i, 1)
                    cute.arch.mbarrier_init(k_empty + i, 4 * NQ)
                for i in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(q_full + i, 1)
                    cute.arch.mbarrier_init(info_full + i, INFO_FULL_ARRIVALS)
                    cute.arch.mbarrier_init(info_empty + i, 128 * NC)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ------------------------------------------------------------------ producer warpgroup
            cute.arch.setmaxregister_decrease(40)
            if warp == 1:
                # scheduler: bounds of this CTA's items; publish those with candidates, then a stop entry
                pub = Int32(0)
                n_items = nblk * n_chunks
                n_slots = n_items
                if cutlass.const_expr(longest_first):
                    n_slots = (n_items + n_ctas - 1) // n_ctas * n_ctas     # whole rounds; slots past N are empty
                for w in cutlass.range(bid, n_slots, n_ctas, unroll=1):
                    wi = w
                    if cutlass.const_expr(longest_first):
                        rnd = w // n_ctas
                        pos = rnd * n_ctas + (bid if rnd % 2 == 0 else n_ctas - 1 - bid)
                        wi = cutlass.max(n_items - 1 - pos, Int32(0))         # an empty slot computes item 0 ...
                    c = wi // nblk
                    bx = wi - c * nblk
                    blk = blk0 + bx
                    b = blk // n_tblk
                    t0 = (blk - b * n_tblk) * ITEM_TOK
                    lo = Int32(0)
                    hi = Int32(0)
                    if lane < ITEM_TOK:
                        lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t0 + lane, T, S, causal, ratio, p_off, has_off, b)
                    lo_v = S
                    hi_v = Int32(0)
                    if hi > lo:
                        lo_v = lo
                        hi_v = hi
                    for sh in cutlass.range_constexpr(5):
                        lo_v = cutlass.min(lo_v, cute.arch.shuffle_sync_bfly(lo_v, offset=1 << sh))
                        hi_v = cutlass.max(hi_v, cute.arch.shuffle_sync_bfly(hi_v, offset=1 << sh))
                    kv_lo = cutlass.max(lo_v, c * chunk)
                    kv_hi = cutlass.min(hi_v, c * chunk + chunk)
                    if cutlass.const_expr(longest_first):
                        if n_items - 1 - pos < 0:                           # ... and publishes nothing
                            kv_hi = kv_lo
                    if kv_hi > kv_lo:
                        slot = pub % 2
                        cute.arch.mbarrier_wait(info_empty + slot, ((pub // 2) % 2) ^ 1)
                        if lane < ITEM_TOK:
                            sBounds[2 * lane, slot] = lo
                            sBounds[2 * lane + 1, slot] = hi
                        for i in cutlass.range_constexpr(NQ * BN // 32):
                            col = lane + 32 * i
                            j = col // H
                            t = t0 + j
                            wv = Float32(0.0)
                            if t < T:
                                if cutlass.const_expr(FP8):
                                    h = col - j * H
                                    w_off = Int64(b) * w_sb + Int64(t) * w_st + Int64(h) * w_sh
                                    if w_f32 != 0:
                                        wv = (p_w32 + w_off).load()
                                    else:
                                        wv = (p_w + w_off).load().to(Float32)
                                    wv = wv * (p_qs + (Int64(b) * qs_sb + Int64(t) * qs_st + Int64(h) * qs_sh)).load()
                                else:
                                    wv = (p_w + (Int64(b) * w_sb + Int64(t) * w_st + Int64(col - j * H) * w_sh)).load().to(Float32)
                            sW[col, slot] = wv * scale
                            if cutlass.const_expr(FP8):
                                hf = (32 * i) // BN                          # the column's Q tile (trace-time)
                                jt = j - hf * QC                             # its token within that tile
                                for nn in cutlass.range_constexpr(NB2):     # token jt's heads in column COLSTEP * jt
                                    sWb[nn, col - hf * BN, slot * NQ + hf] = Float32(cutlass.select_(
                                        jt * COLSTEP == nn, wv * scale, Float32(0.0))).to(cutlass.BFloat16)
                        if cutlass.const_expr(FP8):
                            cute.arch.fence_proxy("async.shared", space="cta")   # st.shared weights -> wgmma reads
                            # the item's k descales, one per K row of its tiles (rows past S read row S - 1, whose
                            # scores are never stored), landing before the consumers' info_full wait completes
                            for i in cutlass.range(lane, (kv_hi - kv_lo + BM - 1) // BM * BM, 32, unroll=4):
                                sk = cutlass.min(kv_lo + i, S - 1)
                                dst = sKs.iterator + (slot * FP8_KSCALE_ROWS + i)
                                if cutlass.const_expr(p_bt is None):
                                    src = p_ks + (Int64(b) * ks_sb + Int64(sk) * ks_ss)
                                else:       # the page of the row (clamped: a bad table reads a legal address)
                                    pg = (p_bt + (Int64(b) * bt_sb + sk // BM)).load()
                                    pg = cutlass.max(0, cutlass.min(pg, n_pages - 1))
                                    src = p_ks + (Int64(pg) * ks_sb + Int64(sk % BM) * ks_ss)
                                prims.cp_async_shared_global(dst, src, 4, "ca")
                            cute.arch.cp_async_mbarrier_arrive_noinc(info_full + slot)
                        if lane == 0:
                            sHdr[slot * HDR] = (kv_hi - kv_lo + BM - 1) // BM
                            sHdr[slot * HDR + 1] = bx
                            sHdr[slot * HDR + 2] = b
                            sHdr[slot * HDR + 3] = t0
                            sHdr[slot * HDR + 4] = kv_lo
                            sHdr[slot * HDR + 5] = kv_hi
                        cute.arch.mbarrier_arrive(info_full + slot)
                        pub += 1
                slot = pub % 2
                cute.arch.mbarrier_wait(info_empty + slot, ((pub // 2) % 2) ^ 1)
                if lane == 0:
                    sHdr[slot * HDR] = 0
                if cutlass.const_expr(FP8):
                    cute.arch.cp_async_mbarrier_arrive_noinc(info_full + slot)   # (no copies: arrives at once)
                cute.arch.mbarrier_arrive(info_full + slot)
            if cutlass.const_expr(dense_scores):
                if warp == 2:
                    if fill != 0:
                        # filler: -inf past the valid columns of the slab's rows rr = bid, bid + n_ctas, ... (rows of
                        # tokens past T, in a partial last block, belong to no query and are left alone)
                        width = Int32(ld_slab)
                        for rr in cutlass.range(bid, nblk * ITEM_TOK, n_ctas, unroll=1):
                            bx = rr // ITEM_TOK
                            blk = blk0 + bx
                            b = blk // n_tblk
                            t = (blk - b * n_tblk) * ITEM_TOK + (rr - bx * ITEM_TOK)
                            if t < T:
                                lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t, T, S, causal, ratio, p_off, has_off, b)
                                fill_tail(p_slab + Int64(rr) * ld_slab, cutlass.max(hi - lo, Int32(0)), width, lane, 32)
            if warp == 0:
                # TMA: per published item its Q tile (one of 2 buffers), then its K tiles through the ring. Only lane 0
                # reads the header (hdr_word: a shuffle gives the other lanes its value): lane 0's own arrivals on
                # q_full / k_full release its reads before the scheduler rewrites the slot (after the consumers, who
                # waited on those barriers, freed it); a read by a lane that never arrives would have no such order.
                j = Int32(0)
                g = Int32(0)
                cute.arch.mbarrier_wait(info_full, 0)
                ntiles = hdr_word(sHdr, 0, lane)
                while ntiles > 0:
                    slot = j % 2
                    b = hdr_word(sHdr, slot * HDR + 2, lane)
                    t0 = hdr_word(sHdr, slot * HDR + 3, lane)
                    kv_lo = hdr_word(sHdr, slot * HDR + 4, lane)
                    tma_load_tile(q_tma, tuple((sQ[None, None, slot * NQ + hf].iterator, BN * 64, KB,
                                                          (0, t0 + hf * QC, b)) for hf in range(NQ)),
                                  q_full + slot, NQ * Q_BYTES)
                    for i in cutlass.range(ntiles, unroll=1):
                        idx = g % KSLOTS
                        ring_wait_free(k_empty, g, KSLOTS)
                        k_smem = sK[None, None, idx].iterator
                        k_at = (kv_lo + i * BM, b)
                        if cutlass.const_expr(p_bt is not None):    # the tile's page (rows kv_lo + i BM are 64-aligned)
                            k_at = (0, (p_bt + (Int64(b) * bt_sb + (kv_lo // BM + i))).load())
                        k_tile = (k_smem, BM * 64, KB, k_at)
                        tma_load_tile(k_tma, (k_tile,), k_full + idx, K_TILE_BYTES)
                        g += 1
                    j += 1
                    cute.arch.mbarrier_wait(info_full + j % 2, (j // 2) % 2)
                    ntiles = hdr_word(sHdr, (j % 2) * HDR, lane)
        else:
            # ------------------------------------------------------------------ consumer warpgroups (ping-pong)
            cute.arch.setmaxregister_increase(REGS_C)
            cwg = wg - 1
            ctid = tidx - 128 * wg
            wwarp = warp % 4
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                DT, DT, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(BM, BN))
            thr_mma = tiled_mma.get_slice(ctid)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sK))    # (.., .., k, K slot)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sQ))    # (.., .., k, Q slot)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
            accMN = acc_mn_view(acc)
            cMN = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))
            if cutlass.const_expr(not FP8):
                wreg = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # w * scale of my columns
                lo_r = cute.make_rmem_tensor(cute.make_layout(QC), Int32)      # candidate bounds of the tokens
                hi_r = cute.make_rmem_tensor(cute.make_layout(QC), Int32)
            if cutlass.const_expr(FP8):
                ksr = cute.make_rmem_tensor(cute.make_layout(2), Float32)      # k_scale of the thread's 2 rows
                # the head sum: acc2 (64 K rows x NB2 tokens) = bf16(ReLU(S)) (registers, acc's own elements) x sWb
                hs = wgmma_tile(cutlass.BFloat16, None, sWb, (BM, NB2), ctid,
                                a_regs=cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.BFloat16))
                hsB = hs.mma.make_fragment_B(hs.thr.partition_B(sWb))            # (.., .., k, slot)
                lo2 = cute.make_rmem_tensor(cute.make_layout(2), Int32)          # bounds of my 2 head-sum columns
                hi2 = cute.make_rmem_tensor(cute.make_layout(2), Int32)          # (hi 0: no token, never stored)
                tok2 = cute.make_rmem_tensor(cute.make_layout(2), Int32)
            quad = lane % 4
            row_in_tile = wwarp * 16 + lane // 4

            # Turn order WG0 -> WG1 -> ... -> WG(NC-1) -> WG0 ...: BAR_WG0 + c is "WG c may issue"; WG c syncs on it,
            # issues, then arrives on the next warpgroup's. The last warpgroup's arrive here lets WG0 take the first
            # turn; WG0's sync after the loop takes the last one's final arrive, so every barrier generation is
            # complete when the CTA exits.
            if cwg == NC - 1:
                cute.arch.barrier_arrive(barrier_id=BAR_WG0, number_of_threads=256)
            j = Int32(0)
            g = Int32(0)
            cute.arch.mbarrier_wait(info_full, 0)
            ntiles = sHdr[0]
            while ntiles > 0:
                slot = j % 2
                bx = sHdr[slot * HDR + 1]
                kv_lo = sHdr[slot * HDR + 4]
                kv_hi = sHdr[slot * HDR + 5]
                hq = cwg % NQ                                              # this warpgroup's Q tile of the item
                qs = slot * NQ + hq
                row0 = Int64(bx) * ITEM_TOK + hq * QC                      # slab row of its first token
                if cutlass.const_expr(FP8):
                    for c in cutlass.range_constexpr(2):
                        col = 2 * quad + c
                        tok = col // COLSTEP
                        lo2[c] = Int32(0)
                        hi2[c] = Int32(0)
                        tok2[c] = Int32(0)
                        if col % COLSTEP == 0 and tok < QC:
                            tok2[c] = tok
                            lo2[c] = sBounds[2 * (hq * QC + tok), slot]
                            hi2[c] = cutlass.min(sBounds[2 * (hq * QC + tok) + 1, slot], kv_hi)   # chunk's end too
                else:
                    for c in cutlass.range_constexpr(NCOL):
                        wreg[c] = sW[hq * BN + cMN[0, c][1], slot]
                    for jj in cutlass.range_constexpr(QC):
                        lo_r[jj] = sBounds[2 * (hq * QC + jj), slot]
                        hi_r[jj] = cutlass.min(sBounds[2 * (hq * QC + jj) + 1, slot], kv_hi)   # chunk's end too
                cute.arch.mbarrier_wait(q_full + slot, (j // 2) % 2)
                for it in cutlass.range((ntiles + TPR - 1) // TPR, unroll=1):
                    tile = TPR * it + cwg // NQ                               # every TPR-th tile
                    gt = g + tile
                    idx = gt % KSLOTS
                    cute.arch.barrier(barrier_id=BAR_WG0 + cwg, number_of_threads=256)        # my turn
                    if tile < ntiles:
                        cute.arch.mbarrier_wait(k_full + idx, (gt // KSLOTS) % 2)
                        if cutlass.const_expr(FP8):
                            for r in cutlass.range_constexpr(2):                 # the k descales of my 2 rows
                                ksr[r] = sKs[slot * FP8_KSCALE_ROWS + tile * BM + row_in_tile + 8 * r]
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(NK):
                            cute.gemm(tiled_mma, acc, tCrA[None, None, kb, idx], tCrB[None, None, kb, qs], acc)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        cute.arch.barrier_arrive(barrier_id=BAR_WG0 + (cwg + 1) % NC, number_of_threads=256)  # next turn
                        warpgroup.wait_group(0)
                        if lane == 0:
                            cute.arch.mbarrier_arrive(k_empty + idx)
                        if cutlass.const_expr(FP8):
                            for r in cutlass.range_constexpr(2):
                                for c in cutlass.range_constexpr(NCOL):
                                    accMN[r, c] = cutlass.max(accMN[r, c], Float32(0.0))     # ReLU
                            hs.tA.store(acc_as_frg_a(acc).load().to(cutlass.BFloat16))
                            gemm_tile(hs.mma, hs.acc, hs.tA, hsB, BN // 16, b_stage=qs)
                            s_base = kv_lo + tile * BM + row_in_tile
                            for r in cutlass.range_constexpr(2):
                                s = s_base + 8 * r
                                for c in cutlass.range_constexpr(2 if COLSTEP == 1 else 1):   # my token columns
                                    if s >= lo2[c] and s < hi2[c]:
                                        off = (row0 + tok2[c]) * ld_slab + Int64(s - lo2[c])
                                        (p_slab + off).store(hs.acc_mn[r, c] * ksr[r])
                        else:
                            s_base = kv_lo + tile * BM + row_in_tile
                            for r in cutlass.range_constexpr(2):
                                s = s_base + 8 * r
                                for jj in cutlass.range_constexpr(QC):
                                    part = Float32(0.0)
                                    for c in cutlass.range_constexpr(NCOL):
                                        if cutlass.const_expr((8 * (c // 2)) // H == jj):   # column c: token jj
                                            part += cutlass.max(accMN[r, c], Float32(0.0)) * wreg[c]
                                    part += cute.arch.shuffle_sync_bfly(part, offset=1)
                                    part += cute.arch.shuffle_sync_bfly(part, offset=2)
                                    if quad == (r * QC + jj) % 4:            # spread the quad's stores over its lanes
                                        if s >= lo_r[jj] and s < hi_r[jj]:
                                            off = (row0 + jj) * ld_slab + Int64(s - lo_r[jj])
                                            (p_slab + off).store(part)
                    else:
                        cute.arch.barrier_arrive(barrier_id=BAR_WG0 + (cwg + 1) % NC, number_of_threads=256)  # (pad turn)
                g += ntiles
                cute.arch.mbarrier_arrive(info_empty + slot)                 # Q buffer, bounds, weights free
                j += 1
                cute.arch.mbarrier_wait(info_full + j % 2, (j // 2) % 2)
                ntiles = sHdr[(j % 2) * HDR]
            if cwg == 0:
                cute.arch.barrier(barrier_id=BAR_WG0, number_of_threads=256)

    if FP8 and paged:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
                   n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
                   n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64,
                   w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32, fill: Int32,
                   p_w32: cute.Pointer, w_f32: Int32, p_qs: cute.Pointer, qs_sb: Int64, qs_st: Int64, qs_sh: Int64,
                   p_ks: cute.Pointer, ks_sb: Int64, ks_ss: Int64, p_bt: cute.Pointer, bt_sb: Int64, n_pages: Int32):
            body(q_map.get_ptr(), k_map.get_ptr(), p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk,
                 chunk, n_chunks, n_ctas, causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill,
                 p_w32, w_f32, p_qs, qs_sb, qs_st, qs_sh, p_ks, ks_sb, ks_ss, p_bt, bt_sb, n_pages)
    elif dense_scores and paged:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
                   n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
                   n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64,
                   w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32, fill: Int32,
                   p_bt: cute.Pointer, bt_sb: Int64, n_pages: Int32):
            body(q_map.get_ptr(), k_map.get_ptr(), p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk,
                 chunk, n_chunks, n_ctas, causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill,
                 None, None, None, None, None, None, None, None, None, p_bt, bt_sb, n_pages)
    elif FP8:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
                   n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
                   n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64,
                   w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32, fill: Int32,
                   p_w32: cute.Pointer, w_f32: Int32, p_qs: cute.Pointer, qs_sb: Int64, qs_st: Int64, qs_sh: Int64,
                   p_ks: cute.Pointer, ks_sb: Int64, ks_ss: Int64):
            body(q_map.get_ptr(), k_map.get_ptr(), p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk,
                 chunk, n_chunks, n_ctas, causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill,
                 p_w32, w_f32, p_qs, qs_sb, qs_st, qs_sh, p_ks, ks_sb, ks_ss)
    elif dense_scores:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
                   n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
                   n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64,
                   w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32, fill: Int32):
            body(q_map.get_ptr(), k_map.get_ptr(), p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk,
                 chunk, n_chunks, n_ctas, causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill,
                 None, None, None, None, None, None, None, None, None)
    else:
        @cute.kernel
        def kernel(q_map: cutlass.GridConstant[xcuda.TensorMap], k_map: cutlass.GridConstant[xcuda.TensorMap],
                   p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
                   n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32, chunk: Int32,
                   n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64, w_st: Int64,
                   w_sh: Int64, ld_slab: Int64, scale: Float32):
            body(q_map.get_ptr(), k_map.get_ptr(), p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk,
                 chunk, n_chunks, n_ctas, causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, None, None, None,
                 None, None, None, None, None, None, None, None, None)

    MAP_DT = cutlass.Uint8 if FP8 else DT
    SDIV = 16 // ELEM             # elements per 16-byte stride unit

    @cute.jit
    def tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, S, KB_OUT=None):
        """The TMA descriptors of q [B, T, H, D] -> (D, H, T, B) and k [B, S, D] -> (D, S, B) (strides in elements;
        create_tensor_map_tiled takes them in 16-byte units, elements * ELEM // 16); KB_OUT: k's outer dim when it
        is not B (the paged form's n_pages: k [n_pages, 64, D])."""
        tq = xcuda.create_tensor_map_tiled(global_address=p_q.toint(), dtype=MAP_DT, global_dims=[D, H, T, B],
                                           global_strides=[q_sh // SDIV, q_st // SDIV, q_sb // SDIV],
                                           box_dims=[BOXC, H, QC, 1], swizzle=xcuda.TensorMapSwizzle.s128b)
        k_outer = B
        if cutlass.const_expr(KB_OUT is not None):
            k_outer = KB_OUT
        tk = xcuda.create_tensor_map_tiled(global_address=p_k.toint(), dtype=MAP_DT, global_dims=[D, S, k_outer],
                                           global_strides=[k_ss // SDIV, k_sb // SDIV], box_dims=[BOXC, BM, 1],
                                           swizzle=xcuda.TensorMapSwizzle.s128b)
        return tq, tk

    if FP8 and paged:
        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, B: Int32, q_sh: Int64, q_st: Int64, q_sb: Int64,
                 k_ss: Int64, k_sb: Int64, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer,
                 p_cu_k: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32,
                 chunk: Int32, n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64,
                 w_st: Int64, w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32,
                 fill: Int32,
                 p_w32: cute.Pointer, w_f32: Int32, p_qs: cute.Pointer, qs_sb: Int64, qs_st: Int64, qs_sh: Int64,
                 p_ks: cute.Pointer, ks_sb: Int64, ks_ss: Int64, p_bt: cute.Pointer, bt_sb: Int64, n_pages: Int32):
            tq, tk = tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, BM, n_pages)
            kernel(tq, tk, p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk, chunk, n_chunks, n_ctas,
                   causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill, p_w32, w_f32, p_qs,
                   qs_sb, qs_st, qs_sh, p_ks, ks_sb, ks_ss, p_bt, bt_sb, n_pages).launch(
                grid=(n_ctas, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)
    elif dense_scores and paged:
        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, B: Int32, q_sh: Int64, q_st: Int64, q_sb: Int64,
                 k_ss: Int64, k_sb: Int64, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer,
                 p_cu_k: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32,
                 chunk: Int32, n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64,
                 w_st: Int64, w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32,
                 fill: Int32, p_bt: cute.Pointer, bt_sb: Int64, n_pages: Int32):
            tq, tk = tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, BM, n_pages)
            kernel(tq, tk, p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk, chunk, n_chunks, n_ctas,
                   causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill, p_bt, bt_sb,
                   n_pages).launch(grid=(n_ctas, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)
    elif FP8:
        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, B: Int32, q_sh: Int64, q_st: Int64, q_sb: Int64,
                 k_ss: Int64, k_sb: Int64, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer,
                 p_cu_k: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32,
                 chunk: Int32, n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64,
                 w_st: Int64, w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32,
                 fill: Int32,
                 p_w32: cute.Pointer, w_f32: Int32, p_qs: cute.Pointer, qs_sb: Int64, qs_st: Int64, qs_sh: Int64,
                 p_ks: cute.Pointer, ks_sb: Int64, ks_ss: Int64):
            tq, tk = tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, S)
            kernel(tq, tk, p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk, chunk, n_chunks, n_ctas,
                   causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill, p_w32, w_f32, p_qs,
                   qs_sb, qs_st, qs_sh, p_ks, ks_sb, ks_ss).launch(
                grid=(n_ctas, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)
    elif dense_scores:
        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, B: Int32, q_sh: Int64, q_st: Int64, q_sb: Int64,
                 k_ss: Int64, k_sb: Int64, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer,
                 p_cu_k: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32,
                 chunk: Int32, n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64,
                 w_st: Int64, w_sh: Int64, ld_slab: Int64, scale: Float32, p_off: cute.Pointer, has_off: Int32,
                 fill: Int32):
            tq, tk = tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, S)
            kernel(tq, tk, p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk, chunk, n_chunks, n_ctas,
                   causal, ratio, w_sb, w_st, w_sh, ld_slab, scale, p_off, has_off, fill).launch(
                grid=(n_ctas, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)
    else:
        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, B: Int32, q_sh: Int64, q_st: Int64, q_sb: Int64,
                 k_ss: Int64, k_sb: Int64, p_w: cute.Pointer, p_slab: cute.Pointer, p_cu_q: cute.Pointer,
                 p_cu_k: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, nblk: Int32,
                 chunk: Int32, n_chunks: Int32, n_ctas: Int32, causal: Int32, ratio: Int32, w_sb: Int64,
                 w_st: Int64, w_sh: Int64, ld_slab: Int64, scale: Float32):
            tq, tk = tensor_maps(p_q, p_k, B, q_sh, q_st, q_sb, k_ss, k_sb, T, S)
            kernel(tq, tk, p_w, p_slab, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, nblk, chunk, n_chunks, n_ctas,
                   causal, ratio, w_sb, w_st, w_sh, ld_slab, scale).launch(
                grid=(n_ctas, 1, 1), block=(NTHREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
