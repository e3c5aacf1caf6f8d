"""Plain-PyTorch reference of packed query sparse attention, QSA (FlashInfer QSA / cuDNN).

Packed tokens: q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` with query head h reading KV head
h // (Hq // Hkv). Query t attends a caller-selected set of key tokens u:

    s[h, u]     = scale * q[t, h] . k[u, h // G]
    lse[h, t]   = logsumexp_u s[h, u]                (natural log)
    out[t, h]   = sum_u exp(s[h, u] - lse[h, t]) * v[u, h // G]

The set is either explicit token ids (`indexed_forward`) or four-token blocks picked by a bitmap
(`bitmap_forward`). An empty set gives out = 0 and lse = -inf. Chunked over query rows; FP16/BF16/FP32
accumulate in FP32, FP64 stays FP64, autograd's sums included (k and v are cast before their rows are gathered, so
dk / dv are rounded to the inputs' dtype once); CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

from .sparse_attention import acc_dtype, rows_per_chunk

BLOCK_TOKENS = 4  # QSA selects four-token blocks
_INF = float("inf")


def _attend(q_c: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GQA softmax attention of one chunk.

    q_c `(C, Hkv, G, D)`, keys `(C, Hkv, N, D)` or `(1, Hkv, N, D)`, values likewise with Dv,
    allowed bool `(C, N)`. Returns out `(C, Hkv, G, Dv)` and natural-log lse `(C, Hkv, G)` (-inf when
    nothing is allowed; out is 0 there).
    """
    scores = torch.matmul(q_c, keys.transpose(-1, -2)) * scale            # (C, Hkv, G, N)
    scores = scores.masked_fill(~allowed[:, None, None, :], -_INF)
    m = scores.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m_safe.unsqueeze(-1))
    sumexp = e.sum(dim=-1)
    safe_sum = torch.where(sumexp > 0, sumexp, 1)   # log / 1 of a positive sum only: no NaN in autograd's rows
    lse = torch.where(sumexp > 0, m_safe + torch.log(safe_sum), torch.full_like(m, -_INF))
    inv = torch.where(sumexp > 0, 1 / safe_sum, 0)
    out = torch.matmul(e, values) * inv.unsqueeze(-1)
    return out, lse


def _finish(out_acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype):
    t, hkv, g, dv = out_acc.shape
    out_acc = out_acc.reshape(t, hkv * g, dv)
    return out_acc.to(dtype), out_acc, lse.reshape(t, hkv * g).transpose(0, 1).contiguous()


def indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QSA from token indices (no validation; see dsagen.ops.qsa.qsa_indexed_forward).

    indices `[T, W]` absolute packed token ids; an id in [0, T) is attended, anything else (the -1
    padding, out-of-range ids) is skipped. The reference attends exactly the listed tokens: the
    FlashInfer QSA's grouping/causality contract is not checked, and a repeated id counts once per slot.
    Returns `(out [T, Hq, Dv] in q.dtype, out_fp32 [T, Hq, Dv], lse [Hq, T])`; out_fp32 and lse are
    FP32 (FP64 for FP64 inputs).
    """
    t, hq, d = q.shape
    hkv, dv, w = k.shape[1], v.shape[-1], indices.shape[-1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(t, hkv, g, dv, dtype=acc, device=q.device)
    lse = torch.full((t, hkv, g), -_INF, dtype=acc, device=q.device)
    if t == 0 or w == 0:
        return _finish(out, lse, q.dtype)
    # cast before the gather: autograd then sums a key's slots (repeats, other rows, other chunks) in `acc` and
    # rounds dk / dv to the inputs' dtype once, not after every slot's addition
    k_h, v_h = k.to(acc).transpose(0, 1), v.to(acc).transpose(0, 1)        # (Hkv, T, D)
    step = rows_per_chunk(w * (hkv * (d + dv) + 2 * hq))
    for r0 in range(0, t, step):
        r1 = min(r0 + step, t)
        ids = indices[r0:r1].long()
        valid = (ids >= 0) & (ids < t)
        safe = torch.where(valid, ids, 0)
        keys = k_h[:, safe].permute(1, 0, 2, 3)                              # (C, Hkv, W, D)
        values = v_h[:, safe].permute(1, 0, 2, 3)
        values = values.masked_fill(~valid[:, None, :, None], 0)              # never read masked rows
        q_c = q[r0:r1].to(acc).reshape(r1 - r0, hkv, g, d)
        out[r0:r1], lse[r0:r1] = _attend(q_c, keys, values, valid, scale)
    return _finish(out, lse, q.dtype)


def bitmap_token_layout(num_tokens: int, cu_seqlens: torch.Tensor | None, device: torch.device):
    """Per packed token: (its block id, its sequence's first token) and the number of blocks.

    Blocks are four consecutive tokens of one sequence, restarting at each sequence boundary (the last
    block of a sequence may be partial); blocks are numbered sequence after sequence. Without
    cu_seqlens the whole pack is one sequence.
    """
    pos = torch.arange(num_tokens, device=device)
    if cu_seqlens is None:
        starts = torch.zeros(num_tokens, dtype=torch.long, device=device)
        return pos // BLOCK_TOKENS, starts, -(-num_tokens // BLOCK_TOKENS)
    cu = cu_seqlens.long().to(device)
    lengths = cu[1:] - cu[:-1]
    blocks_per_seq = torch.div(lengths + BLOCK_TOKENS - 1, BLOCK_TOKENS, rounding_mode="floor")
    first_block = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    seq = torch.bucketize(pos, cu[1:], right=True)                           # sequence of each token
    starts = cu[seq]
    block = first_block[seq] + torch.div(pos - starts, BLOCK_TOKENS, rounding_mode="floor")
    return block, starts, int(blocks_per_seq.sum())


def bitmap_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor, *,
                   cu_seqlens: torch.Tensor | None = None, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QSA from a block bitmap (no validation; see dsagen.ops.qsa.qsa_bitmap_forward).

    block_bitmap `[T, NB]`: nonzero at [t, b] selects block b for query t. Query t attends token u
    when u's block is selected, u lies in t's sequence and u <= t (causal; the partial tail of t's
    own block is cut at t). Returns as indexed_forward.
    """
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(t, hkv, g, dv, dtype=acc, device=q.device)
    lse = torch.full((t, hkv, g), -_INF, dtype=acc, device=q.device)
    if t == 0:
        return _finish(out, lse, q.dtype)
    block, starts, _ = bitmap_token_layout(t, cu_seqlens, q.device)
    keys = k.to(acc).transpose(0, 1).unsqueeze(0)                             # (1, Hkv, T, D)
    values = v.to(acc).transpose(0, 1).unsqueeze(0)
    pos = torch.arange(t, device=q.device)
    step = rows_per_chunk(t * (2 * hq + 1))
    for r0 in range(0, t, step):
        r1 = min(r0 + step, t)
        rows = pos[r0:r1].unsqueeze(-1)
        allowed = (block_bitmap[r0:r1][:, block] != 0) & (pos <= rows) & (pos >= starts[r0:r1].unsqueeze(-1))
        q_c = q[r0:r1].to(acc).reshape(r1 - r0, hkv, g, d)
        out[r0:r1], lse[r0:r1] = _attend(q_c, keys, values, allowed, scale)
    return _finish(out, lse, q.dtype)
