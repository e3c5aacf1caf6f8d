"""What the QSA backward's two kernels (dq_sm90.py, dkv_sm90.py) share beyond the producer and the item's skeleton
(producer_sm90.py): the flat ABI, the register split and the per-row statistics of an item's head rows.

Both kernels read the forward's natural-log lse [Hq, T] and delta [Hq, T] (delta = sum(dO * O) per query row, minus
the lse's own gradient where the caller has one: d lse / d s = P, so dS = P (dP - delta + dlse)), and recompute
P = exp2(S scale log2e - lse log2e) per slot.
"""
import math

import cutlass
from cutlass import Float32, Int32, Int64

from dsagen.kernels.qsa.producer_sm90 import select_params, select_scalar_params

LOG2E = math.log2(math.e)
REGS_PRODUCER = 56          # the bitmap form's search needs them (the forward's split)
REGS_CONSUMER = 240


def params(dtype: str, bitmap: bool, outputs: list[dict]) -> list[dict]:
    """A backward kernel's flat ABI, in order (a new list on every call): the inputs, the selection (bitmap: the
    bitmap form's), `outputs`, the forward's statistics, the sizes and strides, the scales."""
    return [
        {"name": "q", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hq, D], token stride q_st
        {"name": "k", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, D], token stride k_st
        {"name": "v", "kind": "ptr", "dtype": dtype, "align": 16},           # [T, Hkv, Dv], token stride v_st
        {"name": "dout", "kind": "ptr", "dtype": dtype, "align": 16},        # [T, Hq, Dv], token stride do_st
        *select_params(bitmap),
        *outputs,
        {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [Hq, T] the forward's (natural log)
        {"name": "delta", "kind": "ptr", "dtype": "float32", "align": 4},    # [Hq, T]
        {"name": "n_tok", "kind": "i32"},                                    # T
        {"name": "n_kv", "kind": "i32"},                                     # Hkv
        *select_scalar_params(bitmap),
        {"name": "q_st", "kind": "i64"},
        {"name": "k_st", "kind": "i64"},
        {"name": "v_st", "kind": "i64"},
        {"name": "do_st", "kind": "i64"},
        {"name": "scale_log2", "kind": "f32"},                               # softmax scale x log2(e)
        {"name": "scale", "kind": "f32"},                                    # softmax scale
    ]


@cutlass.cute.jit
def row_stats(p_lse, p_delta, hq0, row, t, n_tok, group: int):
    """(lse2, delta) of an item's head row `row` (query head hq0 + row of token t): the forward's lse in the log2
    domain and delta. A padding row (row >= group) or a row without a valid slot (lse -inf) gives lse2 = +inf, so
    that P = exp2(S c - lse2) is 0 there, and delta 0."""
    lse2 = Float32(math.inf)
    dl = Float32(0.0)
    if row < group:
        at = Int64(hq0 + row) * n_tok + t
        lse = (p_lse + at).load()
        if lse > -Float32.inf:
            lse2 = lse * LOG2E
            dl = (p_delta + at).load()
    return lse2, dl


@cutlass.cute.jit
def valid_id(u, n_tok):
    """A slot's id where it lies in [0, T), else -1 (a slot the gather zero-filled and the kernels skip)."""
    return u if u >= 0 and u < n_tok else Int32(-1)
