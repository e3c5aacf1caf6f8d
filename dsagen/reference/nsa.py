"""Plain-PyTorch reference of native sparse attention, NSA (ejkernel NSA / fla-org).

Shapes: query `[B, T, HQ, D]`, key `[B, T, H, D]`, value `[B, T, H, Dv]`, GQA with query head hq
reading KV head hq // (HQ // H). Keys are cut into blocks of `block_size` tokens (restarting at
every sequence of a varlen pack; the last block may be partial).

* Selected branch: token t of KV head h attends every token of the blocks block_indices[t, h, s]
  for slots s < block_counts[t, h] whose id is in [0, #blocks), restricted causally to tokens <= t.
  -1 (and any out-of-range id) is an empty slot; a repeated block counts once per slot.
* Compressed branch (only with g_cmp): mean-pooled block keys/values (a partial last block is padded
  with zeros before the mean); token t attends the complete blocks c < (t + 1) // block_size. The
  same scores select the blocks: p[c] = sum over the KV head's G query heads of
  exp(s_c - lse_cmp), with the query's own block c = t // block_size forced to 1 per head, future
  blocks excluded, top block_counts by p, ties to the larger block id, unused slots -1.
* out = o_slc * g_slc + o_cmp * g_cmp (each gate `[B, T, HQ]`, broadcast over Dv; a missing g_slc
  means a gate of 1, a missing g_cmp drops the compressed branch).

block_indices / block_counts arrive here per token; the per-query-block layout `[B, H, NQB, ...]`
of ejkernel is expanded by dsagen.ops.nsa with `query_block_of_token` + `blocks_to_tokens`.

A token with nothing to attend gets zeros from that branch. Plain autograd differentiates it (the
block selection is a constant). Chunked over query rows; FP16/BF16/FP32 accumulate in FP32, FP64
stays FP64; CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

from .sparse_attention import acc_dtype, rows_per_chunk

_INF = float("inf")


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim restricted to `allowed`; rows with nothing allowed give zeros and
    lse -inf. Differentiable (the max shift is detached)."""
    scores = scores.masked_fill(~allowed, -_INF)
    m = scores.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, m + torch.log(torch.where(z > 0, z, torch.ones_like(z))), -_INF)
    return p, lse.squeeze(-1)


def num_query_blocks(t_len: int, block_size: int, cu_seqlens: list[int] | None = None) -> int:
    """NQB, the query-block count of the per-query-block layout: ceil(T / block_size), or with packed
    offsets `cu_seqlens` (host ints) the sum over sequences of ceil(len_i / block_size)."""
    if cu_seqlens is None:
        return -(-t_len // block_size)
    return sum(-(-(end - start) // block_size) for start, end in zip(cu_seqlens, cu_seqlens[1:]))


def query_block_of_token(t_len: int, block_size: int, cu_seqlens: list[int] | None,
                         device: torch.device) -> torch.Tensor:
    """`[T]` int64: the query block of each token. Blocks hold block_size tokens; with `cu_seqlens`
    they restart at every sequence and are numbered sequence after sequence (an empty sequence owns
    none), so sequence i's blocks follow the num_query_blocks of the sequences before it."""
    if cu_seqlens is None:
        return torch.div(torch.arange(t_len, device=device), block_size, rounding_mode="floor")
    pieces, first = [], 0
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        pieces.append(first + torch.div(torch.arange(end - start, device=device), block_size, rounding_mode="floor"))
        first += -(-(end - start) // block_size)
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def blocks_to_tokens(x: torch.Tensor, query_block: torch.Tensor) -> torch.Tensor:
    """Per-query-block `[B, H, NQB, ...]` -> per-token `[B, T, H, ...]`: token t takes the row of its
    query block query_block[t] (see query_block_of_token). Dtype and device kept."""
    return x.transpose(1, 2).index_select(1, query_block)


def mean_pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[L, H, D]` -> `[ceil(L / block_size), H, D]` block means (zero-padded last block)."""
    length, h, d = x.shape
    nb = -(-length // block_size)
    pad = nb * block_size - length
    if pad:
        x = torch.cat([x, x.new_zeros(pad, h, d)], dim=0)
    return x.reshape(nb, block_size, h, d).mean(dim=1)


def _compressed_branch(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, block_size: int,
                       scale: float, num_select: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: compressed attention `[L, HQ, Dv]` and the selected block ids `[L, H, num_select]`."""
    length, hq, d = q.shape
    nb, h, dv = k_cmp.shape[0], k_cmp.shape[1], v_cmp.shape[-1]
    g = hq // h
    keys = k_cmp.permute(1, 0, 2).unsqueeze(0)                              # (1, H, NB, D)
    values = v_cmp.permute(1, 0, 2).unsqueeze(0)
    blocks = torch.arange(nb, device=q.device)
    outs, selections = [], []
    step = rows_per_chunk(hq * nb * 3 + hq * dv)
    for r0 in range(0, length, step):
        r1 = min(r0 + step, length)
        t = torch.arange(r0, r1, device=q.device)
        q_c = q[r0:r1].reshape(r1 - r0, h, g, d)
        scores = torch.matmul(q_c, keys.transpose(-1, -2)) * scale           # (C, H, G, NB)
        complete = (blocks < torch.div(t + 1, block_size, rounding_mode="floor").unsqueeze(-1))[:, None, None, :]
        p, lse = _masked_softmax(scores, complete)
        outs.append(torch.matmul(p, values).reshape(r1 - r0, hq, dv))
        with torch.no_grad():  # block selection: indices, no gradient
            own = torch.div(t, block_size, rounding_mode="floor")[:, None, None, None]
            lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            prob = torch.exp(scores.detach() - lse_safe.unsqueeze(-1))
            prob = torch.where(blocks < own, prob, torch.zeros_like(prob))
            prob = torch.where(blocks == own, torch.ones_like(prob), prob)
            importance = prob.sum(dim=2)                                       # (C, H, NB)
            importance = importance.masked_fill(blocks > own[:, :, 0], -_INF)
            # Stable sort of the block-reversed scores: equal scores go to the larger block id.
            order = torch.sort(importance.flip(-1), dim=-1, descending=True, stable=True).indices
            chosen = (nb - 1 - order)[..., :num_select]
            chosen = torch.where(chosen <= own[:, :, 0], chosen, -1)
            if chosen.shape[-1] < num_select:
                chosen = torch.cat([chosen, chosen.new_full((*chosen.shape[:-1], num_select - chosen.shape[-1]), -1)], -1)
            selections.append(chosen)
    if not outs:
        return q.new_zeros(0, hq, dv), torch.zeros(0, h, num_select, dtype=torch.long, device=q.device)
    return torch.cat(outs), torch.cat(selections)


def _selected_branch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                     block_counts: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """One sequence: selected-block attention `[L, HQ, Dv]`; block_indices `[L, H, S]`, counts `[L, H]`."""
    length, hq, d = q.shape
    h, dv, s = k.shape[1], v.shape[-1], block_indices.shape[-1]
    g = hq // h
    if length == 0 or s == 0:
        return q.new_zeros(length, hq, dv)
    nb = -(-length // block_size)
    k_h, v_h = k.transpose(0, 1), v.transpose(0, 1)                           # (H, L, D)
    head = torch.arange(h, device=q.device)[None, :, None]
    offsets = torch.arange(block_size, device=q.device)
    slots = torch.arange(s, device=q.device)
    outs = []
    step = rows_per_chunk(h * s * block_size * (d + dv + 2 * g))
    for r0 in range(0, length, step):
        r1 = min(r0 + step, length)
        t = torch.arange(r0, r1, device=q.device)[:, None, None, None]
        ids = block_indices[r0:r1].long()                                     # (C, H, S)
        slot_ok = (ids >= 0) & (ids < nb) & (slots < block_counts[r0:r1].long().unsqueeze(-1))
        tok = ids.unsqueeze(-1) * block_size + offsets                        # (C, H, S, bs)
        tok_ok = (slot_ok.unsqueeze(-1) & (tok <= t)).reshape(r1 - r0, h, s * block_size)
        safe = torch.where(tok_ok, tok.reshape(r1 - r0, h, -1), 0)
        keys = k_h[head, safe]                                                # (C, H, N, D)
        values = torch.where(tok_ok.unsqueeze(-1), v_h[head, safe], 0)
        q_c = q[r0:r1].reshape(r1 - r0, h, g, d)
        scores = torch.matmul(q_c, keys.transpose(-1, -2)) * scale            # (C, H, G, N)
        p, _ = _masked_softmax(scores, tok_ok.unsqueeze(2))
        outs.append(torch.matmul(p, values).reshape(r1 - r0, hq, dv))
    return torch.cat(outs)


def native_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            g_cmp: torch.Tensor | None = None, g_slc: torch.Tensor | None = None,
                            block_indices: torch.Tensor | None = None, block_counts: int | torch.Tensor = 16,
                            cu_seqlens: torch.Tensor | None = None, *, softmax_scale: float | None = None,
                            block_size: int = 64) -> torch.Tensor:
    """NSA forward (no validation; see dsagen.ops.nsa). Returns `[B, T, HQ, Dv]` in query.dtype.

    With g_cmp the compressed branch selects the blocks and block_indices is not read. A tensor
    block_counts `[B, T, H]` gives per-token counts; with g_cmp the selection width is its maximum and
    each token keeps its first block_counts[b, t, h] (highest-scoring) blocks. With cu_seqlens `[N+1]`
    (B = 1) each sequence is independent: positions, blocks and block_indices are sequence-local.
    """
    b, t_len, hq, d = query.shape
    h = key.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    acc = acc_dtype(query.dtype)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if isinstance(block_counts, int):
        counts = torch.full((b, t_len, h), block_counts, dtype=torch.long, device=query.device)
        num_select = block_counts
    else:
        counts = block_counts.long()
        num_select = int(counts.max()) if counts.numel() else 0

    if cu_seqlens is None:
        segments = [(bi, 0, t_len) for bi in range(b)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        segments = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]

    pieces = []
    for bi, start, end in segments:
        qs, ks, vs = q[bi, start:end], k[bi, start:end], v[bi, start:end]
        if g_cmp is not None:
            o_cmp, selected = _compressed_branch(qs, mean_pool_blocks(ks, block_size),
                                                 mean_pool_blocks(vs, block_size), block_size, scale, num_select)
        else:
            o_cmp, selected = None, block_indices[bi, start:end]
        o = _selected_branch(qs, ks, vs, selected, counts[bi, start:end], block_size, scale)
        if g_slc is not None:
            o = o * g_slc[bi, start:end].to(acc).unsqueeze(-1)
        if o_cmp is not None:
            o = o + o_cmp * g_cmp[bi, start:end].to(acc).unsqueeze(-1)
        pieces.append(o)
    if cu_seqlens is None:
        out = torch.stack(pieces) if pieces else q.new_zeros(0, t_len, hq, value.shape[-1])
    else:
        out = torch.cat(pieces).unsqueeze(0)
    return out.to(query.dtype)
