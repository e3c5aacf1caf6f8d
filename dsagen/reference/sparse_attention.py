"""Plain-PyTorch reference of DeepSeek sparse attention (cuDNN frontend DSA §1, §2, §7, §8; DeepSeek-V4 inference kernel).

Flat MQA layout (cuDNN frontend DSA): queries `q (S_q, H, D_qk)`, one shared latent `kv (S_kv, D_qk)` that is both
K (all D_qk columns) and V (its first `d_v` columns), and per-query global top-k ids
`topk_idxs (S_q, K)`. For query row t, head h and valid slot j:

    s[t, h, j]  = softmax_scale * dot(q[t, h, :], kv[topk_idxs[t, j], :])
    lse[t, h]   = logsumexp_j s[t, h, j]                    (KV-only: the sink is not included)
    L[t, h]     = logaddexp(lse[t, h], attn_sink[h])        (the sink joins the denominator only)
    P[t, h, j]  = exp(s[t, h, j] - L[t, h])
    out[t, h]   = sum_j P[t, h, j] * kv[topk_idxs[t, j], :d_v]

A slot is valid when its id is in [0, S_kv) and its position is below topk_length[t] (when given).
Invalid slots score -inf and are never read (their gathered rows are zeroed, so non-finite KV rows
behind an invalid slot cannot leak NaN); duplicate ids stay distinct softmax slots. A row without a
valid slot gives out = 0, lse = +inf and max_logits = -inf.

Everything is chunked over query rows (`CHUNK_ELEMENTS` bounds the gathered rows plus the score
tile per chunk) and uses batched matrix products, so it doubles as the plain-PyTorch peer at model
sizes. FP16/BF16/FP32 inputs accumulate in FP32; FP64 stays FP64. Works on CPU and CUDA tensors.
"""

from __future__ import annotations

import math

import torch

from .indexer import cat_segment_rows, max_key_len, pad_width, segment_offsets, thd_segments

# Upper bound on the elements of one chunk's gathered KV rows plus its score tile (accumulation
# dtype): 2**26 FP32 elements = 256 MiB. Tests lower it to exercise the chunking.
CHUNK_ELEMENTS = 1 << 26

_INF = float("inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the reference: FP64 for FP64 inputs, FP32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_d_v(d_qk: int) -> int:
    """V width when the caller gives none: 512 for the MLA latent (D_qk = 576 = 512 + 64 RoPE
    columns, cuDNN frontend DSA §1), otherwise D_qk (K = V, DeepSeek-V4 inference kernel)."""
    return 512 if d_qk == 576 else d_qk


def default_softmax_scale(d_qk: int) -> float:
    """1 / sqrt(D_qk), the default of cuDNN frontend DSA and the DeepSeek-V4 inference kernel (over all D_qk columns, RoPE included)."""
    return 1.0 / math.sqrt(d_qk)


def rows_per_chunk(per_row_elements: int, budget: int | None = None) -> int:
    """How many query rows fit one chunk when each row needs `per_row_elements` temporaries."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    return max(1, budget // max(1, per_row_elements))


def slot_validity(topk_idxs: torch.Tensor, num_kv: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """Bool `(rows, K)`: id in [0, num_kv) and slot position < clamp(topk_length, 0, K)."""
    idx = topk_idxs.long()
    valid = (idx >= 0) & (idx < num_kv)
    if topk_length is not None:
        k = idx.shape[-1]
        lens = topk_length.long().clamp(0, k)
        valid &= torch.arange(k, device=idx.device) < lens.unsqueeze(-1)
    return valid


def _padded(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv in `dtype` with one extra all-zero row at the end: invalid slots gather that row, so a
    single gather pass yields zeros there (and never reads a real, possibly non-finite, row)."""
    return torch.cat([kv.to(dtype), kv.new_zeros(1, kv.shape[-1], dtype=dtype)])


def _gather(kv_padded: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
    """Rows of `_padded(kv)` at `idx` as `(rows, K, D)`, zero at invalid slots, plus the ids used
    (the zero row's id, len(kv), at invalid slots)."""
    safe = torch.where(valid, idx.long(), kv_padded.shape[0] - 1)
    return kv_padded[safe], safe


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sparse_attention_forward(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                             attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                             softmax_scale: float | None = None, d_v: int | None = None,
                             indexer_topk: int | None = None) -> tuple:
    """Sparse MQA forward on the flat layout (no validation; see dsagen.ops.sparse_attention).

    Shapes: q `(S_q, H, D_qk)`, kv `(S_kv, D_qk)`, topk_idxs `(S_q, K)` integer global ids,
    attn_sink `(H,)` or None (= a sink of -inf), topk_length `(S_q,)` or None.
    Returns out `(S_q, H, d_v)` in q.dtype, lse `(S_q, H)` and max_logits `(S_q, H)` in FP32
    (FP64 for FP64 inputs). max_logits is the largest valid scaled score s (sink excluded).

    indexer_topk: None (default) returns the three values above. An int N >= 0 returns a fourth,
    lse_indexer (cuDNN frontend DSA §1 Sparse Attention Forward's indexer prefix): lse restricted to
    the valid slots at positions j < N (so j < min(N, topk_length[t])), `(S_q, H)` in lse's dtype,
    +inf where the prefix holds no valid slot; None for N = 0. N >= K gives lse itself.
    """
    s_q, h, d_qk = q.shape
    s_kv, k = kv.shape[0], topk_idxs.shape[-1]
    d_v = default_d_v(d_qk) if d_v is None else d_v
    scale = default_softmax_scale(d_qk) if softmax_scale is None else float(softmax_scale)
    acc, stats = acc_dtype(q.dtype), _stats_dtype(q.dtype)

    out = torch.zeros(s_q, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((s_q, h), _INF, dtype=stats, device=q.device)
    max_logits = torch.full((s_q, h), -_INF, dtype=stats, device=q.device)
    # the indexer prefix: positions [0, n) of each row; n = 0 is no prefix, n = K is lse itself
    n = None if indexer_topk is None else min(int(indexer_topk), k)
    lse_prefix = None if not n or n == k else torch.full((s_q, h), _INF, dtype=stats, device=q.device)

    def result():
        if n is None:
            return out, lse, max_logits
        return out, lse, max_logits, (lse.clone() if n and n == k else lse_prefix)

    if s_q == 0 or k == 0:
        return result()
    sink = None if attn_sink is None else attn_sink.to(acc)
    kv_padded = _padded(kv, acc)

    step = rows_per_chunk(k * (d_qk + 2 * h))
    for r0 in range(0, s_q, step):
        r1 = min(r0 + step, s_q)
        idx = topk_idxs[r0:r1]
        valid = slot_validity(idx, s_kv, None if topk_length is None else topk_length[r0:r1])
        rows, _ = _gather(kv_padded, idx, valid)                                 # (C, K, D_qk)
        scores = torch.bmm(q[r0:r1].to(acc), rows.transpose(1, 2)).mul_(scale)  # (C, H, K)
        scores.masked_fill_(~valid.unsqueeze(1), -_INF)
        if lse_prefix is not None:                                              # before scores turn into e
            lse_prefix[r0:r1] = _masked_lse(scores[:, :, :n]).to(stats)
        m = scores.amax(dim=-1)                                                 # (C, H)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = scores.sub_(m_safe.unsqueeze(-1)).exp_()                            # invalid -> 0
        sumexp = e.sum(dim=-1)
        lse_c = torch.where(sumexp > 0, m_safe + torch.log(sumexp), torch.full_like(m, _INF))
        total = lse_c if sink is None else torch.logaddexp(lse_c, sink)
        # exp(m - L) <= 1/sumexp never overflows; it is 0 for empty rows (L = +inf).
        o = torch.bmm(e, rows[:, :, :d_v]) * torch.exp(m_safe - total).unsqueeze(-1)
        out[r0:r1] = o.to(q.dtype)
        lse[r0:r1] = lse_c.to(stats)
        max_logits[r0:r1] = m.to(stats)
    return result()


def _masked_lse(scores: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of scores whose invalid entries are -inf; +inf where none is valid (the
    convention of lse). Its own max, so a prefix far below the row's maximum does not underflow."""
    m = scores.amax(dim=-1)
    finite = torch.isfinite(m)
    m_safe = torch.where(finite, m, torch.zeros_like(m))
    sumexp = (scores - m_safe.unsqueeze(-1)).exp_().sum(dim=-1)
    return torch.where(sumexp > 0, m_safe + torch.log(sumexp), torch.full_like(m, _INF))


def sparse_attention_backward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                              lse: torch.Tensor, attn_sink: torch.Tensor | None, topk_idxs: torch.Tensor, *,
                              topk_length: torch.Tensor | None = None, softmax_scale: float | None = None,
                              d_v: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sparse MQA backward (cuDNN frontend DSA §2): `(dq, dkv, d_sink)` from the forward's out and KV-only lse.

    With L = logaddexp(lse, sink) (the sink-aware normalizer, recomputed here because the forward's
    lse excludes the sink), P = exp(s - L), p_sink = exp(sink - L) and delta = sum_d out * dout:

        dP      = dout . V_j                 dS = P * (dP - delta)
        dq      = scale * sum_j dS_j K_j     dkv[id_j] += scale * sum_h dS_j q_h  (+ sum_h P_j dout_h
                                                           on the first d_v columns)
        d_sink  = -sum_t p_sink[t] * delta[t]   (d out / d sink = -p_sink * out)

    Shapes as in sparse_attention_forward; out/dout `(S_q, H, d_v)`. Returns dq in q.dtype, dkv in
    kv.dtype, d_sink in attn_sink.dtype (None without a sink). Invalid slots get no gradient; rows
    with lse = +inf (empty) contribute nothing.
    """
    s_q, h, d_qk = q.shape
    s_kv, k = kv.shape[0], topk_idxs.shape[-1]
    d_v = default_d_v(d_qk) if d_v is None else d_v
    scale = default_softmax_scale(d_qk) if softmax_scale is None else float(softmax_scale)
    acc = acc_dtype(q.dtype)

    dq = torch.zeros(s_q, h, d_qk, dtype=acc, device=q.device)
    dkv = torch.zeros(s_kv + 1, d_qk, dtype=acc, device=q.device)  # + the zero row's sink
    sink = None if attn_sink is None else attn_sink.to(acc)
    d_sink = None if sink is None else torch.zeros_like(sink)
    kv_padded = _padded(kv, acc)

    step = rows_per_chunk(k * (2 * d_qk + 4 * h)) if k else s_q
    for r0 in range(0, s_q, max(step, 1)):
        r1 = min(r0 + step, s_q)
        idx = topk_idxs[r0:r1]
        valid = slot_validity(idx, s_kv, None if topk_length is None else topk_length[r0:r1])
        rows, safe = _gather(kv_padded, idx, valid)
        q_c, do_c = q[r0:r1].to(acc), dout[r0:r1].to(acc)
        delta = (out[r0:r1].to(acc) * do_c).sum(dim=-1)                          # (C, H)
        total = lse[r0:r1].to(acc)
        if sink is not None:
            total = torch.logaddexp(total, sink)
            d_sink -= (torch.exp(sink - total) * delta).sum(dim=0)
        if k == 0:
            continue
        scores = torch.bmm(q_c, rows.transpose(1, 2)).mul_(scale)
        scores.masked_fill_(~valid.unsqueeze(1), -_INF)
        p = torch.exp(scores - total.unsqueeze(-1))
        p.masked_fill_(~valid.unsqueeze(1), 0)                                   # (C, H, K)
        dp = torch.bmm(do_c, rows[:, :, :d_v].transpose(1, 2))
        ds = p * (dp - delta.unsqueeze(-1))
        dq[r0:r1] = torch.bmm(ds, rows).mul_(scale)
        d_rows = torch.bmm(ds.transpose(1, 2), q_c).mul_(scale)                  # (C, K, D_qk)
        d_rows[:, :, :d_v] += torch.bmm(p.transpose(1, 2), do_c)
        dkv.index_add_(0, safe.reshape(-1), d_rows.reshape(-1, d_qk))  # invalid slots land in the pad row
    return (dq.to(q.dtype), dkv[:s_kv].to(kv.dtype),
            None if d_sink is None else d_sink.to(attn_sink.dtype))


def sparse_attn_score_recompute(q_attn: torch.Tensor, k_attn: torch.Tensor, lse: torch.Tensor,
                                topk_indices: torch.Tensor, softmax_scale: float, *,
                                topk_length: torch.Tensor | None = None,
                                topk_indices_global: bool = False) -> torch.Tensor:
    """cuDNN frontend DSA §7: L1-normalised, head-summed attention probabilities over the top-k slots.

        P[b, t, h, i]  = exp(softmax_scale * q_attn[b, t, h] . k[id(b, t, i)] - lse[b, t, h])
        S[b, t, i]     = sum_h P[b, t, h, i]         (0 at invalid slots)
        target[b, t, i] = S[b, t, i] / sum_i S[b, t, i]   (all zeros when that sum is 0)

    q_attn `(B, S_q, H, D)`, k_attn `(B, S_k, D)`, lse `(B, S_q, H)`, topk_indices `(B, S_q, topk)`
    local ids in [0, S_k) (or, with topk_indices_global, flat ids b' * S_k + local into the
    flattened `(B * S_k, D)` keys), topk_length `(B, S_q)` or None. Returns `(B, S_q, topk)` FP32
    (FP64 for FP64 inputs).
    """
    b, s_q, h, d = q_attn.shape
    s_k, topk = k_attn.shape[1], topk_indices.shape[-1]
    acc = acc_dtype(q_attn.dtype)
    target = torch.zeros(b, s_q, topk, dtype=acc, device=q_attn.device)
    if b * s_q == 0 or topk == 0:
        return target
    q_flat = q_attn.reshape(b * s_q, h, d)
    lse_flat = lse.reshape(b * s_q, h).to(acc)
    ids = topk_indices.reshape(b * s_q, topk).long()
    lengths = None if topk_length is None else topk_length.reshape(b * s_q)
    keys, num_keys = _padded(k_attn.reshape(b * s_k, d), acc), b * s_k
    if not topk_indices_global:
        # Local ids: range-check against S_k before adding the batch offset, so no id aliases a
        # neighbouring batch.
        in_range = (ids >= 0) & (ids < s_k)
        batch_of_row = torch.arange(b, device=ids.device).repeat_interleave(s_q)
        ids = torch.where(in_range, ids + batch_of_row.unsqueeze(-1) * s_k, -1)
    flat_target = target.view(b * s_q, topk)

    step = rows_per_chunk(topk * (d + 2 * h))
    for r0 in range(0, b * s_q, step):
        r1 = min(r0 + step, b * s_q)
        valid = slot_validity(ids[r0:r1], num_keys, None if lengths is None else lengths[r0:r1])
        rows, _ = _gather(keys, ids[r0:r1], valid)
        scores = torch.bmm(q_flat[r0:r1].to(acc), rows.transpose(1, 2)).mul_(softmax_scale)
        p = torch.exp(scores - lse_flat[r0:r1].unsqueeze(-1))
        p = torch.where(valid.unsqueeze(1), p, torch.zeros_like(p))
        head_sum = p.sum(dim=1)                                                  # (C, topk)
        z = head_sum.sum(dim=-1, keepdim=True)
        flat_target[r0:r1] = torch.where(z > 0, head_sum / torch.where(z > 0, z, 1), 0)
    return target


def ratio_causal_limit(s_q: int, s_k: int, ratio: int, q_causal_offsets: torch.Tensor | None,
                       batch: int, device: torch.device) -> torch.Tensor:
    """`(B, S_q)` count of visible KV columns: clamp((offset[b] + t + 1) // ratio, 0, S_k) (cuDNN frontend DSA §3)."""
    t = torch.arange(s_q, device=device, dtype=torch.long).unsqueeze(0).expand(batch, s_q)
    if q_causal_offsets is not None:
        t = t + q_causal_offsets.long().to(device).unsqueeze(-1)
    return torch.div(t + 1, ratio, rounding_mode="floor").clamp(0, s_k)


def dense_attn_score_recompute(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, *,
                               ratio: int = 1, q_causal_offsets: torch.Tensor | None = None,
                               cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN frontend DSA §8: raw head-summed attention probabilities over the full KV, ratio-causal masked.

        out[b, t, s] = sum_h exp(softmax_scale * q[b, t, h] . k[b, s, h // G] - lse[b, t, h])
                       for s < clamp((q_causal_offsets[b] + t + 1) // ratio, 0, S_k), else -inf
        denom[b, t]  = sum over unmasked s of out[b, t, s]      (the L1 norm; 0 for a fully masked row)

    q `(B, S_q, H_q, D)`, k `(B, S_k, H_kv, D)` with G = H_q // H_kv, lse `(B, S_q, H_q)`,
    q_causal_offsets `(B,)` or None (zeros). Returns out `(B, S_q, S_k)` and denom `(B, S_q)`,
    FP32 (FP64 for FP64 inputs).

    Packed THD (cu_seqlens_q / cu_seqlens_k `(B + 1,)` given): q `(total_q, H_q, D)`, k `(total_k, H_kv, D)`,
    lse `(total_q, H_q)`; the offsets are read on the host and the BSHD math runs per segment. Returns out
    `(total_q, max_seqlen_k)` with columns local to the row's segment (-inf past its length) and denom
    `(total_q,)`; rows after cu_seqlens_q[-1] are fully masked (out -inf, denom 0).
    """
    if cu_seqlens_q is not None:
        return _dense_attn_score_recompute_thd(q, k, lse, softmax_scale, ratio, q_causal_offsets, cu_seqlens_q,
                                               cu_seqlens_k)
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    g = h_q // h_kv
    acc = acc_dtype(q.dtype)
    out = torch.full((b, s_q, s_k), -_INF, dtype=acc, device=q.device)
    limit = ratio_causal_limit(s_q, s_k, ratio, q_causal_offsets, b, q.device)  # (B, S_q)
    cols = torch.arange(s_k, device=q.device)
    k_t = k.to(acc).permute(0, 2, 3, 1)                                          # (B, H_kv, D, S_k)
    step = rows_per_chunk(s_k * 2 * h_q + h_q * d)
    for bi in range(b):
        for r0 in range(0, s_q, step):
            r1 = min(r0 + step, s_q)
            q_c = q[bi, r0:r1].to(acc).reshape(r1 - r0, h_kv, g, d).transpose(0, 1)  # (H_kv, C, G, D)
            q_c = q_c.reshape(h_kv, (r1 - r0) * g, d)
            scores = torch.bmm(q_c, k_t[bi]).mul_(softmax_scale)                 # (H_kv, C*G, S_k)
            scores = scores.reshape(h_kv, r1 - r0, g, s_k).permute(1, 0, 2, 3).reshape(r1 - r0, h_q, s_k)
            p = torch.exp(scores - lse[bi, r0:r1].to(acc).unsqueeze(-1)).sum(dim=1)  # (C, S_k)
            visible = cols < limit[bi, r0:r1].unsqueeze(-1)
            out[bi, r0:r1] = torch.where(visible, p, -_INF)
    denom = torch.where(torch.isfinite(out), out, 0).sum(dim=-1)
    return out, denom


def _dense_attn_score_recompute_thd(q, k, lse, softmax_scale, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    """THD dense_attn_score_recompute: the BSHD function per segment (B = 1)."""
    acc, total_q = acc_dtype(q.dtype), q.shape[0]
    segments = thd_segments(cu_seqlens_q, cu_seqlens_k)
    width = max_key_len(segments)
    outs, denoms = [], []
    for i, (q0, q1, k0, k1) in enumerate(segments):
        out, denom = dense_attn_score_recompute(q[None, q0:q1], k[None, k0:k1], lse[None, q0:q1], softmax_scale,
                                                ratio=ratio, q_causal_offsets=segment_offsets(q_causal_offsets, i))
        outs.append(pad_width(out[0], width, -_INF))
        denoms.append(denom[0])
    return (cat_segment_rows(outs, total_q, -_INF, (width,), acc, q.device),
            cat_segment_rows(denoms, total_q, 0.0, (), acc, q.device))
