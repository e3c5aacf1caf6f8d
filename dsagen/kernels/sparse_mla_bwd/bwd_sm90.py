"""Fused sparse MLA backward for Hopper (sm_90a): `SparseMlaBwdSm90`, and `build(...)`, which returns a fresh kernel
and host entry of it with a spec's values bound as Python constants, plus the flat ABI (`params`) and the launch
declaration of the rendered kernel module.

An item is (query row, 64 heads); the grid has min(items, n_ctas) CTAs and CTA b runs items b, b + grid, ... Per
item, Q (64 x D_QK) and dO (64 x D_V) are loaded once into shared memory; the item's valid top-k slots go by in
tiles of BN = 64 rows gathered into one KV stage. Every head of an item uses the same gathered rows (MQA).

Per tile (K = V-prefix = the gathered rows, P and dS 64 heads x 64 rows; S scaled by `scale` in the softmax):
    S  = Q K^T                   P  = exp2(S * scale * log2 e - lse_s * log2 e), 0 at invalid slots
    dP = dO V^T                  dS = scale * P * (dP - delta)        (the gradient of the unscaled Q K^T)
    dQ += dS K                   dKV[rows] += P^T dO (columns < D_V) + dS^T Q
lse_s = logaddexp(lse, sink) (the forward's lse is KV-only; +inf rows stay +inf: P = 0), delta = rowsum(O * dO).

Warpgroups (384 threads):
  WG0  producer   per item: Q and dO (cp.async, once both consumers finished the previous item: qdo_free); per
                  tile: the tile's ids into sIds[g % 2] (-1 where invalid or past the row's length; ids_mbar[g % 2],
                  16 arrivals) and the 64 rows into the KV stage once it is free (kv_free), cp.async 16-byte chunks
                  zero-filled for invalid ids, completing kv_ready (noinc arrivals).
  WG1  consumer A S = Q K^T; P (fp32, masked) -> bf16 -> sP (stmatrix); dQ[:, 256:] += dS K[:, 256:] (SS, dS from
                  sdS); frees the stage; the dKV column chunks 0..3.
  WG2  consumer B delta of its rows (per item, from out and dout in global memory, also written to `delta`);
                  dP = dO V^T; P from sP (ldmatrix); dS -> sdS and registers; dQ[:, :256] += dS K[:, :256] (RS);
                  frees the stage; the dKV column chunks 4..D_QK / 64 - 1.
  A dKV chunk (64 rows x 64 columns) = P^T dO_c + dS^T Q_c (SS, both operands MN-major views of the smem tiles;
  no dO term for the RoPE chunk), then added to the dKV accumulator rows of the tile's ids by 16-byte FP32
  atomics (red.global.add.v4.f32) after a lane-pair exchange, invalid ids skipped; deterministic: stored instead
  (st.global.v4.f32) to the (item, slot) row of a per-slot buffer, which the host sums in a fixed order.
  Named barriers (256 threads = WG1 + WG2, each arrived by one consumer and synced by the other once per tile):
    BAR_P       P of the tile in sP (A arrives, B syncs)
    BAR_DS      dS of the tile in sdS (B arrives, A syncs)
    BAR_A_DONE  A's dQ and dKV reads of sdS retired (A arrives after its chunks; B syncs before the next dS)
    BAR_B_DONE  B's dKV reads of sP retired (B arrives after its chunks; A syncs before the next P)
  The last arrival of each DONE barrier is matched by a sync after the CTA's item loop.
  mbarriers (g = the tile's index over the CTA's items, it = the item's index among them): kv_ready (128
  producer noinc arrivals) waited with parity g % 2; kv_free (256: every consumer thread once per tile, after its
  last read of the stage: its dQ product) waited by the producer with parity (g % 2) ^ 1; ids_mbar[g % 2] (16)
  waited with parity (g // 2) % 2; q_mbar (128 noinc) waited with parity it % 2; qdo_free (256: every consumer
  thread once per item, after its last dKV chunk) waited by the producer with parity (it % 2) ^ 1.
  The producer overwrites sIds[g % 2] for tile g + 2 only after kv_free of tile g + 1, which both consumers
  arrive after their dKV chunks of tile g.

Every value of the spec is a Python constant of the instance (configuration branches are `cutlass.const_expr`).
Accumulators are zeroed with fill(0.0) and every wgmma accumulates, so no MMA object changes inside a loop.
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp, StMatrix8x8x16bOp

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers, row_head_block
from dsagen.kernels.common.sm90.epilogue import add_row_pair_v4, store_row_v4, store_slot_row_pair_v4
from dsagen.kernels.common.sm90.gather import (cp_async_tiles_rows, gather_tile_rows, publish_tile_ids,
                                               row_gather_producer, smem_bytes, wait_gathered_tile)
from dsagen.kernels.common.sm90.grid_sync import grid_barrier
from dsagen.kernels.common.sm90.ids import load_tile_ids_raw, tile_keep_mask, valid_tile_ids
from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view, sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, wgmma_tile
from dsagen.kernels.common.sm90.ptx import l2_evict_first_policy
from dsagen.kernels.common.sm90.reduce import quad_sum

LOG2E = math.log2(math.e)


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (s_q, H, D_QK), row stride ld_q
        {"name": "kv", "kind": "ptr", "dtype": dtype, "align": 16},           # (n_kv, D_QK), row stride ld_kv
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (s_q, topk), row stride ld_idx
        {"name": "win", "kind": "ptr", "dtype": "int32", "align": 4},         # (s_q, 2) slot windows
        {"name": "sink", "kind": "ptr", "dtype": "float32", "align": 4},      # (H,), read when has_sink
        {"name": "out", "kind": "ptr", "dtype": dtype, "align": 16},          # (s_q, H, D_V) contiguous
        {"name": "dout", "kind": "ptr", "dtype": dtype, "align": 16},         # (s_q, H, D_V) contiguous
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (s_q, H) KV-only, contiguous
        {"name": "dq", "kind": "ptr", "dtype": dtype, "align": 16},           # (s_q, H, D_QK) contiguous
        {"name": "dkv", "kind": "ptr", "dtype": "float32", "align": 16},      # accumulator or per-slot rows
        {"name": "delta", "kind": "ptr", "dtype": "float32", "align": 4},     # (s_q, H) out
        {"name": "s_q", "kind": "i32"},
        {"name": "n_kv", "kind": "i32"},
        {"name": "topk", "kind": "i32"},
        {"name": "ld_q", "kind": "i64"},
        {"name": "ld_kv", "kind": "i64"},
        {"name": "ld_idx", "kind": "i64"},
        {"name": "softmax_scale", "kind": "f32"},
        {"name": "has_sink", "kind": "i32"},
        {"name": "counter", "kind": "ptr", "dtype": "int32", "align": 4},     # grid barrier count, zeroed
        {"name": "sync_grid", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},                  # the most CTAs to launch (each loops over items)
    ]


def build(num_heads: int, d_qk: int, d_v: int, dtype: str, deterministic: bool, regs_producer: int, regs_a: int,
          regs_b: int, chunk_buffers_a: int = 1, dkv_l2_evict_last: bool = False) -> BuiltKernel:
    """A new sparse MLA backward for one SparseAttnBwdSpec's values (SparseMlaBwdSm90 lists the constraints). Each
    call returns distinct function objects, so every rendered module names its own kernel."""
    bwd = SparseMlaBwdSm90(num_heads, d_qk, d_v, dtype, deterministic, regs_producer, regs_a, regs_b,
                           chunk_buffers_a, dkv_l2_evict_last)
    return BuiltKernel.of(params(dtype), bwd, f"min(s_q * {bwd.HB}, n_ctas)")


class KernelArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas), read by every role."""
    p_q: Any
    p_kv: Any
    p_idx: Any
    p_win: Any
    p_sink: Any
    p_out: Any
    p_dout: Any
    p_lse: Any
    p_dq: Any
    p_dkv: Any
    p_delta: Any
    s_q: Any
    n_kv: Any
    topk: Any
    ld_q: Any
    ld_kv: Any
    ld_idx: Any
    softmax_scale: Any
    has_sink: Any
    p_counter: Any
    sync_grid: Any


class Shared(NamedTuple):
    """The CTA's shared tiles and barriers (SparseMlaBwdSm90 docstring: who arrives, who waits)."""
    sQ: Any
    sdO: Any
    sKV: Any
    sP: Any
    sdS: Any
    sIds: Any          # [tile parity][row]: the tile's ids, -1 where invalid
    kv_ready: Any
    kv_free: Any
    ids_mbar: Any      # + parity
    q_mbar: Any
    qdo_free: Any


class SparseMlaBwdSm90:
    """The kernel of one SparseAttnBwdSpec: `kernel` (the @cute.kernel, flat ABI in `params`) and `host` (the
    @cute.jit launch: grid min(s_q * HB, n_ctas), 384 threads, `Smem` dynamic smem, min_blocks_per_mp=1).

    Arguments (pointers 16-byte aligned where vectors touch them): q (s_q, H, D_QK) with row stride ld_q (heads x
    D_QK contiguous), kv (n_kv, D_QK) with row stride ld_kv, idx (s_q, topk) int32 with row stride ld_idx, win
    (s_q, 2) int32: row t's slots [win[t, 0], win[t, 1]), walked in 64-slot tiles (ids that are negative or >= n_kv
    are skipped; the host orders each row's ids by KV window, so the CTAs add to one window's rows at a time),
    sink (H,) fp32 (read when has_sink), out and dout (s_q, H, D_V) contiguous, lse (s_q, H) fp32 (KV-only, +inf
    for a row without a valid slot), dq (s_q, H, D_QK) contiguous (written), dkv fp32: deterministic=False the
    (n_kv, D_QK) accumulator the kernel adds to (zeroed by the caller), deterministic=True the (s_q * HB, topk, D_QK)
    per-slot rows the kernel stores (slot j of item i at row i * topk + j, for every j inside the window; zeros at
    invalid ids); delta (s_q, H) fp32 (written: rowsum(out * dout)); counter: an int32 the producers count their
    rounds of items on when sync_grid (zeroed by the caller; the grid must fit the SMs).

    Constraints (SparseAttnBwdSpec.reasons): num_heads 64 or 128, d_qk 512 or 576, d_v 512, dtype "bfloat16" or
    "float16", register budgets multiples of 8 summing to at most 504.
    """

    M = 64                          # heads per CTA = wgmma M
    BN = 64                         # gathered rows per tile
    THREADS = 384
    DQ_B = 256                      # dQ columns of consumer B ([0, 256)); A has [256, D_QK)
    CHUNKS_A = 4                    # dKV column chunks of consumer A (0..3); B has 4..NKB-1
    BAR_P = 1
    BAR_DS = 2
    BAR_A_DONE = 3
    BAR_B_DONE = 4
    BAR_PRODUCER = 5                # the producer warpgroup (128) after its grid barrier

    def __init__(self, num_heads: int, d_qk: int, d_v: int, dtype: str, deterministic: bool, regs_producer: int,
                 regs_a: int, regs_b: int, chunk_buffers_a: int = 1, dkv_l2_evict_last: bool = False):
        self.H = num_heads
        self.HB = num_heads // self.M
        self.D_QK = d_qk
        self.D_V = d_v
        self.NKB = d_qk // 64                   # 64-column blocks of a row (= dKV chunks)
        self.NVB = d_v // 64                    # ... of which carry a dO term
        # A's dQ pieces (first column, width): each starts on a 64-column block and is a multiple of its width
        self.DQ_A = ((256, 128), (384, 192)) if d_qk == 576 else ((256, 128), (384, 128))
        self.deterministic = deterministic
        self.fp16 = dtype == "float16"
        self.dtype = cutlass.Float16 if self.fp16 else cutlass.BFloat16
        self.regs = (regs_producer, regs_a, regs_b)
        # dKV chunk accumulators of A and B (2: the next chunk's wgmmas overlap the sends)
        self.chunk_buffers = (chunk_buffers_a, 2)
        self.dkv_l2_evict_last = dkv_l2_evict_last       # the dKV atomics carry an L2 evict_last policy
        self.Smem = self._smem_struct()
        self.kernel, self.host = self._entry_points()

    def _smem_struct(self):
        DT, M, BN, D_QK, D_V = self.dtype, self.M, self.BN, self.D_QK, self.D_V

        @cute.struct
        class Smem:
            kv_ready: cute.struct.MemRange[Int64, 1]
            kv_free: cute.struct.MemRange[Int64, 1]
            ids_mbar: cute.struct.MemRange[Int64, 2]
            q_mbar: cute.struct.MemRange[Int64, 1]
            qdo_free: cute.struct.MemRange[Int64, 1]
            ids: cute.struct.MemRange[Int32, 2 * BN]
            sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D_QK], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[DT, M * D_V], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[DT, BN * D_QK], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[DT, M * BN], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[DT, M * BN], 1024]

        return Smem

    def _entry_points(self):
        bwd = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_win: cute.Pointer,
                   p_sink: cute.Pointer, p_out: cute.Pointer, p_dout: cute.Pointer, p_lse: cute.Pointer,
                   p_dq: cute.Pointer, p_dkv: cute.Pointer, p_delta: cute.Pointer,
                   s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                   softmax_scale: Float32, has_sink: Int32, p_counter: cute.Pointer,
                   sync_grid: Int32, n_ctas: Int32):
            bwd.body(KernelArgs(p_q, p_kv, p_idx, p_win, p_sink, p_out, p_dout, p_lse, p_dq, p_dkv, p_delta, s_q,
                                n_kv, topk, ld_q, ld_kv, ld_idx, softmax_scale, has_sink, p_counter,
                                sync_grid))

        @cute.jit
        def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_win: cute.Pointer,
                 p_sink: cute.Pointer, p_out: cute.Pointer, p_dout: cute.Pointer, p_lse: cute.Pointer,
                 p_dq: cute.Pointer, p_dkv: cute.Pointer, p_delta: cute.Pointer,
                 s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                 softmax_scale: Float32, has_sink: Int32, p_counter: cute.Pointer,
                   sync_grid: Int32, n_ctas: Int32):
            kernel(p_q, p_kv, p_idx, p_win, p_sink, p_out, p_dout, p_lse, p_dq, p_dkv, p_delta, s_q, n_kv, topk,
                   ld_q, ld_kv, ld_idx, softmax_scale, has_sink, p_counter, sync_grid, n_ctas).launch(
                grid=(cutlass.min(s_q * bwd.HB, n_ctas), 1, 1), block=(bwd.THREADS, 1, 1),
                smem=bwd.Smem.size_in_bytes(), min_blocks_per_mp=1)

        return kernel, host

    # ------------------------------------------------------------------------------------------------ the CTA
    @cute.jit
    def body(self, a: KernelArgs):
        """Shared views and barriers, then the roles: WG0 producer, WG1 consumer A, WG2 consumer B."""
        DT, M, BN, D_QK, D_V = self.dtype, self.M, self.BN, self.D_QK, self.D_V
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (M, D_QK))
        lay_do = sw128(DT, (M, D_V))
        lay_kv = sw128(DT, (BN, D_QK))
        lay_p = sw128(DT, (M, BN))
        sh = Shared(sQ=st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner),
                    sdO=st.sdO.get_tensor(lay_do.outer, swizzle=lay_do.inner),
                    sKV=st.sKV.get_tensor(lay_kv.outer, swizzle=lay_kv.inner),
                    sP=st.sP.get_tensor(lay_p.outer, swizzle=lay_p.inner),
                    sdS=st.sdS.get_tensor(lay_p.outer, swizzle=lay_p.inner),
                    sIds=st.ids.get_tensor(cute.make_layout(2 * BN)),
                    kv_ready=st.kv_ready.data_ptr(), kv_free=st.kv_free.data_ptr(), ids_mbar=st.ids_mbar.data_ptr(),
                    q_mbar=st.q_mbar.data_ptr(), qdo_free=st.qdo_free.data_ptr())

        n_items = a.s_q * self.HB
        init_mbarriers(c.warp, [(sh.kv_ready, 128),       # producer noinc arrivals
                                (sh.kv_free, 256),        # every consumer thread once per tile
                                (sh.ids_mbar, 16),        # one producer thread per group of 8
                                (sh.ids_mbar + 1, 16),
                                (sh.q_mbar, 128),
                                (sh.qdo_free, 256)])      # every consumer thread once per item
        if c.wg == 0:
            self.producer(a, sh, st, lay_q, lay_do, lay_kv, c.tidx, c.bidx, n_items, c.nctas)
        elif c.wg == 1:
            self.consumer_a(a, sh, c.tidx, c.bidx, n_items, c.nctas)
        else:
            self.consumer_b(a, sh, c.tidx, c.bidx, n_items, c.nctas)

    @cute.jit
    def item_setup(self, a: KernelArgs, item: Int32):
        """An item = (query row, 64 heads): (tok, head0)."""
        return row_head_block(item, self.HB, self.M)

    @cute.jit
    def window(self, a: KernelArgs, tok):
        """The window of row tok: its slots [lo, hi) and their BN-slot tiles."""
        w = a.p_win + Int64(tok) * 2
        lo = w.load()
        hi = (w + 1).load()
        return lo, hi, (hi - lo + self.BN - 1) // self.BN

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_do, lay_kv, tidx, bidx, n_items, nctas):
        """cp.async gathers: per item Q and dO, per tile the ids and the 64 rows (16 groups of 8 threads; group g
        owns rows g, g + 16, g + 32, g + 48; a thread moves one 16-byte chunk of each 64-column block)."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sKV, lay_kv, self.BN)   # Q and dO are read once per item
        lanes, ids, grp, policy = p.lanes, p.ids, p.lanes.grp, p.policy
        sQb, sKVb, sw_kv = p.q_smem, p.kv_smem, p.sw_kv
        sdOb = smem_bytes(st.sdO)
        RPG = self.BN // 16
        ids_next = cute.make_rmem_tensor(RPG, Int32)
        gt = Int32(0)
        it = Int32(0)
        for item in cutlass.range(bidx, n_items, nctas, unroll=1):
            tok, head0 = self.item_setup(a, item)
            if a.sync_grid != 0:     # the CTAs walk the KV windows together (grid_sync.grid_barrier)
                grid_barrier(a.p_counter, tidx, it, n_items, nctas, self.BAR_PRODUCER, 128)
            cute.arch.mbarrier_wait(sh.qdo_free, (it % 2) ^ 1)
            q_rows = a.p_q + (Int64(tok) * a.ld_q + Int64(head0 * self.D_QK))
            do_rows = a.p_dout + (Int64(tok) * self.H + head0) * self.D_V
            cp_async_tiles_rows(((sQb, lay_q, q_rows, self.D_QK, None), (sdOb, lay_do, do_rows, self.D_V, None)),
                                self.M, grp, lanes.col0, policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(sh.q_mbar)
            mIdx = cute.make_tensor(a.p_idx + Int64(tok) * a.ld_idx, cute.make_layout(a.topk))
            lo, hi, ntiles = self.window(a, tok)
            # ids go one tile ahead: tile j + 1's loads are issued before tile j waits for the free stage, so
            # their latency is off the path from kv_free to the gather
            if ntiles > 0:
                load_tile_ids_raw(ids, mIdx, lo, hi, grp)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                if j + 1 < ntiles:
                    load_tile_ids_raw(ids_next, mIdx, lo + (j + 1) * self.BN, hi, grp)
                cute.arch.mbarrier_wait(sh.kv_free, (g % 2) ^ 1)
                valid_tile_ids(ids, ids, a.n_kv)
                publish_tile_ids(sh.sIds, (g % 2) * self.BN, ids, lanes, sh.ids_mbar + (g % 2))
                gather_tile_rows(sKVb, sw_kv, lay_kv, a.p_kv, a.ld_kv, ids, lanes.col0, (0, self.NKB))
                cute.arch.cp_async_mbarrier_arrive_noinc(sh.kv_ready)
                for i in cutlass.range_constexpr(RPG):
                    ids[i] = ids_next[i]
            gt += ntiles
            it += 1

    # ------------------------------------------------------------------------------------------- consumer A (WG1)
    @cute.jit
    def consumer_a(self, a, sh, tidx, bidx, n_items, nctas):
        """S, P, dQ[:, 256:], dKV chunks 0..3."""
        DT, M, BN = self.dtype, self.M, self.BN
        cute.arch.setmaxregister_increase(self.regs[1])
        ctid = tidx - 128
        S = wgmma_tile(DT, sh.sQ, sh.sKV, (M, BN), ctid)
        mma_s, tSrQ, tSrK, accS, sMN, cS = S.mma, S.tA, S.tB, S.acc, S.acc_mn, S.coord_mn
        NR = cute.size(sMN, mode=[0])
        NC = cute.size(sMN, mode=[1])
        rP = cute.make_rmem_tensor(accS.layout, DT)
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), DT), mma_s)
        thr_st = stsm.get_slice(ctid)
        tPsP = thr_st.partition_D(sh.sP)
        tPrP = thr_st.retile(rP)
        # dQ[:, 256:] += dS K[:, 256:]: A = dS (smem, K-major), B = K^T pieces (MN-major views of the stage)
        sKt = cute.composition(sh.sKV, cute.make_layout((self.D_QK, BN), stride=(BN, 1)))   # (d, n) = sKV[n, d]
        c0, w0 = self.DQ_A[0]
        c1, w1 = self.DQ_A[1]
        mma_q0 = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                   (1, 1, 1), tiler_mn=(M, w0))
        mma_q1 = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                   (1, 1, 1), tiler_mn=(M, w1))
        thr_q0 = mma_q0.get_slice(ctid)
        thr_q1 = mma_q1.get_slice(ctid)
        tQ0rdS = mma_q0.make_fragment_A(thr_q0.partition_A(sh.sdS))
        tQ1rdS = mma_q1.make_fragment_A(thr_q1.partition_A(sh.sdS))
        tQ0rK = mma_q0.make_fragment_B(thr_q0.partition_B(cute.local_tile(sKt, (w0, BN), (c0 // w0, 0))))
        tQ1rK = mma_q1.make_fragment_B(thr_q1.partition_B(cute.local_tile(sKt, (w1, BN), (c1 // w1, 0))))
        accQ0 = cute.make_rmem_tensor(thr_q0.partition_shape_C((M, w0)), Float32)
        accQ1 = cute.make_rmem_tensor(thr_q1.partition_shape_C((M, w1)), Float32)
        cQ0 = acc_mn_view(thr_q0.partition_C(cute.make_identity_tensor((M, w0))))
        cQ1 = acc_mn_view(thr_q1.partition_C(cute.make_identity_tensor((M, w1))))
        mma_q0.set(warpgroup.Field.ACCUMULATE, True)
        mma_q1.set(warpgroup.Field.ACCUMULATE, True)
        kvc = self.dkv_chunk_state(sh, ctid, self.chunk_buffers[0])
        keep = cute.make_rmem_tensor(NC, cutlass.Boolean)
        lse_l2 = cute.make_rmem_tensor(NR, Float32)
        scale_log2 = a.softmax_scale * LOG2E
        q4 = ctid % 4
        dq_policy = l2_evict_first_policy()     # dq is written once

        gt = Int32(0)
        it = Int32(0)
        for item in cutlass.range(bidx, n_items, nctas, unroll=1):
            tok, head0 = self.item_setup(a, item)
            accQ0.fill(0.0)
            accQ1.fill(0.0)
            # lse_s = logaddexp(lse, sink) of the thread's rows, log2 domain (+inf stays +inf: P = 0)
            for r in cutlass.range_constexpr(NR):
                h = head0 + cS[r, 0][0]
                l2 = (a.p_lse + (Int64(tok) * self.H + h)).load() * LOG2E
                if a.has_sink != 0:
                    s2 = (a.p_sink + h).load() * LOG2E
                    m = cute.arch.fmax(l2, s2)
                    if l2 != Float32.inf:
                        l2 = m + cute.math.log2(cute.math.exp2(l2 - m, fastmath=True)
                                                + cute.math.exp2(s2 - m, fastmath=True), fastmath=False)
                lse_l2[r] = l2
            cute.arch.mbarrier_wait(sh.q_mbar, it % 2)
            lo, hi, ntiles = self.window(a, tok)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                # S = Q K^T
                wait_gathered_tile(sh.kv_ready, g, 1)
                gemm_tile(mma_s, accS, tSrQ, tSrK, self.D_QK // 16)
                # P, masked by the tile's ids
                cute.arch.mbarrier_wait(sh.ids_mbar + (g % 2), (g // 2) % 2)
                tile_keep_mask(keep, sh.sIds, (g % 2) * BN, cS)
                for r in cutlass.range_constexpr(NR):
                    for c in cutlass.range_constexpr(NC):
                        p = cute.math.exp2(sMN[r, c] * scale_log2 - lse_l2[r], fastmath=True)
                        sMN[r, c] = p if keep[c] else Float32(0.0)
                rP.store(accS.load().to(DT))
                if g > 0:
                    cute.arch.barrier(barrier_id=self.BAR_B_DONE, number_of_threads=256)   # B's reads of sP done
                cute.copy(stsm, tPrP, tPsP)
                cute.arch.fence_proxy("async.shared", space="cta")   # st.shared P -> wgmma reads (A and B)
                cute.arch.barrier_arrive(barrier_id=self.BAR_P, number_of_threads=256)
                # dQ[:, 256:] += dS K[:, 256:]
                cute.arch.barrier(barrier_id=self.BAR_DS, number_of_threads=256)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(BN // 16):
                    cute.gemm(mma_q0, accQ0, tQ0rdS[None, None, kb], tQ0rK[None, None, kb], accQ0)
                    cute.gemm(mma_q1, accQ1, tQ1rdS[None, None, kb], tQ1rK[None, None, kb], accQ1)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(sh.kv_free)
                # dKV chunks 0..3
                self.dkv_chunks(a, sh, kvc, 0, self.CHUNKS_A, item, lo + j * BN, hi, g, q4)
                cute.arch.barrier_arrive(barrier_id=self.BAR_A_DONE, number_of_threads=256)
            gt += ntiles
            cute.arch.mbarrier_arrive(sh.qdo_free)
            oq0 = acc_mn_view(accQ0)
            oq1 = acc_mn_view(accQ1)
            for r in cutlass.range_constexpr(NR):
                self.store_dq_row(a, oq0, r, tok, head0 + cQ0[r, 0][0], c0, q4, dq_policy)
                self.store_dq_row(a, oq1, r, tok, head0 + cQ1[r, 0][0], c1, q4, dq_policy)
            it += 1
        if gt > 0:
            cute.arch.barrier(barrier_id=self.BAR_B_DONE, number_of_threads=256)   # B's last arrival

    # ------------------------------------------------------------------------------------------- consumer B (WG2)
    @cute.jit
    def consumer_b(self, a, sh, tidx, bidx, n_items, nctas):
        """delta, dP, dS, dQ[:, :256], dKV chunks 4..NKB-1."""
        DT, M, BN = self.dtype, self.M, self.BN
        cute.arch.setmaxregister_increase(self.regs[2])
        ctid = tidx - 256
        dP = wgmma_tile(DT, sh.sdO, cute.local_tile(sh.sKV, (BN, self.D_V), (0, 0)), (M, BN), ctid)
        mma_dp, tDrdO, tDrV, accdP, dMN, cD = dP.mma, dP.tA, dP.tB, dP.acc, dP.acc_mn, dP.coord_mn
        NR = cute.size(dMN, mode=[0])
        NC = cute.size(dMN, mode=[1])
        # P from sP in the accumulator's layout (ldmatrix, the inverse of A's stmatrix)
        rPb = cute.make_rmem_tensor(accdP.layout, DT)
        rPf = cute.make_rmem_tensor(accdP.layout, Float32)
        ldsm = cute.make_tiled_copy_C(cute.make_copy_atom(LdMatrix8x8x16bOp(False, 4), DT), mma_dp)
        thr_ld = ldsm.get_slice(ctid)
        tLsP = thr_ld.partition_S(sh.sP)
        tLrP = thr_ld.retile(rPb)
        pMN = acc_mn_view(rPf)
        # dS: registers (RS operand of dQ[:, :256]) and sdS (stmatrix)
        rdS = cute.make_rmem_tensor(accdP.layout, DT)
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), DT), mma_dp)
        thr_st = stsm.get_slice(ctid)
        tSsdS = thr_st.partition_D(sh.sdS)
        tSrdS = thr_st.retile(rdS)
        sKt = cute.composition(sh.sKV, cute.make_layout((self.D_QK, BN), stride=(BN, 1)))   # (d, n) = sKV[n, d]
        mma_q = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                  (1, 1, 1), tiler_mn=(M, self.DQ_B),
                                                  a_source=warpgroup.OperandSource.RMEM)
        thr_q = mma_q.get_slice(ctid)
        tQrK = mma_q.make_fragment_B(thr_q.partition_B(cute.local_tile(sKt, (self.DQ_B, BN), (0, 0))))
        tQrdS = acc_as_frg_a(rdS)
        accQ = cute.make_rmem_tensor(thr_q.partition_shape_C((M, self.DQ_B)), Float32)
        cQ = acc_mn_view(thr_q.partition_C(cute.make_identity_tensor((M, self.DQ_B))))
        mma_q.set(warpgroup.Field.ACCUMULATE, True)
        kvc = self.dkv_chunk_state(sh, ctid, self.chunk_buffers[1])
        delta = cute.make_rmem_tensor(NR, Float32)
        q4 = ctid % 4
        scale = a.softmax_scale
        dq_policy = l2_evict_first_policy()

        gt = Int32(0)
        it = Int32(0)
        for item in cutlass.range(bidx, n_items, nctas, unroll=1):
            tok, head0 = self.item_setup(a, item)
            accQ.fill(0.0)
            # delta of the thread's rows: lane q of the quad sums columns 8 (4 i + q) .. + 8, then the quad
            for r in cutlass.range_constexpr(NR):
                row = Int64(tok) * self.H + head0 + cD[r, 0][0]
                o_row = a.p_out + row * self.D_V
                do_row = a.p_dout + row * self.D_V
                acc = Float32(0.0)
                for i in cutlass.range_constexpr(self.D_V // 32):
                    for e in cutlass.range_constexpr(8):
                        col = 8 * (4 * i + q4) + e
                        acc += (o_row + col).load().to(Float32) * (do_row + col).load().to(Float32)
                acc = quad_sum(acc)
                delta[r] = acc
                if q4 == 0:
                    (a.p_delta + row).store(acc)
            cute.arch.mbarrier_wait(sh.q_mbar, it % 2)
            lo, hi, ntiles = self.window(a, tok)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                # dP = dO V^T
                wait_gathered_tile(sh.kv_ready, g, 1)
                gemm_tile(mma_dp, accdP, tDrdO, tDrV, self.D_V // 16)
                # dS = scale * P * (dP - delta)
                cute.arch.barrier(barrier_id=self.BAR_P, number_of_threads=256)
                cute.copy(ldsm, tLsP, tLrP)
                rPf.store(rPb.load().to(Float32))
                for r in cutlass.range_constexpr(NR):
                    for c in cutlass.range_constexpr(NC):
                        dMN[r, c] = pMN[r, c] * (dMN[r, c] - delta[r]) * scale
                rdS.store(accdP.load().to(DT))
                if g > 0:
                    cute.arch.barrier(barrier_id=self.BAR_A_DONE, number_of_threads=256)   # A's reads of sdS done
                cute.copy(stsm, tSrdS, tSsdS)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=self.BAR_DS, number_of_threads=256)
                # dQ[:, :256] += dS K[:, :256] (dS from registers)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(BN // 16):
                    cute.gemm(mma_q, accQ, tQrdS[None, None, kb], tQrK[None, None, kb], accQ)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(sh.kv_free)
                cute.arch.mbarrier_wait(sh.ids_mbar + (g % 2), (g // 2) % 2)
                self.dkv_chunks(a, sh, kvc, self.CHUNKS_A, self.NKB, item, lo + j * BN, hi, g, q4)
                cute.arch.barrier_arrive(barrier_id=self.BAR_B_DONE, number_of_threads=256)
            gt += ntiles
            cute.arch.mbarrier_arrive(sh.qdo_free)
            oq = acc_mn_view(accQ)
            for r in cutlass.range_constexpr(NR):
                self.store_dq_row(a, oq, r, tok, head0 + cQ[r, 0][0], 0, q4, dq_policy)
            it += 1
        if gt > 0:
            cute.arch.barrier(barrier_id=self.BAR_A_DONE, number_of_threads=256)   # A's last arrival

    # --------------------------------------------------------------------------------------------- dKV chunks
    def dkv_chunk_state(self, sh, ctid, buffers: int):
        """The dKV chunk MMA (M = the tile's rows, N = 64 columns, K = the 64 heads; both operands MN-major views),
        its P^T / dS^T fragments, the dO^T / Q^T views, `buffers` accumulators and their coordinates."""
        DT, M, BN = self.dtype, self.M, self.BN
        mma = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                                                (1, 1, 1), tiler_mn=(BN, 64))
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(ctid)
        sPt = cute.composition(sh.sP, cute.make_layout((BN, M), stride=(M, 1)))          # (n, h) = sP[h, n]
        sdSt = cute.composition(sh.sdS, cute.make_layout((BN, M), stride=(M, 1)))
        sdOt = cute.composition(sh.sdO, cute.make_layout((self.D_V, M), stride=(M, 1)))   # (d, h) = sdO[h, d]
        sQt = cute.composition(sh.sQ, cute.make_layout((self.D_QK, M), stride=(M, 1)))
        accs = [cute.make_rmem_tensor(thr.partition_shape_C((BN, 64)), Float32) for _ in range(buffers)]
        return dict(mma=mma, thr=thr, tPt=mma.make_fragment_A(thr.partition_A(sPt)),
                    tdSt=mma.make_fragment_A(thr.partition_A(sdSt)), sdOt=sdOt, sQt=sQt, accs=accs,
                    cK=acc_mn_view(thr.partition_C(cute.make_identity_tensor((BN, 64)))))

    @cute.jit
    def dkv_chunks(self, a, sh, kvc, first: int, end: int, item, slot0, slot_end, g, q4):
        """dKV chunks [first, end) of tile j of `item`. With two accumulators, chunk c + 1's wgmmas are issued
        before chunk c's atomics, so the tensor pipe works while the lanes exchange and send."""
        nb = len(kvc["accs"])
        for ch in cutlass.range_constexpr(first, end):
            self.dkv_chunk_issue(kvc, ch, kvc["accs"][(ch - first) % nb])
            if const_expr(nb == 1):
                warpgroup.wait_group(0)
                self.dkv_chunk_send(a, sh, kvc, ch, kvc["accs"][0], item, slot0, slot_end, g, q4)
            elif const_expr(ch > first):
                warpgroup.wait_group(1)
                self.dkv_chunk_send(a, sh, kvc, ch - 1, kvc["accs"][(ch - 1 - first) % nb], item, slot0, slot_end,
                                    g, q4)
        if const_expr(nb > 1):
            warpgroup.wait_group(0)
            self.dkv_chunk_send(a, sh, kvc, end - 1, kvc["accs"][(end - 1 - first) % nb], item, slot0, slot_end,
                                g, q4)

    @cute.jit
    def dkv_chunk_issue(self, kvc, ch: int, acc):
        """Issue dKV chunk `ch` (columns 64 ch ..) = P^T dO_ch (ch < NVB) + dS^T Q_ch into `acc`, one commit group."""
        mma, thr = kvc["mma"], kvc["thr"]
        tdO = mma.make_fragment_B(thr.partition_B(cute.local_tile(kvc["sdOt"], (64, self.M), (ch if ch < self.NVB
                                                                                             else 0, 0))))
        tQ = mma.make_fragment_B(thr.partition_B(cute.local_tile(kvc["sQt"], (64, self.M), (ch, 0))))
        acc.fill(0.0)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(self.M // 16):
            if const_expr(ch < self.NVB):
                cute.gemm(mma, acc, kvc["tPt"][None, None, kb], tdO[None, None, kb], acc)
            cute.gemm(mma, acc, kvc["tdSt"][None, None, kb], tQ[None, None, kb], acc)
        warpgroup.commit_group()

    @cute.jit
    def dkv_chunk_send(self, a, sh, kvc, ch: int, acc, item, slot0, slot_end, g, q4):
        """Add the retired chunk `ch` in `acc` to the rows of the tile's ids (or store it per slot when
        deterministic): the quads of two adjacent rows write 128-byte segments of one row per transaction
        (epilogue.add_row_pair_v4 / store_slot_row_pair_v4), 4 consecutive columns per lane."""
        kMN, cK = acc_mn_view(acc), kvc["cK"]
        for r in cutlass.range_constexpr(cute.size(kMN, mode=[0])):
            n_even = cK[r, 0][0] - cK[r, 0][0] % 2                  # the pair's rows: n_even, n_even + 1
            kv_even = sh.sIds[(g % 2) * self.BN + n_even]
            kv_odd = sh.sIds[(g % 2) * self.BN + n_even + 1]
            if const_expr(self.deterministic):
                store_slot_row_pair_v4(kMN, cK, r, q4 % 2 == 1, a.p_dkv, item, Int64(a.topk), slot0, n_even,
                                       slot_end, self.D_QK, ch * 64)
            else:
                add_row_pair_v4(kMN, cK, r, q4 % 2 == 1, a.p_dkv, kv_even, kv_odd, self.D_QK, ch * 64,
                                self.dkv_l2_evict_last)

    # --------------------------------------------------------------------------------------------- dQ stores
    @cute.jit
    def store_dq_row(self, a, oMN, r: int, tok, head, col0: int, q4, policy):
        """dq[tok, head, col0:][:width] = accumulator row r (bf16 / fp16) as 16-byte stores (epilogue.store_row_v4)."""
        row = a.p_dq + ((Int64(tok) * self.H + head) * self.D_QK + (col0 + 8 * q4))
        store_row_v4(row, oMN, r, None, self.fp16, q4 >= 2, q4 % 2 == 1, policy)
