"""Fused sparse indexer score recompute for Hopper (sm_90a): `IndexerScoreRecomputeSm90`, and `build(...)`, which
returns a fresh kernel and host entry of it with a spec's values bound as Python constants, plus the flat ABI
(`params`) and the launch declaration of the rendered kernel module.

An item is one query row t; the grid has min(rows, n_ctas) CTAs and CTA b runs rows b, b + grid, ... Per row, Q
(H x D) is loaded once into shared memory and the row's slots [0, kmax) go by in tiles of BN = 64 gathered rows
through a ring of STAGES buffers. Per tile, with the tile's rows K and the host's weights w' = w * sm_scale * log2 e:
    L[n]           = sum_h w'[t, h] * relu((K Q^T)[n, h])     (-inf where the slot's id is invalid)
    out[t, 64 j + n] = L[n], and the row's running max m and sum s of exp2(L - m) are updated
After the row's last tile its slots are rewritten as exp2(L - M) / S (M, S: the row's max and sum; 0 at invalid slots,
at slots past the last tile and in rows without a valid slot): softmax over the valid slots of sm_scale * I.

Warpgroups (256 threads; the launch asks for CTAS_PER_SM resident CTAs per SM, which overlap each other's MMAs,
gathers and epilogues):
  WG0  producer   per row: Q (cp.async, once the consumer's last MMA of the previous row retired: q_free, completing
                  q_full with noinc arrivals); per tile g of the CTA (stage s = g % STAGES): the ids of the tile's
                  rows (-1 where invalid or past the row's length; with prefetch_ids loaded during tile g - 1 and
                  range-checked now, tile g + 1's loads issued), and once the stage is free (kv_free[s]) the ids
                  into sIds[s] and the 64 rows into stage s (16-byte cp.async chunks, zero-filled for invalid ids).
                  kv_ready[s] completes on 128 noinc cp.async arrivals plus 16 arrivals of the group leaders after
                  their sIds stores.
  WG1  consumer   per tile: S = K Q^T on wgmma (SS: A = the gathered tile, M = 64 slots; B = Q, N = H, K = D), the
                  slots' ids from sIds[s], then the stage is freed (kv_free[s], 128 arrivals); the weighted ReLU sum
                  of each of the thread's two accumulator rows over its H / 4 columns, then over the quad (two
                  butterfly shuffles). Lane q = 0 of a quad owns the quad's first row (slot 16 warp + lane / 4), lane
                  q = 1 the second (+ 8): it writes the slot's logit and updates its running (m, s). Row end: (m, s)
                  merged over the warp (shuffles) and the 4 warps (sStat[it % 2], named barrier BAR_STAT of 128),
                  then each owner rewrites the slots it wrote (64 j + its row, same thread: no other thread's stores
                  are read) and zero-fills its slots past the last tile.
  mbarrier phases: kv_ready[s] waited with parity (g // STAGES) % 2; kv_free[s] by the producer with parity
  ((g // STAGES) % 2) ^ 1; q_full waited with parity it % 2 (it = the row's index among the CTA's rows); q_free by
  the producer with parity (it % 2) ^ 1. sStat is double-buffered by row parity: row it + 2 writes buffer it % 2
  only after BAR_STAT of row it + 1, which every consumer thread reaches after its reads of row it.

Every value of the spec is a Python constant of the instance (configuration branches are `cutlass.const_expr`).
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers
from dsagen.kernels.common.sm90.gather import (gather_ring_tile, load_row_tile, publish_tile_ids, row_gather_producer,
                                               wait_gathered_tile)
from dsagen.kernels.common.sm90.ids import row_ids_ahead, row_slots, tile_ids
from dsagen.kernels.common.sm90.layout import sw128
from dsagen.kernels.common.sm90.mma import gemm_tile, wgmma_tile
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.ring import ring_mbarriers
from dsagen.kernels.common.sm90.softmax import merge_softmax_stats

NEG_INF = -math.inf


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D), row stride ld_q
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},            # (n_k, D), row stride ld_k
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (rows, topk), row stride ld_idx
        {"name": "topk_length", "kind": "ptr", "dtype": "int32", "align": 4},  # (rows,), read when has_length
        {"name": "w", "kind": "ptr", "dtype": "float32", "align": 4},         # (rows, H) contiguous, x sm_scale log2 e
        {"name": "out", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows, topk) contiguous
        {"name": "rows", "kind": "i32"},
        {"name": "n_k", "kind": "i32"},
        {"name": "topk", "kind": "i32"},
        {"name": "ld_q", "kind": "i64"},
        {"name": "ld_k", "kind": "i64"},
        {"name": "ld_idx", "kind": "i64"},
        {"name": "has_length", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def build(num_heads: int, head_dim: int, dtype: str, stages: int, ctas_per_sm: int,
          prefetch_ids: bool = False) -> BuiltKernel:
    """A new indexer score recompute kernel for one IndexerScoreRecomputeSpec's values. Each call returns distinct
    function objects, so every rendered module names its own kernel."""
    k = IndexerScoreRecomputeSm90(num_heads, head_dim, dtype, stages, ctas_per_sm, prefetch_ids)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class KernelArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas)."""
    p_q: Any
    p_k: Any
    p_idx: Any
    p_len: Any
    p_w: Any
    p_out: Any
    rows: Any
    n_k: Any
    topk: Any
    ld_q: Any
    ld_k: Any
    ld_idx: Any
    has_length: Any


class Shared(NamedTuple):
    """The CTA's shared tiles and barriers (IndexerScoreRecomputeSm90 docstring)."""
    sQ: Any
    sK: Any          # (BN rows, D, STAGES)
    sIds: Any        # [stage][row]: the tile's ids, -1 where invalid
    sStat: Any       # [warp (4)][m, s][row parity]: the warps' row statistics
    kv_ready: Any
    kv_free: Any
    q_full: Any
    q_free: Any


class IndexerScoreRecomputeSm90:
    """The kernel of one IndexerScoreRecomputeSpec: `kernel` (the @cute.kernel, flat ABI in `params`) and `host` (the
    @cute.jit launch: grid min(rows, n_ctas), 256 threads, `Smem` dynamic smem, min_blocks_per_mp = ctas_per_sm).

    Constraints (IndexerScoreRecomputeSpec.reasons): num_heads 64 or 128, head_dim 64 or 128, dtype "bfloat16" or
    "float16", 2 <= stages <= 8. Ids must be -1 or in [0, n_k) after the host's batch offset; any other value is
    treated as invalid (never read). Every slot of `out` in [0, topk) of every row is written.
    """

    BN = 64                          # gathered rows (slots) per tile: wgmma M
    THREADS = 256
    BAR_STAT = 1                     # the consumer's 4 warps have written their row statistics (128 threads)

    def __init__(self, num_heads: int, head_dim: int, dtype: str, stages: int, ctas_per_sm: int,
                 prefetch_ids: bool = False):
        self.PREFETCH_IDS = prefetch_ids
        self.H = num_heads
        self.D = head_dim
        self.NKB = head_dim // 64
        self.STAGES = stages
        self.CTAS_PER_SM = ctas_per_sm
        self.fp16 = dtype == "float16"
        self.dtype = cutlass.Float16 if self.fp16 else cutlass.BFloat16
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
            stat: cute.struct.MemRange[Float32, 4 * 2 * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[DT, H * D], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[DT, BN * D * STAGES], 1024]

        return Smem

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                   p_w: cute.Pointer, p_out: cute.Pointer, rows: Int32, n_k: Int32, topk: Int32, ld_q: Int64,
                   ld_k: Int64, ld_idx: Int64, has_length: Int32, n_ctas: Int32):
            k.body(KernelArgs(p_q, p_k, p_idx, p_len, p_w, p_out, rows, n_k, topk, ld_q, ld_k, ld_idx, has_length))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                 p_w: cute.Pointer, p_out: cute.Pointer, rows: Int32, n_k: Int32, topk: Int32, ld_q: Int64,
                 ld_k: Int64, ld_idx: Int64, has_length: Int32, n_ctas: Int32):
            kernel(p_q, p_k, p_idx, p_len, p_w, p_out, rows, n_k, topk, ld_q, ld_k, ld_idx, has_length,
                   n_ctas).launch(grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1),
                                  smem=k.Smem.size_in_bytes(), min_blocks_per_mp=k.CTAS_PER_SM,
                                  preferred_smem_carveout=100)

        return kernel, host

    @cute.jit
    def body(self, a: KernelArgs):
        """Shared views and barriers, then the roles: WG0 producer, WG1 consumer."""
        DT, H, BN, D, STAGES = self.dtype, self.H, self.BN, self.D, self.STAGES
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (H, D))
        lay_k = sw128(DT, (BN, D, STAGES))
        sh = Shared(sQ=st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner),
                    sK=st.sK.get_tensor(lay_k.outer, swizzle=lay_k.inner),
                    sIds=st.ids.get_tensor(cute.make_layout(STAGES * BN)),
                    sStat=st.stat.get_tensor(cute.make_layout((4, 2, 2), stride=(1, 4, 8))),
                    kv_ready=st.kv_ready.data_ptr(), kv_free=st.kv_free.data_ptr(), q_full=st.q_full.data_ptr(),
                    q_free=st.q_free.data_ptr())
        # kv_ready: 128 noinc cp.async arrivals + 16 group leaders after their sIds stores
        init_mbarriers(c.warp, ring_mbarriers(sh.kv_ready, sh.kv_free, STAGES, 128 + 16, 128)
                       + [(sh.q_full, 128), (sh.q_free, 128)])
        if c.wg == 0:
            self.producer(a, sh, st, lay_q, lay_k, c.tidx, c.bidx, c.nctas)
        else:
            self.consumer(a, sh, c.tidx, c.bidx, c.nctas)

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_k, tidx, bidx, nctas):
        """Per row: Q (load_row_tile), then per tile its ids (prefetched one tile ahead with prefetch_ids) and the
        gathered key rows into the ring; the ids go to sIds for the consumer's logit owners (publish_tile_ids)."""
        p = row_gather_producer(tidx, st.sQ, st.sK, lay_k, self.BN)
        lanes, ids = p.lanes, p.ids
        raw = cute.make_rmem_tensor(self.BN // 16, Int32)   # prefetch_ids: the next tile's ids, loaded early
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * a.ld_q, self.H, self.D, lanes, p.policy, it,
                          sh.q_free, sh.q_full)
            mIdx = cute.make_tensor(a.p_idx + Int64(tok) * a.ld_idx, cute.make_layout(a.topk))
            row_ids_ahead(raw, mIdx, ntiles, kmax, lanes.grp, self.PREFETCH_IDS)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % self.STAGES
                tile_ids(ids, raw, mIdx, j, ntiles, kmax, a.n_k, lanes.grp, self.BN, self.PREFETCH_IDS)
                gather_ring_tile(p.kv_smem, p.sw_kv, lay_k, a.p_k, a.ld_k, ids, lanes.col0, (0, self.NKB), g,
                                 self.STAGES, sh.kv_ready, sh.kv_free)
                publish_tile_ids(sh.sIds, s * self.BN, ids, lanes, sh.kv_ready + s)
            gt += ntiles
            it += 1

    # ------------------------------------------------------------------------------------------- consumer (WG1)
    @cute.jit
    def consumer(self, a, sh, tidx, bidx, nctas):
        """S = K Q^T per tile, the slots' weighted ReLU head sums and the row's online max and sum; then the row's
        normalisation pass over the slots this thread wrote."""
        DT, BN, H, D = self.dtype, self.BN, self.H, self.D
        ctid = tidx - 128
        warp = ctid // 32
        lane = ctid % 32
        quad = lane % 4
        S = wgmma_tile(DT, sh.sK, sh.sQ, (BN, H), ctid)          # tA (.., .., k, stage), tB (.., .., k)
        mma, tSrK, tSrQ, acc, aMN, cMN = S.mma, S.tA, S.tB, S.acc, S.acc_mn, S.coord_mn
        NCOL = cute.size(aMN, mode=[1])
        wreg = cute.make_rmem_tensor(NCOL, Float32)
        row0 = warp * 16 + lane // 4               # the thread's accumulator rows: row0 and row0 + 8
        own = quad < 2                             # lane 0 of the quad owns row0, lane 1 row0 + 8
        pos = row0 + 8 * (quad % 2)                # the owned slot position in every tile (lanes 2, 3: a copy)
        ntile_all = (a.topk + BN - 1) // BN

        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)
            for c in cutlass.range_constexpr(NCOL):
                wreg[c] = (a.p_w + (Int64(tok) * H + cMN[0, c][1])).load()
            m_run = Float32(NEG_INF)
            s_run = Float32(0.0)
            out_row = a.p_out + Int64(tok) * a.topk
            cute.arch.mbarrier_wait(sh.q_full, it % 2)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % self.STAGES
                wait_gathered_tile(sh.kv_ready, g, self.STAGES)
                gemm_tile(mma, acc, tSrK, tSrQ, D // 16, a_stage=s)
                id_own = sh.sIds[s * BN + pos]
                cute.arch.mbarrier_arrive(sh.kv_free + s)
                lsum = [Float32(0.0), Float32(0.0)]
                for r in cutlass.range_constexpr(2):
                    part = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                    for c in cutlass.range_constexpr(NCOL):
                        part[c % 4] = part[c % 4] + wreg[c] * cute.arch.fmax(aMN[r, c], Float32(0.0))
                    lsum[r] = quad_sum((part[0] + part[1]) + (part[2] + part[3]))
                if own:
                    logit = lsum[0] if quad == 0 else lsum[1]
                    if id_own < 0:
                        logit = Float32(NEG_INF)
                    else:
                        m_new = cute.arch.fmax(m_run, logit)
                        s_run = s_run * cute.math.exp2(m_run - m_new, fastmath=True) + \
                            cute.math.exp2(logit - m_new, fastmath=True)
                        m_run = m_new
                    slot = j * BN + pos
                    if slot < a.topk:
                        (out_row + slot).store(logit)
            cute.arch.mbarrier_arrive(sh.q_free)
            # the row's max and sum: over the warp, then over the 4 warps
            for sh_off in cutlass.range_constexpr(5):
                m_o = cute.arch.shuffle_sync_bfly(m_run, offset=1 << sh_off)
                s_o = cute.arch.shuffle_sync_bfly(s_run, offset=1 << sh_off)
                m_run, s_run = merge_softmax_stats(m_run, s_run, m_o, s_o)
            if lane == 0:
                sh.sStat[warp, 0, it % 2] = m_run
                sh.sStat[warp, 1, it % 2] = s_run
            cute.arch.barrier(barrier_id=self.BAR_STAT, number_of_threads=128)
            m_row = sh.sStat[0, 0, it % 2]
            s_row = sh.sStat[0, 1, it % 2]
            for w in cutlass.range_constexpr(1, 4):
                m_row, s_row = merge_softmax_stats(m_row, s_row, sh.sStat[w, 0, it % 2], sh.sStat[w, 1, it % 2])
            inv = Float32(0.0)
            if s_row > Float32(0.0):
                inv = cute.arch.rcp_approx(s_row)
            m_sub = m_row if s_row > Float32(0.0) else Float32(0.0)
            if own:
                for j in cutlass.range(ntile_all, unroll=1):
                    slot = j * BN + pos
                    if slot < a.topk:
                        p = Float32(0.0)
                        if j < ntiles:
                            p = cute.math.exp2((out_row + slot).load() - m_sub, fastmath=True) * inv
                        (out_row + slot).store(p)
            gt += ntiles
            it += 1
