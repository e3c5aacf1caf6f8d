"""Fused dense indexer backward for Hopper (sm_90a), the dense warm-up's indexer gradients (cuDNN frontend DSA §10):
`DenseIndexerBwdSm90` and `build(...)`, as bwd_sm90 (the sparse form) does for its spec.

The sparse form's kernel with each query row's visible keys as its slots: for row tok = b * T + t (BSHD) the slots
are the keys s < hi = clamp((q_off[b] + t + 1) // ratio, 0, S) in 64-key tiles, and the score gradient of slot s is
computed by the producer's group leaders from the dense score rows instead of read:

    tgt   = attn[tok, s] / norm[tok]                     (0 when norm[tok] <= 0)
    p     = exp2((index[tok, s] - lse[tok]) * log2 e)
    dI[s] = cs * (p * [norm[tok] > 0] - tgt)             (cs = c * sm_scale, one FP32 value read on the device)

(the reference's p * sum_J tgt - tgt with sum_J tgt = 1, the definition of the L1 norm of the row's visible
attention scores, and 0 without them). With kl_loss (a spec field), the same leaders also sum the row's part of the
KL loss of the warm-up's fused loss path (indexer_bwd/kl_host.py),

    kl[tok] = sum_{s < hi, tgt > 0} tgt * (log tgt - (index[tok, s] - lse[tok]))

(log2 and exp2 units, times ln 2 at the end), and each of the producer's 4 warps stores its leaders' sum (butterfly
shuffles) at loss[tok, warp]: the row's loss is the sum of its 4 partials, in a fixed order (no atomics).

The gathered rows are b * S + s (-1, zero-filled, past hi); S, G, dW, dQ and the dK atomics are the sparse form's
(its consumer, with this form's per-row tile count). dK is the caller's zeroed FP32 [B * S, D] accumulator: the
atomics make it not bitwise repeatable. deterministic: the sparse form's per-slot stores instead, slot = key: dk is
then a zeroed FP32 [rows, S, D] buffer (row tok's key s at (tok * S + s) * D; the tiles' slots past hi store zeros,
slots past the last tile stay as zeroed), which the host sums over the rows.

Constraints (DenseIndexerBwdSpec.reasons): those of the sparse form's non-deterministic kernel; attn / index rows
FP32 with row stride ld_s (at least S), norm / lse FP32 [rows], q_off int32 [B] (read when has_off).
"""

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.dense_rows import row_limit
from dsagen.kernels.common.sm90.gather import gather_ring_tile, load_row_tile, row_gather_producer
from dsagen.kernels.indexer_bwd.bwd_sm90 import IndexerBwdSm90

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def params(dtype: str) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call); `dtype`: "bfloat16" or "float16"."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},            # (rows, H, D) contiguous
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},            # (B * S, D), row stride ld_k
        {"name": "attn", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows, ld_s) attention scores
        {"name": "index", "kind": "ptr", "dtype": "float32", "align": 4},     # (rows, ld_s) indexer scores
        {"name": "norm", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows,) attention L1 norms
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},       # (rows,) indexer LSE
        {"name": "cs", "kind": "ptr", "dtype": "float32", "align": 4},        # (1,) c * sm_scale
        {"name": "w", "kind": "ptr", "dtype": "float32", "align": 4},         # (rows, H) contiguous
        {"name": "dq", "kind": "ptr", "dtype": dtype, "align": 16},           # (rows, H, D) contiguous
        {"name": "dw", "kind": "ptr", "dtype": "float32", "align": 4},        # (rows, H) contiguous
        {"name": "dk", "kind": "ptr", "dtype": "float32", "align": 16},       # (B * S, D) zeroed (det.: (rows, S, D))
        {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},       # (B,) causal offsets, when has_off
        {"name": "loss", "kind": "ptr", "dtype": "float32", "align": 4},      # (rows, 4) KL partials (kl_loss)
        {"name": "rows", "kind": "i32"},                                      # B * T
        {"name": "T", "kind": "i32"},
        {"name": "S", "kind": "i32"},
        {"name": "ratio", "kind": "i32"},
        {"name": "has_off", "kind": "i32"},
        {"name": "ld_k", "kind": "i64"},
        {"name": "ld_s", "kind": "i64"},
        {"name": "n_ctas", "kind": "i32"},
    ]


def build(num_heads: int, head_dim: int, dtype: str, stages: int, regs_producer: int,
          regs_consumer: int, deterministic: bool = False, kl_loss: bool = False) -> BuiltKernel:
    """A new dense indexer backward kernel for one DenseIndexerBwdSpec's values (distinct function objects on every
    call, so every rendered module names its own kernel)."""
    k = DenseIndexerBwdSm90(num_heads, head_dim, dtype, stages, regs_producer, regs_consumer, deterministic, kl_loss)
    return BuiltKernel.of(params(dtype), k, "min(rows, n_ctas)")


class DenseArgs(NamedTuple):
    """The kernel's run-time arguments (its flat ABI but n_ctas); the names the sparse consumer reads (p_w, p_dq,
    p_dw, p_dk, rows, topk) keep their meaning (topk: unused, the row's tiles come from row_tiles)."""
    p_q: Any
    p_k: Any
    p_attn: Any
    p_index: Any
    p_norm: Any
    p_lse: Any
    p_cs: Any
    p_w: Any
    p_dq: Any
    p_dw: Any
    p_dk: Any
    p_off: Any
    p_loss: Any
    rows: Any
    T: Any
    S: Any
    ratio: Any
    has_off: Any
    ld_k: Any
    ld_s: Any
    topk: Any


class DenseIndexerBwdSm90(IndexerBwdSm90):
    """The kernel of one DenseIndexerBwdSpec (module docstring): `kernel` and `host` (grid min(rows, n_ctas), 256
    threads, two CTAs per SM); the sparse form's body, consumer and dK sends, with its own producer and tile count."""

    def __init__(self, num_heads: int, head_dim: int, dtype: str, stages: int, regs_producer: int,
                 regs_consumer: int, deterministic: bool = False, kl_loss: bool = False):
        super().__init__(num_heads, head_dim, dtype, deterministic, stages, regs_producer, regs_consumer)
        self.KL = kl_loss

    def _entry_points(self):
        k = self

        @cute.kernel
        def kernel(p_q: cute.Pointer, p_k: cute.Pointer, p_attn: cute.Pointer, p_index: cute.Pointer,
                   p_norm: cute.Pointer, p_lse: cute.Pointer, p_cs: cute.Pointer, p_w: cute.Pointer,
                   p_dq: cute.Pointer, p_dw: cute.Pointer, p_dk: cute.Pointer, p_off: cute.Pointer,
                   p_loss: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32, has_off: Int32,
                   ld_k: Int64, ld_s: Int64, n_ctas: Int32):
            k.body(DenseArgs(p_q, p_k, p_attn, p_index, p_norm, p_lse, p_cs, p_w, p_dq, p_dw, p_dk, p_off, p_loss,
                             rows, T, S, ratio, has_off, ld_k, ld_s, S))

        @cute.jit
        def host(p_q: cute.Pointer, p_k: cute.Pointer, p_attn: cute.Pointer, p_index: cute.Pointer,
                 p_norm: cute.Pointer, p_lse: cute.Pointer, p_cs: cute.Pointer, p_w: cute.Pointer,
                 p_dq: cute.Pointer, p_dw: cute.Pointer, p_dk: cute.Pointer, p_off: cute.Pointer,
                 p_loss: cute.Pointer, rows: Int32, T: Int32, S: Int32, ratio: Int32, has_off: Int32,
                 ld_k: Int64, ld_s: Int64, n_ctas: Int32):
            kernel(p_q, p_k, p_attn, p_index, p_norm, p_lse, p_cs, p_w, p_dq, p_dw, p_dk, p_off, p_loss, rows, T, S,
                   ratio, has_off, ld_k, ld_s, n_ctas).launch(
                grid=(cutlass.min(rows, n_ctas), 1, 1), block=(k.THREADS, 1, 1), smem=k.Smem.size_in_bytes(),
                min_blocks_per_mp=k.CTAS_PER_SM, preferred_smem_carveout=100)

        return kernel, host

    @cute.jit
    def row_tiles(self, a, tok):
        """The row's 64-key tiles over its visible keys."""
        _, hi = row_limit(a.p_off, a.has_off, tok, a.T, a.S, a.ratio)
        return (hi + self.BN - 1) // self.BN

    # ------------------------------------------------------------------------------------------- producer (WG0)
    @cute.jit
    def producer(self, a, sh, st, lay_q, lay_k, tidx, bidx, nctas):
        """Per row: Q (load_row_tile), then per tile the row's consecutive key rows into the ring and, by the group
        leaders, their ids and dI (module docstring) into sIds / sDI."""
        cute.arch.setmaxregister_decrease(self.regs[0])
        p = row_gather_producer(tidx, st.sQ, st.sK, lay_k, self.BN)
        lanes, ids, grp = p.lanes, p.ids, p.lanes.grp
        RPG = self.BN // 16
        cs = a.p_cs.load()
        gt = Int32(0)
        it = Int32(0)
        for tok in cutlass.range(bidx, a.rows, nctas, unroll=1):
            b, hi = row_limit(a.p_off, a.has_off, tok, a.T, a.S, a.ratio)
            ntiles = (hi + self.BN - 1) // self.BN
            load_row_tile(p.q_smem, lay_q, a.p_q + Int64(tok) * (self.H * self.D), self.H, self.D, lanes, p.policy,
                          it, sh.q_free, sh.q_full)
            row_attn = a.p_attn + Int64(tok) * a.ld_s
            row_index = a.p_index + Int64(tok) * a.ld_s
            norm = (a.p_norm + tok).load()
            lse2 = (a.p_lse + tok).load() * LOG2E
            inv = Float32(0.0)
            has = Float32(0.0)
            if norm > Float32(0.0):
                inv = Float32(1.0) / norm
                has = Float32(1.0)
            kl = Float32(0.0)                      # the leader's part of the row's KL sum (log2 units)
            for j in cutlass.range(ntiles, unroll=1):
                g = gt + j
                s = g % self.STAGES
                for i in cutlass.range_constexpr(RPG):
                    key = j * self.BN + grp + 16 * i
                    ids[i] = b * a.S + key if key < hi else Int32(-1)
                gather_ring_tile(p.kv_smem, p.sw_kv, lay_k, a.p_k, a.ld_k, ids, lanes.col0, (0, self.NKB), g,
                                 self.STAGES, sh.kv_ready, sh.kv_free)
                if tidx % 8 == 0:
                    for i in cutlass.range_constexpr(RPG):
                        key = j * self.BN + grp + 16 * i
                        di = Float32(0.0)
                        if key < hi:
                            if cutlass.const_expr(self.KL):
                                x2 = (row_index + key).load() * LOG2E - lse2
                                tgt = (row_attn + key).load() * inv
                                di = cs * (cute.math.exp2(x2, fastmath=False) * has - tgt)
                                if tgt > Float32(0.0):
                                    kl += tgt * (cute.math.log2(tgt, fastmath=False) - x2)
                            else:
                                pr = cute.math.exp2((row_index + key).load() * LOG2E - lse2, fastmath=False)
                                di = cs * (pr * has - (row_attn + key).load() * inv)
                        sh.sIds[s * self.BN + grp + 16 * i] = ids[i]
                        sh.sDI[s * self.BN + grp + 16 * i] = di
                    cute.arch.mbarrier_arrive(sh.kv_ready + s)
            if cutlass.const_expr(self.KL):
                kl += cute.arch.shuffle_sync_bfly(kl, offset=8)
                kl += cute.arch.shuffle_sync_bfly(kl, offset=16)
                if tidx % 32 == 0:
                    (a.p_loss + (Int64(tok) * 4 + tidx // 32)).store(kl * LN2)
            gt += ntiles
            it += 1
