"""Fused sparse MLA forward for Hopper (sm_90a), FlashMLA's SM90 sparse prefill protocol: `SparseMlaFwdSm90`, and
`build(...)`, which returns a fresh kernel and host entry of it with a spec's values bound as Python constants, plus
the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.

An item is (query row, 64 heads); the grid has min(items, n_ctas) CTAs and CTA b runs items b, b + grid, ...
(n_ctas large: one CTA per item). Every head of an item scores the same gathered KV rows (MQA); online softmax in
the log2 domain; the per-head sink enters the denominator only.

Warpgroups (384 threads); tiles go in pairs k: tile 2k -> stage 0 (consumer A), tile 2k+1 -> stage 1 (consumer B).
A stage has a left half L (column blocks 0..3 = V[:, :256]) and a right half R (blocks 4.. = V[:, 256:] + RoPE).
  WG0  producer   per item: its Q, once both consumers retired the previous item's last QK^T (q_free); per pair:
                  ids of both tiles, then fills V0L, V1R, V0R, V1L in this order, each after its free
                  barrier (cp.async 16-byte chunks, zero-filled when the id is invalid; odd tile counts get an
                  all-masked partner tile); then the pair's validity bytes (valid[tile][row]) for the consumers'
                  masking, signalled on mask_mbar (FlashMLA's is_kv_valid: no id loads in the consumers).
  WG1  consumer A S0 = Q K0^T (L then R); softmax with ITS OWN running max m0 (no wait); m0 -> smem; O_L += P0 V0L
                  (RS) at once; frees V0L; waits for the pair max m from B; rescales P0, O_L and its row sum by
                  exp2(m0 - m); P0 -> stage 0's P tile; O_L += P1 V1L (SS); issues the next pair's S0 (L half)
                  before freeing V1L.
  WG2  consumer B S1 = Q K1^T (R then L); waits for m0; m = max(m0, tile max); softmax; m -> smem; O_R += P1 V1R
                  (RS); P1 -> its own P tile; frees V1R once P1 V1R retired; waits for P0; O_R += P0 V0R (SS);
                  frees V0R.
  Synchronisation (named barriers count 256 = WG1 + WG2, each arrived by one consumer and synced by the other,
  once per pair; id 0 is the CTA barrier):
    bar 1 BAR_MAX_A  m0 in sMax[:, 0] (A arrives, B syncs);   bar 2 BAR_MAX_B  m in sMax[:, 1] (B arrives, A syncs);
    bar 3 BAR_P_A    P0 in smem (A arrives, B syncs);         bar 4 BAR_P_B    P1 in smem (B arrives, A syncs);
    bar 5 BAR_EPI_A  A's row sums in sSum (A arrives, B syncs); bar 6 BAR_EPI_B  B's row sums (B arrives, A syncs);
    the row sums go to the item parity's half of sSum (a consumer may run ahead into an item without pairs).
    mbarriers (g = the pair's index over the CTA's items, it = the item's index among the CTA's items):
    ready[s][h] (128 producer noinc arrivals) waited with parity g % 2; free[s][h] (128 arrivals of the one
    consumer that reads the half last: V0L, V1L by A; V0R, V1R by B), waited by the producer with parity
    (g % 2) ^ 1; mask_mbar (16 arrivals: one producer thread per group of 8) waited with parity g % 2; q_mbar (128
    noinc arrivals) waited with parity it % 2; q_free (256: every consumer thread once per item, after its last
    QK^T of the item retired) waited by the producer with parity (it % 2) ^ 1.
V is the transposed view of the first d_v columns of the same gathered tile. At D_QK 576, P0 lives in stage 0's
RoPE tile (freed with V0R, after B's P0 V0R) and P1 in a separate tile; at 512 both have their own tile.

Every value of the spec is a Python constant of the instance, so each configuration branch is resolved while
tracing (`cutlass.const_expr`); the building blocks below are `@cute.jit` methods, inlined where they are called.
The tracer carries only plain locals across staged loops and branches: the values a role shares with its building
blocks travel in immutable NamedTuples (KernelArgs, Barriers, ConsumerState), and the QK^T MMA, whose ACCUMULATE
field changes inside loops, is a local that every call returning it rebinds. Each instance makes its own kernel and
host functions (`kernel`, `host`), so two configurations never share a function object (the symbol name is set
per function).
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int8, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp
from cutlass.experimental import primitives as prims

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.cta import cta_coords, init_mbarriers, row_head_block
from dsagen.kernels.common.sm90.epilogue import store_row_f32_v4, store_row_v4
from dsagen.kernels.common.sm90.gather import cp_async_rows, gather_base, gather_lanes, gather_tile_rows, smem_bytes
from dsagen.kernels.common.sm90.ids import row_slots
from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view, sw128
from dsagen.kernels.common.sm90.ptx import (e4m3x2_scaled_bf16x2, l2_evict_first_policy, ld_shared_b64, ld_shared_f32,
                                            mapa_shared, st_async_v4_b32, st_shared_v4_b32)
from dsagen.kernels.common.sm90.reduce import quad_sum
from dsagen.kernels.common.sm90.softmax import exp_and_rescale, masked_row_max

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
KV_NOPE = 512               # FP8 cache rows (reference.kv_cache): 512 E4M3 bytes, 4 FP32 scales, 64 bf16 RoPE values
KV_TILE = 128               # NoPE values per scale
KV_ROPE_BYTE = KV_NOPE + 4 * (KV_NOPE // KV_TILE)   # 528: the RoPE values' first byte
KV_FP8_ROW_BYTES = KV_ROPE_BYTE + 2 * 64            # 656


def params(dtype: str, lse_prefix: bool = False, kv_fp8: bool = False, split_kv: bool = False) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"; lse_prefix: the
    kernel also writes the KV-only LSE over each row's first n_prefix slots (two more parameters at the end); kv_fp8:
    kv is the FP8 cache's bytes (uint8 rows of KV_FP8_ROW_BYTES, row stride ld_kv in bytes); split_kv: each row's
    slots in n_splits ranges of split_slots, out / lse the FP32 partials of (row, split) rows (two more parameters
    at the end; max_logits is not written)."""
    prefix = [{"name": "lse_prefix", "kind": "ptr", "dtype": "float32", "align": 4},   # (s_q, H)
              {"name": "n_prefix", "kind": "i32"}] if lse_prefix else []              # a multiple of 128
    if split_kv:
        prefix = [{"name": "n_splits", "kind": "i32"},        # ranges per row (partial row = row * n_splits + j)
                  {"name": "split_slots", "kind": "i32"}]     # slots per range, a multiple of 2 * block_n
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (s_q, H, D_QK), row stride ld_q
        {"name": "kv", "kind": "ptr", "dtype": "uint8" if kv_fp8 else dtype, "align": 16},   # (n_kv, D_QK), ld_kv
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (s_q, topk), row stride ld_idx
        {"name": "topk_length", "kind": "ptr", "dtype": "int32", "align": 4},  # (s_q,), read when has_length
        {"name": "sink", "kind": "ptr", "dtype": "float32", "align": 4},      # (H,), read when has_sink
        {"name": "out", "kind": "ptr", "dtype": "float32" if split_kv else dtype, "align": 16},   # (s_q, H, D_V)
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (s_q, H)
        {"name": "max_logits", "kind": "ptr", "dtype": "float32", "align": 4},  # (s_q, H)
        {"name": "s_q", "kind": "i32"},
        {"name": "n_kv", "kind": "i32"},
        {"name": "topk", "kind": "i32"},
        {"name": "ld_q", "kind": "i64"},
        {"name": "ld_kv", "kind": "i64"},
        {"name": "ld_idx", "kind": "i64"},
        {"name": "softmax_scale", "kind": "f32"},
        {"name": "has_length", "kind": "i32"},
        {"name": "has_sink", "kind": "i32"},
        {"name": "n_ctas", "kind": "i32"},                  # the most CTAs to launch (each loops over items)
    ] + prefix


def build(num_heads: int, d_qk: int, d_v: int, dtype: str, block_n: int, stages: int, regs_producer: int,
          regs_qk: int, regs_pv: int, lse_prefix: bool = False, kv_fp8: bool = False,
          split_kv: bool = False, shared_dequant: bool = False) -> BuiltKernel:
    """A new sparse MLA forward for one SparseAttnFwdSpec's values (SparseMlaFwdSm90 lists the constraints). Each
    call returns distinct function objects, so every rendered module names its own kernel."""
    fwd = SparseMlaFwdSm90(num_heads, d_qk, d_v, dtype, block_n, stages, regs_producer, regs_qk, regs_pv, lse_prefix,
                           kv_fp8, split_kv, shared_dequant)
    items = f"s_q * {fwd.HB} * n_splits" if split_kv else f"s_q * {fwd.HB}"
    return BuiltKernel.of(params(dtype, lse_prefix, kv_fp8, split_kv), fwd, f"min({items}, n_ctas)", fwd.CLUSTER)


class KernelArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas), read by every role."""
    p_q: Any
    p_kv: Any
    p_idx: Any
    p_len: Any
    p_sink: Any
    p_out: Any
    p_lse: Any
    p_maxl: Any
    s_q: Any
    n_kv: Any
    topk: Any
    ld_q: Any
    ld_kv: Any
    ld_idx: Any
    softmax_scale: Any
    has_length: Any
    has_sink: Any
    p_lsep: Any = None      # lse_prefix kernels: the prefix LSE output and the prefix length
    n_prefix: Any = None
    n_splits: Any = None    # split_kv kernels: ranges per row and slots per range
    split_slots: Any = None


class Barriers(NamedTuple):
    """The CTA's mbarriers and the validity bytes (SparseMlaFwdSm90 docstring: who arrives, who waits)."""
    hbar: Any        # ready[s][h] = hbar + 2 s + h, free[s][h] = hbar + 4 + 2 s + h
    q_mbar: Any
    q_free: Any
    mask_mbar: Any
    sValid: Any      # [tile of the pair][row]: 1 = a valid id
    peer: Any = None        # shared_dequant kernels: the partner CTA's rank in the cluster, and the offset from a
    peer_delta: Any = None  # shared::cta address here to the same place's shared::cluster address in the partner


class ConsumerState(NamedTuple):
    """A consumer warpgroup's MMAs, fragments, views and per-thread rows, made once before its item loop (the
    QK^T MMA is not here: its ACCUMULATE field changes, so it is a local the loops carry)."""
    ctid: Any
    mma_rs: Any
    mma_ss: Any
    tSrQ: Any
    tSrK: Any
    tOrV: Any
    tCrV: Any
    tCrP: Any
    accS: Any
    accO: Any
    rP: Any
    tOrP: Any
    stsm: Any
    tPsP_st: Any
    tPrP_st: Any
    sMN: Any
    oMN: Any
    cS: Any
    cO: Any
    row_max: Any
    row_sum: Any
    fac: Any
    m_loc: Any
    keep: Any
    sink_l2: Any
    scale_log2: Any
    sMax: Any
    sSum: Any
    q4: Any
    q_hi: Any
    q_odd: Any
    o_policy: Any
    snap_max: Any = None    # lse_prefix kernels: the running max and row sum after the item's prefix pairs,
    snap_sum: Any = None    # and B's prefix row sums [head row, item parity] for A
    sSnap: Any = None


class SparseMlaFwdSm90:
    """The kernel of one SparseAttnFwdSpec: `kernel` (the @cute.kernel, flat ABI below) and `host` (the @cute.jit
    launch: grid min(s_q * HB, n_ctas), 384 threads, `Smem` dynamic smem, min_blocks_per_mp=1).

    Arguments (pointers 16-byte aligned where vectors touch them): q (s_q, H, D_QK) with row stride ld_q, kv
    (n_kv, D_QK) with row stride ld_kv, idx (s_q, topk) int32 with row stride ld_idx, topk_length (s_q,) int32 (read
    when has_length), sink (H,) fp32 (read when has_sink), out (s_q, H, D_V) contiguous, lse and max_logits (s_q, H)
    fp32; s_q, n_kv, topk, ld_q, ld_kv, ld_idx, softmax_scale, has_length, has_sink, n_ctas.

    Constraints (SparseAttnFwdSpec.reasons): num_heads 64 or 128, d_qk 512 or 576, d_v 512, dtype "bfloat16" or
    "float16", block_n 64, stages 2, register budgets multiples of 8 summing to at most 504. kv_fp8: kv is the FP8
    cache's bytes (rows of KV_FP8_ROW_BYTES, ld_kv in bytes; d_qk 576, bfloat16), dequantized by the producer into
    the same stages (dequant_half); everything else is the BF16 kernel's.
    """

    M = 64                          # heads per CTA = wgmma M
    THREADS = 384
    HALF_KB = 4                     # column blocks of a stage's left half (V[:, :256]); the right half has the rest
    MAX_INIT = -1.0e30              # initial running max: finite, so no -inf - -inf; masked scores are -inf
    # named barriers of WG1 (consumer A) + WG2 (consumer B), 256 threads each
    BAR_MAX_A = 1                   # A's running max m0 in sMax[:, 0]
    BAR_MAX_B = 2                   # the pair max m in sMax[:, 1]
    BAR_P_A = 3                     # P0 (rescaled to m) in its smem tile
    BAR_P_B = 4                     # P1 in its smem tile
    BAR_EPI_A = 5                   # A's row sums in sSum (A arrives, B syncs)
    BAR_EPI_B = 6                   # B's row sums in sSum (B arrives, A syncs)
    FILL_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))   # (stage, half) the producer fills per pair: V0L, V1R, V0R, V1L

    def __init__(self, num_heads: int, d_qk: int, d_v: int, dtype: str, block_n: int, stages: int,
                 regs_producer: int, regs_qk: int, regs_pv: int, lse_prefix: bool = False, kv_fp8: bool = False,
                 split_kv: bool = False, shared_dequant: bool = False):
        self.LSE_PREFIX = lse_prefix            # also write the LSE over each row's first n_prefix slots
        self.KV_FP8 = kv_fp8                    # kv rows are the FP8 cache's (dequantized by the producer)
        self.SPLIT_KV = split_kv                # items per (row, head block, slot range); FP32 partial outputs
        self.SHARED_DEQUANT = shared_dequant    # a cluster of two CTAs (a row's head blocks) shares the dequantization
        self.CLUSTER = 2 if shared_dequant else 1
        self.PEER_HALF_BYTES = 32 * 4 * 128     # the partner's 32 rows x 4 NoPE blocks of a half-stage, bf16
        self.launch_kw = {"min_blocks_per_mp": 1}
        if shared_dequant:
            self.launch_kw["cluster"] = (2, 1, 1)
        self.H = num_heads                      # heads of the op; one item per 64
        self.HB = num_heads // self.M
        self.D_QK = d_qk
        self.D_V = d_v
        self.DV_HALF = d_v // 2                 # O columns per consumer warpgroup
        self.BN = block_n                       # gathered rows per stage
        self.STAGES = stages
        self.NKB = d_qk // 64                   # 64-column (128-byte) blocks per row
        self.P_IN_ROPE = d_qk > d_v             # P0 aliases stage 0's RoPE tile
        self.KS_HALF = self.HALF_KB * 4         # k16 steps of QK^T in the left half (36 / 32 in all at 576 / 512)
        self.KS = d_qk // 16
        self.fp16 = dtype == "float16"
        self.dtype = cutlass.Float16 if self.fp16 else cutlass.BFloat16
        self.regs = (regs_producer, regs_qk, regs_pv)
        self.Smem = self._smem_struct()
        self.kernel, self.host = self._entry_points()

    def _smem_struct(self):
        """The shared-memory struct (racecheck's explained window assumes the first six fields' sizes)."""
        DT, M, BN, D_QK, STAGES = self.dtype, self.M, self.BN, self.D_QK, self.STAGES
        p_elems = M * BN if self.P_IN_ROPE else 2 * M * BN
        lse_prefix = self.LSE_PREFIX

        @cute.struct
        class Smem:
            half_mbar: cute.struct.MemRange[Int64, 8]           # ready[s][h] at 2 s + h, free[s][h] at 4 + 2 s + h
            q_mbar: cute.struct.MemRange[Int64, 1]
            q_free_mbar: cute.struct.MemRange[Int64, 1]        # both consumers' QK^T of the current item retired
            mask_mbar: cute.struct.MemRange[Int64, 1]          # the pair's validity bytes are in `valid` (16 arrivals)
            valid: cute.struct.MemRange[Int8, 2 * BN]           # [tile of the pair][row]: 1 = a valid id
            mx: cute.struct.MemRange[Float32, 2 * M]            # [:, 0] A's running max m0, [:, 1] the pair max
            sm: cute.struct.MemRange[Float32, 4 * M]            # per-consumer row sums [head row, consumer, parity]
            sQ: cute.struct.Align[cute.struct.MemRange[DT, M * D_QK], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[DT, STAGES * BN * D_QK], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[DT, p_elems], 1024]   # P1 (and P0 unless in the RoPE tile)
            if lse_prefix:
                snap: cute.struct.MemRange[Float32, 2 * M]      # B's prefix row sums [head row, item parity]

        return Smem

    def _entry_points(self):
        """A new @cute.kernel and @cute.jit host of this instance."""
        fwd = self

        if const_expr(self.SPLIT_KV):
            @cute.kernel
            def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                       p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                       s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                       softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32,
                       n_splits: Int32, split_slots: Int32):
                fwd.body(KernelArgs(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q,
                                    ld_kv, ld_idx, softmax_scale, has_length, has_sink, n_splits=n_splits,
                                    split_slots=split_slots))

            @cute.jit
            def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                     p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                     s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                     softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32,
                     n_splits: Int32, split_slots: Int32):
                kernel(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q, ld_kv, ld_idx,
                       softmax_scale, has_length, has_sink, n_ctas, n_splits, split_slots).launch(
                    grid=(cutlass.min(s_q * fwd.HB * n_splits, n_ctas), 1, 1), block=(fwd.THREADS, 1, 1),
                    smem=fwd.Smem.size_in_bytes(), **fwd.launch_kw)
        elif const_expr(not self.LSE_PREFIX):
            @cute.kernel
            def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                       p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                       s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                       softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32):
                fwd.body(KernelArgs(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q,
                                    ld_kv, ld_idx, softmax_scale, has_length, has_sink))

            @cute.jit
            def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                     p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                     s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                     softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32):
                kernel(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q, ld_kv, ld_idx,
                       softmax_scale, has_length, has_sink, n_ctas).launch(
                    grid=(cutlass.min(s_q * fwd.HB, n_ctas), 1, 1), block=(fwd.THREADS, 1, 1),
                    smem=fwd.Smem.size_in_bytes(), **fwd.launch_kw)
        else:
            @cute.kernel
            def kernel(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                       p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                       s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                       softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32,
                       p_lsep: cute.Pointer, n_prefix: Int32):
                fwd.body(KernelArgs(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q,
                                    ld_kv, ld_idx, softmax_scale, has_length, has_sink, p_lsep, n_prefix))

            @cute.jit
            def host(p_q: cute.Pointer, p_kv: cute.Pointer, p_idx: cute.Pointer, p_len: cute.Pointer,
                     p_sink: cute.Pointer, p_out: cute.Pointer, p_lse: cute.Pointer, p_maxl: cute.Pointer,
                     s_q: Int32, n_kv: Int32, topk: Int32, ld_q: Int64, ld_kv: Int64, ld_idx: Int64,
                     softmax_scale: Float32, has_length: Int32, has_sink: Int32, n_ctas: Int32,
                     p_lsep: cute.Pointer, n_prefix: Int32):
                kernel(p_q, p_kv, p_idx, p_len, p_sink, p_out, p_lse, p_maxl, s_q, n_kv, topk, ld_q, ld_kv, ld_idx,
                       softmax_scale, has_length, has_sink, n_ctas, p_lsep, n_prefix).launch(
                    grid=(cutlass.min(s_q * fwd.HB, n_ctas), 1, 1), block=(fwd.THREADS, 1, 1),
                    smem=fwd.Smem.size_in_bytes(), **fwd.launch_kw)

        return kernel, host

    def half_blocks(self, h: int) -> tuple[int, int]:
        """The 64-column blocks [first, end) of a stage's half h (0: left = V[:, :256], 1: right = the rest)."""
        return (0, self.HALF_KB) if h == 0 else (self.HALF_KB, self.NKB)

    def half_k16_steps(self, h: int) -> tuple[int, int]:
        """The k16 steps [first, end) of QK^T over half h."""
        return (0, self.KS_HALF) if h == 0 else (self.KS_HALF, self.KS)

    def rows(self, f) -> int:
        """The accumulator rows a consumer thread owns (NR)."""
        return cute.size(f.sMN, mode=[0])

    def cols(self, f) -> int:
        """The S accumulator columns a consumer thread owns (NC)."""
        return cute.size(f.sMN, mode=[1])

    # ------------------------------------------------------------------------------------------------ the CTA
    @cute.jit
    def body(self, a: KernelArgs):
        """Shared views and barriers, then the roles: WG0 producer, WG1 consumer A, WG2 consumer B. The CTA loops
        over items bidx, bidx + nctas, ...; the producer runs ahead into the next item while the consumers finish
        the current one."""
        DT, M, BN, D_QK, STAGES = self.dtype, self.M, self.BN, self.D_QK, self.STAGES
        c = cta_coords()
        st = cutlass.memory.SmemAllocator().allocate(self.Smem)
        lay_q = sw128(DT, (M, D_QK))
        lay_kv = sw128(DT, (BN, D_QK, STAGES))
        sQ = st.sQ.get_tensor(lay_q.outer, swizzle=lay_q.inner)
        sKV = st.sKV.get_tensor(lay_kv.outer, swizzle=lay_kv.inner)          # (BN rows, D_QK, STAGES)
        if const_expr(self.P_IN_ROPE):
            sP0 = cute.local_tile(sKV, (BN, 64, STAGES), (0, self.NKB - 1, 0))[None, None, 0]   # stage 0's RoPE tile
            lay_p = sw128(DT, (M, BN))
            sP1 = st.sP.get_tensor(lay_p.outer, swizzle=lay_p.inner)
        else:
            lay_p = sw128(DT, (M, BN, 2))
            sPt = st.sP.get_tensor(lay_p.outer, swizzle=lay_p.inner)
            sP0, sP1 = sPt[None, None, 0], sPt[None, None, 1]
        # V^T of every stage: (D_V, BN, STAGES), element (d, n, s) = sKV[n, d, s]
        sVt = cute.composition(sKV, cute.make_layout((self.D_V, BN, STAGES), stride=(BN, 1, BN * D_QK)))

        n_items = a.s_q * self.HB
        if const_expr(self.SPLIT_KV):
            n_items = n_items * a.n_splits
        hbar = st.half_mbar.data_ptr()      # ready[s][h] = hbar + 2 s + h, free[s][h] = hbar + 4 + 2 s + h
        q_mbar = st.q_mbar.data_ptr()
        q_free = st.q_free_mbar.data_ptr()
        mask_mbar = st.mask_mbar.data_ptr()
        sValid = st.valid.get_tensor(cute.make_layout(2 * BN))
        # ready: the producer's 128 arrivals (noinc for cp.async; shared_dequant: plus the partner's st.async bytes);
        # free: one consumer warpgroup (shared_dequant: also the partner's, 32 per warp from its lane 0)
        free_count = 256 if const_expr(self.SHARED_DEQUANT) else 128
        init_mbarriers(c.warp, [(q_mbar, 128),
                                (q_free, 256),          # every consumer thread, once per item
                                (mask_mbar, 16)]        # one arrival per producer group of 8 threads
                       + [(hbar + i, 128) for i in range(4)] + [(hbar + 4 + i, free_count) for i in range(4)],
                       cluster=self.SHARED_DEQUANT)
        bars = Barriers(hbar=hbar, q_mbar=q_mbar, q_free=q_free, mask_mbar=mask_mbar, sValid=sValid)
        if const_expr(self.SHARED_DEQUANT):
            peer = Int32(1) - c.bidx % 2                    # clusters of two along x: rank = block index % 2
            here = hbar.toint()
            bars = Barriers(hbar=hbar, q_mbar=q_mbar, q_free=q_free, mask_mbar=mask_mbar, sValid=sValid, peer=peer,
                            peer_delta=mapa_shared(here, peer) - here)

        if c.wg == 0:
            self.producer(a, bars, st, lay_q, lay_kv, c.tidx, c.bidx, n_items, c.nctas)
        elif c.wg == 1:
            self.consumer(0, a, bars, st, sQ, sKV, sVt, sP0, sP1, c.tidx, c.bidx, n_items, c.nctas)
        else:
            self.consumer(1, a, bars, st, sQ, sKV, sVt, sP1, sP0, c.tidx, c.bidx, n_items, c.nctas)
        if const_expr(self.SHARED_DEQUANT):
            # no CTA leaves while its partner may still store into its stages or arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def item_setup(self, a: KernelArgs, item: Int32):
        """An item = (query row, 64 heads): (tok, head0, kmax, npairs, slot0, orow): its valid slots slot0 + [0,
        kmax), its pairs of BN-slot tiles (an odd tail gets an all-masked partner: zero-filled rows, P = 0) and the
        row of the outputs it writes. split_kv kernels: item = (query row, 64 heads, range j) with j fastest
        (shared_dequant: the head block fastest, then j), the range's slots j split_slots + [0, split_slots) of the
        row's valid ones, output row tok n_splits + j; else slot0 = 0 and orow = tok."""
        base = item
        slot0 = Int32(0)
        j = Int32(0)
        if const_expr(self.SPLIT_KV):
            if const_expr(self.SHARED_DEQUANT):           # (row, range, head block): the cluster's CTAs pair up
                rest = item // self.HB
                j = rest % a.n_splits
                base = (rest // a.n_splits) * self.HB + (item - rest * self.HB)
            else:
                base = item // a.n_splits
                j = item - base * a.n_splits
            slot0 = j * a.split_slots
        tok, head0 = row_head_block(base, self.HB, self.M)
        kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)
        orow = tok
        if const_expr(self.SPLIT_KV):
            kmax = cutlass.min(cutlass.max(kmax - slot0, Int32(0)), a.split_slots)
            ntiles = (kmax + self.BN - 1) // self.BN
            orow = tok * a.n_splits + j
        npairs = (ntiles + 1) // 2                         # tiles go in pairs (2k -> stage 0, 2k+1 -> stage 1)
        return tok, head0, kmax, npairs, slot0, orow

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, bars, st, lay_q, lay_kv, tidx, bidx, n_items, nctas):
        """cp.async gathers: per item its Q (once both consumers retired the previous item's last QK^T), then per
        pair the ids of both tiles and the four half-stages; g counts the pairs over the CTA's items (the barriers'
        phases)."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        lanes = gather_lanes(tidx)       # 16 groups of 8 threads; group g owns rows g, g+16, g+32, g+48
        grp, col0 = lanes.grp, lanes.col0
        sQb = smem_bytes(st.sQ)
        sKVb = smem_bytes(st.sKV)
        sw_kv = gather_base(lay_kv, lanes)

        RPG = self.BN // 16              # rows per group and tile
        ids = cute.make_rmem_tensor(2 * RPG, Int32)
        q_policy = l2_evict_first_policy()   # Q is read once; evict it before the gathered rows
        gp = Int32(0)                    # pairs of the CTA's earlier items
        it = Int32(0)                    # the CTA's earlier items
        for item in cutlass.range(bidx, n_items, nctas, unroll=1):
            tok, head0, kmax, npairs, slot0, _ = self.item_setup(a, item)
            cute.arch.mbarrier_wait(bars.q_free, (it % 2) ^ 1)   # the previous item's QK^T retired in both consumers
            self.q_gather(a, bars, lay_q, sQb, tok, head0, grp, col0, q_policy)
            # per pair: the ids of both tiles (invalid or past kmax -> -1), then the four half-stages in the
            # consumers' order of need and of release: V0L, V1R, V0R, V1L
            mIdx = cute.make_tensor(a.p_idx + (Int64(tok) * a.ld_idx + slot0), cute.make_layout(a.topk))
            if const_expr(self.KV_FP8):
                self.fp8_item_pairs(a, bars, lay_kv, sKVb, sw_kv, ids, mIdx, kmax, npairs, gp, lanes)
            else:
                for k in cutlass.range(npairs, unroll=1):
                    self.load_pair_ids(ids, mIdx, kmax, k, grp)
                    free_phase = ((gp + k) % 2) ^ 1
                    for n in cutlass.range_constexpr(4):
                        s, h = self.FILL_ORDER[n]
                        self.gather_half(a, bars, lay_kv, sKVb, sw_kv, ids, s, h, col0, free_phase)
                    self.publish_valid(a, bars, ids, lanes)
            gp += npairs
            it += 1

    @cute.jit
    def q_gather(self, a, bars, lay_q, sQb, tok, head0, grp, col0, policy):
        """cp.async of the 64 heads x D_QK of Q of (tok, head0) into sQ (16-byte chunks, 4 rows per thread),
        completing q_mbar with a noinc arrival; `policy`: the L2 cache policy of the loads."""
        q_rows = a.p_q + (Int64(tok) * a.ld_q + Int64(head0 * self.D_QK))
        cp_async_rows(sQb, lay_q, q_rows, self.M, self.D_QK, grp, col0, policy)
        cute.arch.cp_async_mbarrier_arrive_noinc(bars.q_mbar)

    @cute.jit
    def load_pair_ids(self, ids, mIdx, kmax, k, grp):
        """ids[j] = the id of the thread's row grp + 16 (j % RPG) of tile j // RPG of the item's pair k (mIdx: the
        item's slots); -1 past kmax."""
        RPG = self.BN // 16
        for j in cutlass.range_constexpr(2 * RPG):
            slot = (2 * k + j // RPG) * self.BN + grp + 16 * (j % RPG)
            kv = Int32(-1)
            if slot < kmax:
                kv = mIdx[slot]
            ids[j] = kv

    @cute.jit
    def publish_valid(self, a, bars, ids, lanes):
        """The pair's validity bytes for the consumers' masking (FlashMLA's is_kv_valid), by the group leaders, who
        then arrive on mask_mbar. Called after waiting free[1][L] of the pair: the consumers read the previous
        pair's bytes before releasing that pair's V1L, so no one reads them now."""
        RPG = self.BN // 16
        if lanes.tidx % 8 == 0:
            for j in cutlass.range_constexpr(2 * RPG):
                kv = ids[j]
                bars.sValid[(j // RPG) * self.BN + lanes.grp + 16 * (j % RPG)] = (
                    Int8(1) if kv >= 0 and kv < a.n_kv else Int8(0))
            cute.arch.mbarrier_arrive(bars.mask_mbar)

    @cute.jit
    def gather_half(self, a, bars, lay_kv, sKVb, sw_kv, ids, s: int, h: int, col0, free_phase):
        """Half h (0: L = column blocks [0, HALF_KB), 1: R = the rest) of stage s: wait free[s][h], cp.async the
        tile's rows grp + 16 i (ids `ids[s * RPG + i]`; -1 or out of range: zero-filled from a legal address),
        arrive ready[s][h] (noinc). The smem address is the thread's swizzled base sw_kv plus a constant: the 128B
        swizzle XORs byte bits 4-6 with bits 7-9 = row % 8, which is grp % 8 for every row grp + 16 i, and the
        row-group, column-block and stage offsets only touch bits >= 10."""
        RPG = self.BN // 16
        cute.arch.mbarrier_wait(bars.hbar + (4 + 2 * s + h), free_phase)        # free[s][h]
        gather_tile_rows(sKVb, sw_kv, lay_kv, a.p_kv, a.ld_kv, ids, col0, self.half_blocks(h), stage=s,
                         rows=(s * RPG, RPG), n_rows=a.n_kv)
        cute.arch.cp_async_mbarrier_arrive_noinc(bars.hbar + (2 * s + h))       # ready[s][h]

    # ------------------------------------------------------------------------- producer of the FP8 cache kernels
    @cute.jit
    def fp8_item_pairs(self, a, bars, lay_kv, sKVb, sw_kv, ids, mIdx, kmax, npairs, gp, lanes):
        """FP8 cache kernels: the item's pairs, each half-stage in two steps: its rows' raw bytes copied by cp.async
        into the half-stage itself (stage_raw_half, one commit group), then dequantized in place (dequant_half).
        Order per pair as the BF16 kernel's (V0L, V1R, V0R, V1L; the last one's successor is the next pair's V0L).
        Before dequantizing a half, the thread copies the next one ahead when its free barrier has already passed
        (a test, no wait), so that its gather latency passes under this dequantization; otherwise it dequantizes
        first and then waits for that barrier, so a late release never holds back a half whose bytes are here.
        Threads may take either order (each orders its own copies by its commit groups). No wait can deadlock:
        every free barrier waited depends only on halves already dequantized (V1R(g): B's pair g - 1; V0R(g):
        B's pair g - 1 after A's P0; V1L(g): A's S0(g) over V0L(g); V0L(g + 1): A's P0 V0L of g over V0L(g),
        V0R(g) and the validity bytes, published after V1L(g)'s free passed)."""
        if npairs > 0:
            self.load_pair_ids(ids, mIdx, kmax, 0, lanes.grp)
            s0, h0 = self.FILL_ORDER[0]
            cute.arch.mbarrier_wait(bars.hbar + (4 + 2 * s0 + h0), (gp % 2) ^ 1)
            self.stage_raw_half(a, bars, lay_kv, sKVb, sw_kv, ids, s0, h0, lanes.col0)
        for k in cutlass.range(npairs, unroll=1):
            g = gp + k
            for n in cutlass.range_constexpr(4):
                s, h = self.FILL_ORDER[n]
                s1, h1 = self.FILL_ORDER[(n + 1) % 4]
                free1 = bars.hbar + (4 + 2 * s1 + h1)
                phase1 = (g % 2) ^ 1 if n < 3 else ((g + 1) % 2) ^ 1
                has_next = True if n < 3 else k + 1 < npairs
                ahead = Int32(0)
                if has_next:
                    if cute.arch.mbarrier_test_wait(free1, phase1):
                        self.next_half(a, bars, lay_kv, sKVb, sw_kv, ids, mIdx, kmax, k, n, lanes)
                        ahead = Int32(1)
                if ahead != Int32(0):
                    prims.cp_async_wait_group(1)                 # all but the half just copied have landed
                else:
                    prims.cp_async_wait_group(0)
                self.dequant_half(bars, lay_kv, sKVb, sw_kv, s, h)
                cute.arch.fence_proxy("async.shared", space="cta")              # st.shared -> the consumers' wgmma
                if const_expr(self.SHARED_DEQUANT):
                    if lanes.tidx == 0:                     # the partner's rows arrive as st.async bytes
                        cute.arch.mbarrier_arrive_and_expect_tx(bars.hbar + (2 * s + h), self.PEER_HALF_BYTES)
                    else:
                        cute.arch.mbarrier_arrive(bars.hbar + (2 * s + h))
                else:
                    cute.arch.mbarrier_arrive(bars.hbar + (2 * s + h))          # ready[s][h]
                if has_next:
                    if ahead == Int32(0):
                        cute.arch.mbarrier_wait(free1, phase1)
                        self.next_half(a, bars, lay_kv, sKVb, sw_kv, ids, mIdx, kmax, k, n, lanes)
                if const_expr(n == 2):
                    self.publish_valid(a, bars, ids, lanes)          # V1L(g)'s free has passed: copied above

    @cute.jit
    def next_half(self, a, bars, lay_kv, sKVb, sw_kv, ids, mIdx, kmax, k, n: int, lanes):
        """The copies of the half after half n of pair k (fp8_item_pairs' order), its free barrier passed: the next
        pair's ids first when it is that pair's V0L."""
        s1, h1 = self.FILL_ORDER[(n + 1) % 4]
        if const_expr(n == 3):
            self.load_pair_ids(ids, mIdx, kmax, k + 1, lanes.grp)
        self.stage_raw_half(a, bars, lay_kv, sKVb, sw_kv, ids, s1, h1, lanes.col0)

    @cute.jit
    def stage_raw_half(self, a, bars, lay_kv, sKVb, sw_kv, ids, s: int, h: int, col0):
        """FP8 cache kernels (free[s][h] passed): cp.async half h of stage s's raw bytes from the cache rows
        ids[s * RPG + i] (reference.kv_cache's 656-byte format) into the chunks the thread will dequantize: per NoPE
        block kb its 8 E4M3 bytes to the first 8 bytes of its 16-byte chunk, and per 128-value tile (kb even) the
        tile's FP32 scale to bytes 8..11 of block kb's chunk; the RoPE block's 16 bf16 bytes straight to their
        chunk (final). Invalid ids (-1, >= n_kv) copy zeros from row 0 (src-size 0), which dequantize to zeros.
        One cp.async commit group."""
        RPG = self.BN // 16
        kb0, kb1 = self.half_blocks(h)
        for i in cutlass.range_constexpr(RPG):
            kv = ids[s * RPG + i]
            ok = kv >= 0 and kv < a.n_kv
            row = a.p_kv + Int64(kv if ok else 0) * a.ld_kv                    # the row's first byte
            for kb in cutlass.range_constexpr(kb0, kb1):
                dst = sKVb + (sw_kv + lay_kv.outer((16 * i, kb * 64, s)) * 2)
                if const_expr(kb < KV_NOPE // 64):
                    if self.own_row(bars, i):
                        prims.cp_async_shared_global(dst, row + (kb * 64 + col0), 8, "ca",
                                                     cp_size=Int32(8) if ok else Int32(0))
                        if const_expr(kb % 2 == 0):
                            prims.cp_async_shared_global(dst + 8, row + (KV_NOPE + 4 * (kb * 64 // KV_TILE)), 4,
                                                         "ca", cp_size=Int32(4) if ok else Int32(0))
                else:
                    prims.cp_async_shared_global(dst, row + (KV_ROPE_BYTE + 2 * col0), 16, "cg",
                                                 cp_size=Int32(16) if ok else Int32(0))
        prims.cp_async_commit_group()

    @cute.jit
    def own_row(self, bars, i: int):
        """Whether the producer thread dequantizes its row i (0..RPG-1) of a tile: every row, or with shared_dequant
        rows 0, 1 in the cluster's CTA 0 and 2, 3 in CTA 1 (tile rows 0..31 / 32..63; the partner's come by
        st.async). A CTA-uniform condition."""
        own = True
        if const_expr(self.SHARED_DEQUANT):
            own = bars.peer == Int32(1 - i // 2)
        return own

    @cute.jit
    def dequant_half(self, bars, lay_kv, sKVb, sw_kv, s: int, h: int):
        """FP8 cache kernels: dequantize the thread's NoPE chunks of half h of stage s in place, once their raw bytes
        landed (stage_raw_half): per pair of blocks (kb, kb + 1) of one 128-value tile, both chunks' 8 E4M3 bytes
        and the tile's scale read first, then each chunk rewritten as 8 bf16 values = E4M3 x scale rounded to bf16
        (e4m3x2_scaled_bf16x2: the bytes reference.kv_cache.dequantize_kv_fp8 gives; zeros stay zeros); with
        shared_dequant only the CTA's own rows, each chunk also stored into the partner's stage (store_chunk)."""
        RPG = self.BN // 16
        kb0, kb1 = self.half_blocks(h)
        for i in cutlass.range_constexpr(RPG):
            if self.own_row(bars, i):
                for kb in cutlass.range_constexpr(kb0, min(kb1, KV_NOPE // 64), 2):
                    c0 = sKVb + (sw_kv + lay_kv.outer((16 * i, kb * 64, s)) * 2)
                    c1 = sKVb + (sw_kv + lay_kv.outer((16 * i, kb * 64 + 64, s)) * 2)
                    x0 = ld_shared_b64(c0)
                    sc = ld_shared_f32(c0 + 8)
                    x1 = ld_shared_b64(c1)
                    for c, x in ((c0, x0), (c1, x1)):
                        lo, hi = Int32(x), Int32(x >> 32)
                        self.store_chunk(bars, c, s, h, e4m3x2_scaled_bf16x2(lo, False, sc),
                                         e4m3x2_scaled_bf16x2(lo, True, sc), e4m3x2_scaled_bf16x2(hi, False, sc),
                                         e4m3x2_scaled_bf16x2(hi, True, sc))

    @cute.jit
    def store_chunk(self, bars, c, s: int, h: int, w0, w1, w2, w3):
        """A dequantized 16-byte chunk at shared pointer c; with shared_dequant also into the partner's stage at the
        same place by st.async, completing 16 bytes of its ready[s][h]."""
        st_shared_v4_b32(c, w0, w1, w2, w3)
        if const_expr(self.SHARED_DEQUANT):
            st_async_v4_b32(c.toint() + bars.peer_delta, w0, w1, w2, w3,
                            (bars.hbar + (2 * s + h)).toint() + bars.peer_delta)
    # ----------------------------------------------------------------------------------- consumers (WG1, WG2)
    @cute.jit
    def consumer(self, w: int, a, bars, st, sQ, sKV, sVt, sP_own, sP_other, tidx, bidx, n_items, nctas):
        """Consumer A (w = 0, WG1: tile 2k of each pair, stage 0, O[:, :DV_HALF]) or B (w = 1, WG2: tile 2k+1,
        stage 1, O[:, DV_HALF:]); sP_own / sP_other: the P tile of its own tile and of the other consumer's."""
        DT, M, BN, DV_HALF, STAGES = self.dtype, self.M, self.BN, self.DV_HALF, self.STAGES
        cute.arch.setmaxregister_increase(self.regs[1 + w])
        ctid = tidx - 128 * (1 + w)
        mma_qk = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                   (1, 1, 1), tiler_mn=(M, BN))
        mma_rs = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                   (1, 1, 1), tiler_mn=(M, DV_HALF),
                                                   a_source=warpgroup.OperandSource.RMEM)
        mma_ss = sm90_utils.make_trivial_tiled_mma(DT, DT, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                   (1, 1, 1), tiler_mn=(M, DV_HALF))
        thr_qk = mma_qk.get_slice(ctid)
        thr_rs = mma_rs.get_slice(ctid)
        thr_ss = mma_ss.get_slice(ctid)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sKV))                 # [.., kb, stage]
        sVtH = cute.local_tile(sVt, (DV_HALF, BN, STAGES), (w, 0, 0))          # this consumer's half of V^T
        tOrV = mma_rs.make_fragment_B(thr_rs.partition_B(sVtH))                # own tile: P from registers
        tCrV = mma_ss.make_fragment_B(thr_ss.partition_B(sVtH))                # other tile: P from smem
        tCrP = mma_ss.make_fragment_A(thr_ss.partition_A(sP_other))           # the other consumer's P
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((M, BN)), Float32)
        accO = cute.make_rmem_tensor(thr_rs.partition_shape_C((M, DV_HALF)), Float32)
        accO.fill(0.0)
        rP = cute.make_rmem_tensor(accS.layout, DT)
        tOrP = acc_as_frg_a(rP)                                                # RS operand: the same registers
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), DT), mma_qk)
        thr_st = stsm.get_slice(ctid)
        tPsP_st = thr_st.partition_D(sP_own)                                   # own P tile (stmatrix)
        tPrP_st = thr_st.retile(rP)
        sMN, oMN = acc_mn_view(accS), acc_mn_view(accO)
        cS = acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((M, BN))))
        cO = acc_mn_view(thr_rs.partition_C(cute.make_identity_tensor((M, DV_HALF))))
        NR = cute.size(sMN, mode=[0])
        NC = cute.size(sMN, mode=[1])
        row_max = cute.make_rmem_tensor(NR, Float32)    # running max (log2 domain), the same in A and B after a pair
        row_sum = cute.make_rmem_tensor(NR, Float32)    # this consumer's tiles only; the two are added at the end
        row_max.fill(self.MAX_INIT)
        row_sum.fill(0.0)
        pair_rows = cute.make_rmem_tensor(NR, Float32)   # A: a pair's rescale factors; B: its tile's row maxima
        keep = cute.make_rmem_tensor(NC, cutlass.Boolean)   # which of this thread's accumulator columns are valid
        # the sink (log2 domain) of the thread's rows for each head block, loaded once (epilogue: sink_of_row)
        sink_l2 = cute.make_rmem_tensor(NR * self.HB, Float32)
        sink_l2.fill(0.0)
        if a.has_sink != 0:
            for b in cutlass.range_constexpr(self.HB):
                for r in cutlass.range_constexpr(NR):
                    sink_l2[r + NR * b] = (a.p_sink + (b * M + cO[r, 0][0])).load() * LOG2E
        scale_log2 = a.softmax_scale * LOG2E
        sMax = st.mx.get_tensor(cute.make_layout((M, 2), stride=(1, M)))      # [head row, 0: m0 / 1: pair max]
        sSum = st.sm.get_tensor(cute.make_layout((M, 2, 2), stride=(1, M, 2 * M)))   # [row, consumer, item parity]
        mma_rs.set(warpgroup.Field.ACCUMULATE, True)
        mma_ss.set(warpgroup.Field.ACCUMULATE, True)
        q4 = ctid % 4                                   # the thread's lane in its quad (the 4 lanes of a row)
        q_hi = q4 >= 2
        q_odd = q4 % 2 == 1
        o_policy = l2_evict_first_policy()              # O is written once
        snap_max = snap_sum = sSnap = None
        if const_expr(self.LSE_PREFIX):
            snap_max = cute.make_rmem_tensor(NR, Float32)
            snap_sum = cute.make_rmem_tensor(NR, Float32)
            sSnap = st.snap.get_tensor(cute.make_layout((M, 2), stride=(1, M)))
        f = ConsumerState(ctid=ctid, mma_rs=mma_rs, mma_ss=mma_ss, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, tCrV=tCrV,
                          tCrP=tCrP, accS=accS, accO=accO, rP=rP, tOrP=tOrP, stsm=stsm, tPsP_st=tPsP_st,
                          tPrP_st=tPrP_st, sMN=sMN, oMN=oMN, cS=cS, cO=cO, row_max=row_max, row_sum=row_sum,
                          fac=pair_rows, m_loc=pair_rows, keep=keep, sink_l2=sink_l2, scale_log2=scale_log2,
                          sMax=sMax, sSum=sSum, q4=q4, q_hi=q_hi, q_odd=q_odd, o_policy=o_policy,
                          snap_max=snap_max, snap_sum=snap_sum, sSnap=sSnap)

        gp = Int32(0)                                   # pairs of the CTA's earlier items (the barriers' phases)
        it = Int32(0)                                   # the CTA's earlier items
        for item in cutlass.range(bidx, n_items, nctas, unroll=1):
            tok, head0, kmax, npairs, _, orow = self.item_setup(a, item)
            accO.fill(0.0)
            row_max.fill(self.MAX_INIT)
            row_sum.fill(0.0)
            nsnap = npairs                                  # the pairs in the item's prefix (lse_prefix kernels)
            if const_expr(self.LSE_PREFIX):
                snap_max.fill(self.MAX_INIT)
                snap_sum.fill(0.0)
                nsnap = cutlass.min(npairs, a.n_prefix // (2 * BN))
            cute.arch.mbarrier_wait(bars.q_mbar, it % 2)     # this item's Q
            if const_expr(w == 0):
                if npairs > 0:
                    g = gp
                    mma_qk = self.qk_half(bars, f, mma_qk, 0, 0, g % 2, True)
                    mma_qk = self.qk_half(bars, f, mma_qk, 0, 1, g % 2, False)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                for k in cutlass.range(npairs - 1, unroll=1):
                    g = gp + k
                    mma_qk = self.pair_a(bars, f, mma_qk, g, False)
                    self.snapshot(f, k, nsnap)
                cute.arch.mbarrier_arrive(bars.q_free)       # the item's last QK^T retired (waited above): Q is free
                if npairs > 0:                              # the last pair: no next QK^T
                    g = gp + npairs - 1
                    mma_qk = self.pair_a(bars, f, mma_qk, g, True)
                    self.snapshot(f, npairs - 1, nsnap)
            else:
                for k in cutlass.range(npairs, unroll=1):
                    g = gp + k
                    ph = g % 2
                    # S1 = Q K1^T, right half first (the producer fills V1R before V1L)
                    mma_qk = self.qk_half(bars, f, mma_qk, 1, 1, ph, True)
                    mma_qk = self.qk_half(bars, f, mma_qk, 1, 0, ph, False)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    if k == npairs - 1:
                        cute.arch.mbarrier_arrive(bars.q_free)       # the item's last QK^T retired: Q is free
                    self.pair_b_rest(bars, f, g)
                    self.snapshot(f, k, nsnap)
                if npairs == 0:
                    cute.arch.mbarrier_arrive(bars.q_free)       # an item without pairs: its Q is free at once
            self.epilogue(w, a, f, item, orow, head0, it % 2)
            gp += npairs
            it += 1

    @cute.jit
    def snapshot(self, f, k, nsnap):
        """lse_prefix kernels: keep the running max and this consumer's row sum after pair k when it is the last pair
        of the item's prefix (both consumers hold the pair max after a pair, and their row sums are relative to it)."""
        if const_expr(self.LSE_PREFIX):
            if k == nsnap - 1:
                for r in cutlass.range_constexpr(self.rows(f)):
                    f.snap_max[r] = f.row_max[r]
                    f.snap_sum[r] = f.row_sum[r]

    @cute.jit
    def qk_half(self, bars, f, mma_qk, stage: int, h: int, phase, first: bool):
        """Wait ready[stage][h] and issue S += Q K^T over half h's k16 steps (first: S = ..., ACCUMULATE off).
        Returns mma_qk (its ACCUMULATE field changed: the caller rebinds it, so loops carry it)."""
        cute.arch.mbarrier_wait(bars.hbar + (2 * stage + h), phase)              # ready[stage][h]
        cute.arch.fence_proxy("async.shared", space="cta")   # cp.async (generic) writes -> wgmma reads
        if const_expr(first):
            mma_qk.set(warpgroup.Field.ACCUMULATE, False)
            warpgroup.fence()
        for ks in cutlass.range_constexpr(*self.half_k16_steps(h)):
            cute.gemm(mma_qk, f.accS, f.tSrQ[None, None, ks], f.tSrK[None, None, ks, stage], f.accS)
            mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        return mma_qk

    @cute.jit
    def load_keep(self, bars, f, tile: int, pair):
        """keep[c]: whether the thread's accumulator column c of the pair's tile `tile` holds a valid id."""
        cute.arch.mbarrier_wait(bars.mask_mbar, pair % 2)       # the pair's validity bytes
        for c in cutlass.range_constexpr(self.cols(f)):
            f.keep[c] = bars.sValid[tile * self.BN + f.cS[0, c][1]] != Int8(0)

    @cute.jit
    def release_half(self, bars, k: int):
        """Arrive on free[s][h] = hbar + 4 + k (k = 2 s + h) once this consumer's reads of the half retired; with
        shared_dequant also on the partner CTA's, which stores its rows into this stage: lane 0 of each warp for
        its 32 threads (after the warpgroup's wgmma wait, so every lane's reads retired)."""
        cute.arch.mbarrier_arrive(bars.hbar + (4 + k))
        if const_expr(self.SHARED_DEQUANT):
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive(bars.hbar + (4 + k), peer_cta_rank_in_cluster=bars.peer, arrive_count=32)

    @cute.jit
    def pv(self, f, mma, frg_a, frg_v, stage: int):
        """O half += P V of `stage` (P: registers for mma_rs, smem for mma_ss), committed as one group."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(frg_a, mode=[2])):
            cute.gemm(mma, f.accO, frg_a[None, None, kb], frg_v[None, None, kb, stage], f.accO)
        warpgroup.commit_group()

    @cute.jit
    def pair_a(self, bars, f, mma_qk, g, last: bool):
        """Consumer A's pair g (of the CTA's items) after its S0 retired; `last`: no next pair's QK^T to issue.
        Returns mma_qk."""
        # softmax of tile 2k with A's own running max m0 = max(previous pair max, tile max): no wait for B
        self.load_keep(bars, f, 0, g)
        for r in cutlass.range_constexpr(self.rows(f)):
            ml = masked_row_max(f.sMN, r, self.cols(f), f.keep, f.scale_log2)
            m0 = cute.arch.fmax(f.row_max[r], ml)
            exp_and_rescale(f.sMN, f.oMN, f.row_max, f.row_sum, r, self.cols(f), m0)
            if f.ctid % 4 == 0:
                f.sMax[f.cS[r, 0][0], 0] = m0
        cute.arch.barrier_arrive(barrier_id=self.BAR_MAX_A, number_of_threads=256)
        f.rP.store(f.accS.load().to(self.dtype))              # P0 -> bf16 once: the RS operand
        self.pv(f, f.mma_rs, f.tOrP, f.tOrV, 0)
        warpgroup.wait_group(0)
        self.release_half(bars, 0)                 # free[0][L]: P0 V0L retired
        # the pair max m from B: rescale P0, O_L and the row sum by exp2(m0 - m) <= 1
        cute.arch.barrier(barrier_id=self.BAR_MAX_B, number_of_threads=256)
        for r in cutlass.range_constexpr(self.rows(f)):
            m = f.sMax[f.cS[r, 0][0], 1]
            fr = cute.math.exp2(f.row_max[r] - m, fastmath=True)
            f.row_max[r] = m
            f.row_sum[r] = f.row_sum[r] * fr
            f.fac[r] = fr
            for c in cutlass.range_constexpr(self.cols(f)):
                f.sMN[r, c] = f.sMN[r, c] * fr
        f.rP.store(f.accS.load().to(self.dtype))              # (P V_L retired: rP is free)
        cute.copy(f.stsm, f.tPrP_st, f.tPsP_st)
        cute.arch.fence_proxy("async.shared", space="cta")   # st.shared P0 -> B's wgmma
        cute.arch.barrier_arrive(barrier_id=self.BAR_P_A, number_of_threads=256)
        cute.arch.barrier(barrier_id=self.BAR_P_B, number_of_threads=256)   # P1 in smem
        for r in cutlass.range_constexpr(self.rows(f)):
            for c in cutlass.range_constexpr(cute.size(f.oMN, mode=[1])):
                f.oMN[r, c] = f.oMN[r, c] * f.fac[r]
        self.pv(f, f.mma_ss, f.tCrP, f.tCrV, 1)
        if const_expr(last):
            warpgroup.wait_group(0)
            self.release_half(bars, 2)                 # free[1][L]: P1 V1L retired
        else:
            # the next pair's S0 = Q K0^T (left half) goes out before V1L is freed
            mma_qk = self.qk_half(bars, f, mma_qk, 0, 0, (g + 1) % 2, True)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            self.release_half(bars, 2)                 # free[1][L]: P1 V1L retired
            mma_qk = self.qk_half(bars, f, mma_qk, 0, 1, (g + 1) % 2, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        return mma_qk

    @cute.jit
    def pair_b_rest(self, bars, f, g):
        """Consumer B's pair g after its S1 = Q K1^T retired."""
        self.load_keep(bars, f, 1, g)
        for r in cutlass.range_constexpr(self.rows(f)):
            f.m_loc[r] = masked_row_max(f.sMN, r, self.cols(f), f.keep, f.scale_log2)
        cute.arch.barrier(barrier_id=self.BAR_MAX_A, number_of_threads=256)   # A's m0 in sMax[:, 0]
        for r in cutlass.range_constexpr(self.rows(f)):
            m = cute.arch.fmax(f.sMax[f.cS[r, 0][0], 0], f.m_loc[r])            # the pair max (m0 >= our old max)
            exp_and_rescale(f.sMN, f.oMN, f.row_max, f.row_sum, r, self.cols(f), m)
            if f.ctid % 4 == 0:
                f.sMax[f.cS[r, 0][0], 1] = m
        cute.arch.barrier_arrive(barrier_id=self.BAR_MAX_B, number_of_threads=256)
        f.rP.store(f.accS.load().to(self.dtype))              # P1 -> bf16 once: the RS operand and the smem copy
        self.pv(f, f.mma_rs, f.tOrP, f.tOrV, 1)
        cute.copy(f.stsm, f.tPrP_st, f.tPsP_st)
        # V1R is freed as soon as P1 V1R retires, before waiting for A's P0: its refill for the next pair (which
        # B's next QK^T needs first) starts one P0 hand-off + P0 V0R earlier; the tensor pipe still has P1 V1R
        # to run while B waits here, and P0 V0R would queue behind it anyway
        warpgroup.wait_group(0)
        self.release_half(bars, 3)                 # free[1][R]: P1 V1R retired
        cute.arch.barrier(barrier_id=self.BAR_P_A, number_of_threads=256)     # P0 in smem
        self.pv(f, f.mma_ss, f.tCrP, f.tCrV, 0)
        cute.arch.fence_proxy("async.shared", space="cta")   # st.shared P1 -> A's wgmma
        cute.arch.barrier_arrive(barrier_id=self.BAR_P_B, number_of_threads=256)
        warpgroup.wait_group(0)
        self.release_half(bars, 1)                 # free[0][R]: P0 V0R retired

    # --------------------------------------------------------------------------------------------- epilogue
    @cute.jit
    def epilogue(self, w: int, a, f, item, tok, head0, ip):
        """Row sums over the quad, then over both consumers (same order in both: same 1/denominator), in the item
        parity ip's half of sSum (a consumer that runs ahead into the next item cannot overwrite what the other
        still reads); out = O / (s + the sink term) as 16-byte stores; consumer A also writes lse and max_logits.
        split_kv kernels: out row `tok` (the item's output row) = O / s in FP32, its lse, no sink (the combine
        kernel adds it), no max_logits."""
        for r in cutlass.range_constexpr(self.rows(f)):
            s = quad_sum(f.row_sum[r])
            if f.ctid % 4 == 0:
                f.sSum[f.cO[r, 0][0], w, ip] = s
            if const_expr(self.LSE_PREFIX):             # the prefix row sums: B hands its own to A like the sums
                sp = quad_sum(f.snap_sum[r])
                f.snap_sum[r] = sp
                if const_expr(w == 1):
                    if f.ctid % 4 == 0:
                        f.sSnap[f.cO[r, 0][0], ip] = sp
        if const_expr(w == 0):
            # the row sums change hands like the maxima, each direction one barrier arrived by its writer and synced by
            # its reader (never one barrier synced by both consumers from their two code paths: notes, "Sanitizers");
            # A's next arrive on BAR_EPI_A follows its sync on BAR_EPI_B, which B arrives only after its sync on
            # BAR_EPI_A completed, so no generation of either barrier mixes two items
            cute.arch.barrier_arrive(barrier_id=self.BAR_EPI_A, number_of_threads=256)
            cute.arch.barrier(barrier_id=self.BAR_EPI_B, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=self.BAR_EPI_A, number_of_threads=256)
            cute.arch.barrier_arrive(barrier_id=self.BAR_EPI_B, number_of_threads=256)
        for r in cutlass.range_constexpr(self.rows(f)):
            row = f.cO[r, 0][0]
            s = f.sSum[row, 0, ip] + f.sSum[row, 1, ip]
            m = f.row_max[r]
            # inv = 1 / (s + the sink term), 0 when s == 0 (no valid slot: out 0)
            denom = s
            if const_expr(not self.SPLIT_KV):
                if a.has_sink != 0:
                    denom = s + cute.math.exp2(self.sink_of_row(f, r, item) - m, fastmath=True)
            inv = Float32(0.0) if s == Float32(0.0) else Float32(1.0) / denom
            self.store_row(w, a, f, r, tok, head0, row, inv)
            if const_expr(w == 0):
                if f.ctid % 4 == 0:                       # s == 0: no valid slot (a valid one adds exp2(0) = 1)
                    at = Int64(tok) * self.H + head0 + row
                    (a.p_lse + at).store(Float32.inf if s == Float32(0.0)
                                         else (m + cute.math.log2(s, fastmath=False)) * LN2)
                    if const_expr(not self.SPLIT_KV):
                        (a.p_maxl + at).store(-Float32.inf if s == Float32(0.0) else m * LN2)
                    if const_expr(self.LSE_PREFIX):       # KV-only LSE over the first n_prefix slots (+inf: none)
                        sp = f.snap_sum[r] + f.sSnap[row, ip]
                        (a.p_lsep + at).store(Float32.inf if sp == Float32(0.0)
                                              else (f.snap_max[r] + cute.math.log2(sp, fastmath=False)) * LN2)

    @cute.jit
    def sink_of_row(self, f, r: int, item):
        """The sink (log2 domain) of accumulator row r of the item's head block, from the registers the consumer
        loaded at its start (a global load here would stall the epilogue)."""
        if const_expr(self.HB == 1):
            return f.sink_l2[r]
        else:
            return f.sink_l2[r] if item % self.HB == 0 else f.sink_l2[r + self.rows(f)]

    @cute.jit
    def store_row(self, w: int, a, f, r: int, tok, head0, row, inv):
        """out[tok, head0 + row, w * DV_HALF:][:DV_HALF] = O row r * inv as 16-byte stores (epilogue.store_row_v4;
        split_kv kernels: FP32, epilogue.store_row_f32_v4)."""
        if const_expr(self.SPLIT_KV):
            o_row = a.p_out + ((Int64(tok) * self.H + head0 + row) * self.D_V + w * self.DV_HALF)
            store_row_f32_v4(o_row, f.oMN, f.cO, r, inv)
        else:
            o_row = a.p_out + ((Int64(tok) * self.H + head0 + row) * self.D_V + (w * self.DV_HALF + 8 * f.q4))
            store_row_v4(o_row, f.oMN, r, inv, self.fp16, f.q_hi, f.q_odd, f.o_policy)
