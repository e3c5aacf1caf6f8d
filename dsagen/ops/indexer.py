"""Indexer scoring and top-k from cuDNN frontend DSA (§3 Indexer Forward, §4 Combined Indexer Forward +
Top-K, §5 Indexer Top-K): dsagen.indexer_scores, dsagen.indexer_topk, dsagen.indexer_forward_topk.

Layouts: BSHD (cuDNN frontend DSA's primary layout) and, for indexer_scores and indexer_forward_topk, the packed THD
layout of cuDNN frontend DSA §3/§4, selected by passing cu_seqlens_q / cu_seqlens_k. indexer_topk works on rows and
needs no layout. The default impl is "fused" as for every dsagen op: the generated kernel, with no silent
fallback to the reference (the fused indexer_scores and indexer_forward_topk take both layouts).
"""

from __future__ import annotations

import torch

from ..reference.indexer import (IndexerTopK, TopK, accumulate_dtype, dequantize_fp8, max_key_len,
                                 staggered_row_lengths, thd_segments)
from ..validate import (FLOAT_DTYPES, check_bool, check_contiguous, check_cu_seqlens_pair, check_impl, check_int,
                        check_shape, check_tensor, check_topk)
from ._fast_path import FastPaths, call_signature, eager_call

__all__ = ["indexer_scores", "indexer_topk", "indexer_forward_topk", "TopK", "IndexerTopK"]


#: indexer_scores' and indexer_forward_topk's plans of eager BSHD calls by signature (dsagen.ops._fast_path)
_SCORES_FAST = FastPaths("indexer_scores")
_FORWARD_TOPK_FAST = FastPaths("indexer_forward_topk")

#: q_indexer / k_indexer dtype of indexer_scores(precision="fp8")
FP8_DTYPES = (torch.float8_e4m3fn,)


def _check_triple(q, k, w, names: tuple[str, str, str], k_ndims: tuple[int, ...], rows: str,
                  qk_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> tuple[int, int]:
    """The checks both indexer layouts share, after the caller checked q's rank: q's last two dims are (H, D);
    k has k_ndims dims, q's dtype and, when it has as many dims as q, a 1-sized head dim before D (MQA);
    weights have one dim less than q. Returns (H, D). `rows`: k's leading dims' names, for the messages."""
    qn, kn, wn = names
    check_tensor(kn, k, dtypes=qk_dtypes, ndim=k_ndims, device=q.device)
    check_tensor(wn, w, dtypes=FLOAT_DTYPES, ndim=q.dim() - 1, device=q.device)
    if k.dtype != q.dtype:
        raise TypeError(f"{kn} must have the same dtype as {qn} ({q.dtype}), got {k.dtype}")
    h, d = q.shape[-2], q.shape[-1]
    if h < 1 or d < 1:
        raise ValueError(f"{qn} must have H >= 1 heads and head dimension D >= 1, got shape {tuple(q.shape)}")
    if k.dim() == q.dim() and k.shape[-2] != 1:
        raise ValueError(f"{kn} must have H_kv = 1 (MQA): shape [{rows}, 1, D], got {tuple(k.shape)}")
    return h, d


def check_indexer_inputs(q, k, w, names: tuple[str, str, str] = ("q_indexer", "k_indexer", "weights"),
                         allow_4d_k: bool = True, qk_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
                         ) -> tuple[int, int, int, int, int]:
    """Validate the indexer triple; returns (B, S_q, H, D, S_k).

    q [B, S_q, H, D] and k ([B, S_k, D], or [B, S_k, 1, D] when allow_4d_k) share a floating dtype
    (fp16/bf16/fp32/fp64); weights [B, S_q, H] may have any of those dtypes; all on q's device.
    """
    check_tensor(names[0], q, dtypes=qk_dtypes, ndim=4)
    h, d = _check_triple(q, k, w, names, (3, 4) if allow_4d_k else (3,), "B, S_k", qk_dtypes)
    b, sq = q.shape[:2]
    if k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"{names[1]} must have shape [B={b}, S_k, D={d}], got {tuple(k.shape)}")
    check_shape(names[2], w, (b, sq, h), "[B, S_q, H]")
    return b, sq, h, d, k.shape[1]


def check_packed_indexer_inputs(q, k, w, cu_seqlens_q, cu_seqlens_k,
                                names: tuple[str, str, str] = ("q_indexer", "k_indexer", "weights"),
                                allow_3d_k: bool = True, qk_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
                                ) -> tuple[int, int, int, int, int]:
    """Validate the THD indexer triple and its offsets; returns (B, total_q, H, D, total_k).

    q [total_q, H, D] and k ([total_k, D], or [total_k, 1, D] when allow_3d_k) share a floating dtype;
    weights [total_q, H]; all on q's device. cu_seqlens_q / cu_seqlens_k: see check_cu_seqlens_pair
    (their values are read on the host).
    """
    check_tensor(names[0], q, dtypes=qk_dtypes, ndim=3)
    h, d = _check_triple(q, k, w, names, (2, 3) if allow_3d_k else (2,), "total_k", qk_dtypes)
    total_q = q.shape[0]
    if k.shape[-1] != d:
        raise ValueError(f"{names[1]} must have shape [total_k, D={d}], got {tuple(k.shape)}")
    check_shape(names[2], w, (total_q, h), "[total_q, H]")
    b = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q=total_q, total_k=k.shape[0], device=q.device)
    return b, total_q, h, d, k.shape[0]


def is_packed(cu_seqlens_q, cu_seqlens_k) -> bool:
    """THD layout: either offset tensor was passed (check_cu_seqlens_pair then requires both)."""
    return cu_seqlens_q is not None or cu_seqlens_k is not None


def int32_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """THD offsets as the fused kernels take them: contiguous int32 (the ops accept int32 or int64)."""
    return cu_seqlens.to(torch.int32).contiguous()


def check_causal_offsets(q_causal_offsets, batch: int, device: torch.device) -> None:
    """q_causal_offsets: None or a [B] int32 tensor on `device`."""
    if q_causal_offsets is None:
        return
    check_tensor("q_causal_offsets", q_causal_offsets, dtypes=(torch.int32,), ndim=1, device=device)
    if q_causal_offsets.numel() != batch:
        raise ValueError(f"q_causal_offsets must have one entry per batch (B = {batch}), "
                         f"got shape {tuple(q_causal_offsets.shape)}")


def check_dense_inputs(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                       qk_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> tuple[int, bool, dict]:
    """The checks every dense cuDNN-frontend-DSA indexer op shares (BSHD or THD inputs, ratio, q_causal_offsets).
    Returns (batch or segment count, whether the layout is THD, the THD kwargs for the reference).
    qk_dtypes: the dtypes q_indexer and k_indexer may have (FP8_DTYPES for indexer_scores(precision="fp8"))."""
    packed = is_packed(cu_seqlens_q, cu_seqlens_k)
    if packed:
        b, *_ = check_packed_indexer_inputs(q_indexer, k_indexer, weights, cu_seqlens_q, cu_seqlens_k,
                                            qk_dtypes=qk_dtypes)
    else:
        b, *_ = check_indexer_inputs(q_indexer, k_indexer, weights, qk_dtypes=qk_dtypes)
    check_int("ratio", ratio, minimum=1)
    check_causal_offsets(q_causal_offsets, b, q_indexer.device)
    thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
    return b, packed, thd


def _scores_shape(q_indexer, k_indexer, packed: bool, thd: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(scores shape, lse shape): BSHD ([B, S_q, S_k], [B, S_q]); THD ([total_q, max_seqlen_k], [total_q]), where
    max_seqlen_k reads cu_seqlens_k on the host (thd_segments)."""
    if packed:
        width = max_key_len(thd_segments(thd["cu_seqlens_q"], thd["cu_seqlens_k"]))
        return (q_indexer.shape[0], width), (q_indexer.shape[0],)
    b, sq = q_indexer.shape[:2]
    return (b, sq, k_indexer.shape[1]), (b, sq)


def _check_output(name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A caller-owned output: a contiguous tensor of exactly `shape` and `dtype` on `device`."""
    check_tensor(name, t, dtypes=(dtype,), ndim=len(shape), device=device)
    check_shape(name, t, shape)
    check_contiguous(name, t)


def check_precision(precision: str, q_scale, k_scale) -> bool:
    """precision is "default" (the inputs' dtype) or "fp8"; the descales come with "fp8" only. Returns whether
    the call is FP8."""
    if precision not in ("default", "fp8"):
        raise ValueError(f"precision must be 'default' or 'fp8', got {precision!r}")
    fp8 = precision == "fp8"
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale)):
        if fp8 and t is None:
            raise ValueError(f"precision='fp8' needs {name} (FP32 descales)")
        if not fp8 and t is not None:
            raise ValueError(f"{name} is given but precision is {precision!r}; pass precision='fp8'")
    return fp8


def check_fp8_scales(q_indexer, k_indexer, weights, q_scale, k_scale) -> None:
    """The FP8 form's descales and weights: q_scale fp32 of q_indexer's shape without D ([B, S_q, H], THD
    [total_q, H]); k_scale fp32 of k_indexer's key dims ([B, S_k], THD [total_k]); weights bf16 or fp32; all on
    q_indexer's device. Values are not read (no host sync): they must be positive and finite, which the fused
    kernel's factored form (k_scale outside the ReLU) relies on."""
    check_tensor("weights", weights, dtypes=(torch.bfloat16, torch.float32), device=q_indexer.device)
    q_rows = tuple(q_indexer.shape[:-1])
    k_rows = tuple(k_indexer.shape[:-1])
    if k_indexer.dim() == q_indexer.dim():            # MQA keys [..., 1, D]: the scale has no head dim
        k_rows = k_rows[:-1]
    check_tensor("q_scale", q_scale, dtypes=(torch.float32,), ndim=len(q_rows), device=q_indexer.device)
    check_shape("q_scale", q_scale, q_rows, "q_indexer's shape without D")
    check_tensor("k_scale", k_scale, dtypes=(torch.float32,), ndim=len(k_rows), device=q_indexer.device)
    check_shape("k_scale", k_scale, k_rows, "k_indexer's key dims")


def _reference_scores(q_indexer, k_indexer, weights, ratio, q_causal_offsets, thd, out, lse_out, want_lse):
    """indexer_scores through the plain-PyTorch reference; copied into out / lse_out when given."""
    from ..reference.indexer import indexer_scores as reference

    scores = reference(q_indexer, k_indexer, weights, ratio=ratio, q_causal_offsets=q_causal_offsets, **thd)
    # torch.logsumexp of a row of -inf only is -inf: empty rows need no special case
    lse = scores.logsumexp(dim=-1) if want_lse else None
    if out is not None:
        scores = out.copy_(scores)
    if lse_out is not None:
        lse = lse_out.copy_(lse)
    return scores, lse


def _fused_scores(q_indexer, k_indexer, weights, ratio, q_causal_offsets, thd, out, lse_out, want_lse, shapes,
                  keep_plan=None, **scales):
    """indexer_scores through the fused kernels, which get int32 THD offsets and contiguous q_causal_offsets
    (scales: the FP8 form's q_scale / k_scale; keep_plan: the fast path's store, see indexer_scores)."""
    from ._fused import fused_impl

    fn = fused_impl("indexer_scores", q_indexer.device)
    cu_q = cu_k = None
    if thd:
        cu_q, cu_k = int32_offsets(thd["cu_seqlens_q"]), int32_offsets(thd["cu_seqlens_k"])
    offsets = None if q_causal_offsets is None else q_causal_offsets.contiguous()
    return fn(q_indexer, k_indexer, weights, ratio=ratio, q_causal_offsets=offsets, cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, out=out, lse=lse_out, return_lse=want_lse, shapes=shapes, keep_plan=keep_plan,
              **scales)


def indexer_scores(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, *, ratio: int = 1,
                   q_causal_offsets: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                   cu_seqlens_k: torch.Tensor | None = None, return_lse: bool = False,
                   out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                   impl: str = "fused", precision: str = "default", q_scale: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense indexer scores with the ratio-causal mask (cuDNN frontend DSA §3, Indexer Forward).

    ::

        scores[b, q, k] = sum_h relu(q_indexer[b, q, h, :] . k_indexer[b, k, :]) * weights[b, q, h]
        valid iff k < clamp((q_causal_offsets[b] + q + 1) // ratio, 0, S_k)     (offsets default to 0)
        lse[b, q]       = log(sum over the valid k of exp(scores[b, q, k]))       (-inf for a row without one)

    q_causal_offsets[b] is the global uncompressed token index of local query row 0 of batch (or THD
    segment) b, not a packed storage offset; the key columns are a compressed prefix starting at global
    column 0. The mask is always applied (cuDNN frontend DSA has no non-causal indexer forward).

    Packed THD layout (cuDNN frontend DSA §3), selected by passing cu_seqlens_q and cu_seqlens_k: segment b owns
    query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]);
    q, k and the mask (row q, column k and S_k above) are local to the segment, exactly as BSHD batch b.
    cu_seqlens_q only locates the rows; q_causal_offsets still places them on the causal timeline.

    impl="fused" (sm_90a): the lightning indexer's wgmma score kernel (its dense_scores form) writes each row's
    valid columns straight into the output and, from one otherwise idle warp, -inf to the masked ones; with the
    LSE one more pass reads the valid columns back (notes/kernels/indexer.md, "indexer_scores"). Limits (ValueError otherwise):
    bf16 / fp16 q_indexer and k_indexer, weights of the same dtype, H in (8, 16, 32, 64, 128), D in (64, 128),
    S_q and S_k (THD: total_q and total_k) <= 2**20, q / k readable by TMA (stride 1 in the last dim, 16-byte
    aligned base and outer strides). BSHD calls read nothing on the host and allocate only the outputs the caller
    did not pass: with out (and lse_out) given, a warmed-up call can be captured in a CUDA graph and allocates
    nothing. Sums over heads run in FP32 in another order than the reference's.

    precision="fp8" (cuDNN frontend DSA §3's SM90 FP8 path): q_indexer and k_indexer are float8_e4m3fn with FP32
    descales q_scale and k_scale, weights bf16 or fp32:

        scores[b, q, k] = sum_h weights[b, q, h] * relu(q_scale[b, q, h] * k_scale[b, k] * (q8[b, q, h, :] . k8[b, k, :]))

    The reference computes exactly this from the dequantized FP32 values. The fused kernel (D = 128, H in (16, 32,
    64, 128); QGMMA with FP32 accumulation) computes k_scale[b, k] * sum_h (weights * q_scale)[b, q, h] *
    relu(q8 . k8), equal for positive descales: the descales must be positive and finite (their values are never
    read on the host, so this is not checked; a zero, negative or non-finite descale gives another answer than the
    reference's). Its head sum runs on the tensor cores with relu(q8 . k8) and weights * q_scale rounded to bf16
    (FP32 accumulation): a relative 2**-9 per term, far below the E4M3 inputs' own rounding.

    Args:
        q_indexer: [B, S_q, H, D] (THD: [total_q, H, D]), fp16/bf16/fp32/fp64; H >= 1, D >= 1.
        k_indexer: [B, S_k, D] or [B, S_k, 1, D] (MQA) (THD: [total_k, D] or [total_k, 1, D]), same
            dtype as q_indexer.
        weights: [B, S_q, H] (THD: [total_q, H]), any of those float dtypes (impl="fused": q_indexer's).
        ratio: compression ratio, >= 1.
        q_causal_offsets: optional [B] int32 on q_indexer's device (THD: one entry per segment). Values
            are not read on the host; a negative offset simply leaves fewer (possibly zero) valid columns.
        cu_seqlens_q, cu_seqlens_k: THD offsets, both or neither; [B + 1] int32 or int64 on q_indexer's
            device, starting at 0, non-decreasing, ending at or before total_q / total_k (empty segments
            allowed). Their values are read on the host (validation, the output width and the per-segment
            split), so a THD call is not CUDA-graph capturable.
        return_lse: also return each row's logsumexp over its valid columns.
        out: optional caller-owned scores buffer: contiguous, the shape and dtype of the result (below). Every
            element is overwritten; it is returned.
        lse_out: optional caller-owned LSE buffer (needs return_lse=True): contiguous, [B, S_q] (THD:
            [total_q]) of the scores' dtype; returned as the LSE.
        impl: "fused" (default) or "reference".
        precision: "default" (the inputs' dtype) or "fp8" (float8_e4m3fn q_indexer / k_indexer, needs q_scale and
            k_scale; weights bf16 or fp32; scores FP32).
        q_scale: precision="fp8" only: FP32 [B, S_q, H] (THD: [total_q, H]) descales of q_indexer, any strides.
        k_scale: precision="fp8" only: FP32 [B, S_k] (THD: [total_k]) descales of k_indexer, any strides.

    Returns:
        scores [B, S_q, S_k], FP32 (FP64 for FP64 inputs); masked columns are -inf. THD: [total_q,
        max_seqlen_k] with max_seqlen_k = max_b (cu_seqlens_k[b+1] - cu_seqlens_k[b]); column j of a row
        of segment b is key row cu_seqlens_k[b] + j, columns j >= that segment's S_k are -inf, and rows
        at or after cu_seqlens_q[-1] (in no segment) are all -inf. With return_lse: (scores, lse), lse
        [B, S_q] (THD: [total_q]) of the scores' dtype, -inf for rows without a valid column.
        Differentiable with respect to q_indexer, k_indexer and weights in the reference (without out /
        lse_out); the fused path's outputs have no grad_fn.

    Raises:
        TypeError: a tensor of the wrong type or dtype (cu_seqlens not int32/int64; out / lse_out not the
            scores' dtype); ratio not an int; return_lse not a bool.
        ValueError: wrong ranks or shapes (out / lse_out included, or not contiguous), H_kv != 1,
            mismatched devices, ratio < 1, q_causal_offsets not [B]; cu_seqlens_q / cu_seqlens_k passed
            alone, not 1-D, empty, not starting at 0, decreasing, past the packed rows or with different
            segment counts; lse_out without return_lse; bad impl; impl="fused" on CPU or outside the fused
            kernels' limits above; precision not "default" / "fp8", q_scale / k_scale missing with "fp8" or given
            without it, or not of their shapes. (A q_indexer / k_indexer / weights / q_scale / k_scale dtype other
            than the precision's is a TypeError, as every dtype error.)
        NotImplementedError: impl="fused" where no kernel exists for the device.
    """
    key = None
    if impl == "fused" and cu_seqlens_q is None and cu_seqlens_k is None and eager_call(q_indexer):
        # BSHD reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q_indexer, k_indexer, weights, ratio, q_causal_offsets, return_lse, out, lse_out,
                             precision, q_scale, k_scale)
        plan = _SCORES_FAST.get(key)
        if plan is not None:
            scores, lse = plan(q_indexer, k_indexer, weights, q_causal_offsets, out, lse_out, q_scale, k_scale)
            return (scores, lse) if return_lse else scores
    check_impl(impl)
    fp8 = check_precision(precision, q_scale, k_scale)
    b, packed, thd = check_dense_inputs(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q,
                                        cu_seqlens_k, qk_dtypes=FP8_DTYPES if fp8 else FLOAT_DTYPES)
    if fp8:
        check_fp8_scales(q_indexer, k_indexer, weights, q_scale, k_scale)
    check_bool("return_lse", return_lse)
    if lse_out is not None and not return_lse:
        raise ValueError("lse_out is given but return_lse is False; pass return_lse=True to compute the LSE")
    shapes = None
    if out is not None or lse_out is not None or impl == "fused":
        shapes = _scores_shape(q_indexer, k_indexer, packed, thd)
        acc = torch.float32 if fp8 else accumulate_dtype(q_indexer, k_indexer, weights)
        if out is not None:
            _check_output("out", out, shapes[0], acc, q_indexer.device)
        if lse_out is not None:
            _check_output("lse_out", lse_out, shapes[1], acc, q_indexer.device)
    if impl == "reference":
        if fp8:
            q_indexer, k_indexer, weights = dequantize_fp8(q_indexer, k_indexer, weights, q_scale, k_scale)
        scores, lse = _reference_scores(q_indexer, k_indexer, weights, ratio, q_causal_offsets, thd, out, lse_out,
                                        return_lse)
    else:
        scales = dict(q_scale=q_scale, k_scale=k_scale) if fp8 else {}
        keep = None if key is None else (lambda plan: _SCORES_FAST.put(key, plan))
        scores, lse = _fused_scores(q_indexer, k_indexer, weights, ratio, q_causal_offsets, thd, out, lse_out,
                                    return_lse, shapes, keep_plan=keep, **scales)
    return (scores, lse) if return_lse else scores


def indexer_topk(input_values: torch.Tensor, seq_lens: torch.Tensor, top_k: int, *, return_values: bool = True,
                 next_n: int = 1, impl: str = "fused") -> TopK:
    """Per-row top-k with per-row effective lengths (cuDNN frontend DSA §5, Indexer Top-K).

    The n_rows rows are split into G = seq_lens.numel() consecutive groups of n_rows // G rows. Row r
    (of group g = r // (n_rows // G)) selects among its first

        clamp(seq_lens[g] - next_n + (r % next_n) + 1, 0, num_cols)

    columns. With next_n = 1 (the default) that is clamp(seq_lens[g], 0, num_cols) for every row of the
    group: G = n_rows gives one length per row (the common case); G = B with rows =
    scores.reshape(-1, S_k) gives one length per batch.

    next_n > 1 is the speculative-decoding stagger of the cuDNN kernel behind cuDNN frontend DSA §5 (the document
    text names only seq_lens; the stagger, its formula and the n_rows == G * next_n rule are the cuDNN
    frontend's IndexerTopK): each sequence g owns next_n consecutive query rows (the draft tokens),
    seq_lens[g] is the length seen by its last row, and each earlier row sees one column fewer, so row
    j = 0 .. next_n - 1 of the group sees seq_lens[g] - next_n + 1 + j columns. Choices where cuDNN is
    silent or leaves output undefined: the staggered length is clamped to [0, num_cols] after the
    stagger (a row whose length is <= 0 is an empty row: all -1 / -inf, where the cuDNN kernel leaves
    such rows unwritten), and lengths above num_cols read no further than num_cols. Lengths are never
    read on the host.

    Args:
        input_values: [n_rows, num_cols], fp16/bf16/fp32 (fp64 accepted by the reference).
        seq_lens: [G] int32 on the same device. next_n = 1: G >= 1 must divide n_rows (G = 0 only when
            n_rows = 0). next_n > 1: n_rows must equal G * next_n.
        top_k: >= 0 and <= 2**31 - 1; no other limit on either path (cuDNN's kernel stops at 2048); top_k >
            num_cols pads with -1.
        return_values: also return the selected values.
        next_n: rows per sequence for the speculative-decoding stagger, int >= 1 (default 1: no
            stagger, today's grouping). The fused path receives the staggered per-row lengths
            (G = n_rows), computed on the device.
        impl: "fused" (default) or "reference".

    Returns:
        TopK(indices, values): indices int32 [n_rows, top_k]; values [n_rows, top_k] in the input dtype,
        or None when return_values=False. Both paths select the same set: the top_k largest values, ties at
        the k-th value toward the lower column index. The reference orders a row by descending value (ties
        toward the lower index); the fused kernel (sm_90a, fp32/fp16/bf16, any top_k) returns the selected
        ids in ascending order, each with its value. Slots past the row's valid count hold index -1 and value
        -inf. NaN ordering is unspecified, and the fused path ranks -0.0 below +0.0 (bitwise order).

    Raises:
        TypeError: wrong tensor types or dtypes, top_k or next_n not an int, return_values not a bool.
        ValueError: wrong ranks, devices, top_k < 0 or > 2**31 - 1, outputs [n_rows, top_k] larger than
            the device's memory (the message names top_k and the size), next_n < 1, G not dividing n_rows (next_n = 1),
            n_rows != G * next_n (next_n > 1); bad impl; fused on CPU.
        NotImplementedError: impl="fused" where no kernel exists for the device.
    """
    check_impl(impl)
    check_tensor("input_values", input_values, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=input_values.device)
    check_bool("return_values", return_values)
    n_rows = input_values.shape[0]
    check_topk("top_k", top_k, (n_rows,), 4 + (input_values.element_size() if return_values else 0),
               input_values.device, what="int32 indices" + (f" and {input_values.dtype} values" if return_values else ""))
    check_int("next_n", next_n, minimum=1)
    groups = seq_lens.numel()
    if next_n > 1:
        if n_rows != groups * next_n:
            raise ValueError(f"next_n = {next_n} needs n_rows == seq_lens.numel() * next_n (one group of "
                             f"next_n rows per sequence), got n_rows = {n_rows} and {groups} seq_lens entries")
    elif (groups == 0 and n_rows != 0) or (groups != 0 and n_rows % groups != 0):
        raise ValueError(f"seq_lens must have a number of entries G that divides n_rows = {n_rows} "
                         f"(G = n_rows for one length per row), got {groups}")
    if impl == "reference":
        from ..reference.indexer import indexer_topk as reference

        return reference(input_values, seq_lens, top_k, return_values=return_values, next_n=next_n)
    from ._fused import fused_impl

    fn = fused_impl("indexer_topk", input_values.device)
    if next_n > 1:
        # The kernel contract is one length per group; the stagger becomes one length per row.
        seq_lens = staggered_row_lengths(seq_lens, n_rows, input_values.shape[1], next_n).to(torch.int32)
    return TopK(*fn(input_values, seq_lens, top_k, return_values=return_values))


def indexer_forward_topk(q_indexer: torch.Tensor, k_indexer: torch.Tensor, weights: torch.Tensor, top_k: int, *,
                         ratio: int = 1, q_causal_offsets: torch.Tensor | None = None, return_softmax: bool = True,
                         return_lse: bool = False, topk_indices_global: bool = True,
                         cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                         deterministic: bool = False, impl: str = "fused", precision: str = "default",
                         q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None) -> IndexerTopK:
    """Indexer scores, top-k and top-k softmax in one call (cuDNN frontend DSA §4, Combined Indexer Forward + Top-K).

    Scores and the ratio-causal mask are exactly indexer_scores' (precision="fp8" included); each row then keeps its
    top_k valid columns. Rows extending beyond the key prefix are clamped to S_k.

    Packed THD layout (cuDNN frontend DSA §4), selected by passing cu_seqlens_q and cu_seqlens_k: each segment is
    computed exactly as a BSHD batch (indexer_scores describes the segments); outputs are per packed
    query row, (total_q, top_k) as cuDNN frontend DSA gives. Local ids are segment-local key columns; global ids
    are packed key rows cu_seqlens_k[b] + local (the flat kv row ids sparse_attention takes, and the
    B = 1 view cuDNN frontend DSA's indexer backward uses for THD). Rows at or after cu_seqlens_q[-1] are empty
    rows (-1 / -inf / 0 / -inf).

    impl="fused" (sm_90a; notes/kernels/indexer.md, "indexer_forward_topk"): the lightning indexer's pipeline with
    indexer_scores' mask: per slab of query rows the wgmma score kernel writes the rows' valid scores into a bounded
    FP32 slab (at most 4096 rows and 128 MiB: S_k x 16 KiB below S_k = 8192; never the dense [S_q, S_k] scores), a
    radix top-k selects from it, writes the ids and their scores and, in the same CTA, the row's softmax, LSE and
    global ids. Limits as indexer_scores' fused path (bf16 / fp16 with weights of the same dtype, or FP8 at D =
    128 and H >= 16; H in (8, 16, 32, 64, 128), D in (64, 128), S_q and S_k <= 2**20) and top_k <= 2**20. The
    selection is always the deterministic one (ties at the k-th value go to the lower key ids; repeated calls give
    identical results), so deterministic=True changes nothing; its slots are in ascending key id order. BSHD calls
    read nothing on the host (torch.compile, CUDA graphs).

    Args:
        q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, precision, q_scale,
            k_scale: as for indexer_scores (the offsets are read on the host in THD).
        top_k: in [0, 2**31 - 1]; rows with fewer valid columns are padded.
        return_softmax: also return the softmax over each row's selected logits (default True).
        return_lse: also return the logsumexp of each row's selected logits.
        topk_indices_global: return flat ids (BSHD: b * S_k + local; THD: cu_seqlens_k[b] + local; the
            default, as cuDNN frontend DSA) instead of per-batch / per-segment local ids. Padding stays -1 either
            way. Flat BSHD ids must fit int32: B * S_k <= 2**31 - 1.
        deterministic: cuDNN frontend DSA's flag (ties at the k-th value toward the lower ids). Both impls always
            select that way, so it only documents the caller's intent.
        impl: "fused" (default) or "reference".

    Returns:
        IndexerTopK(indices, logits, softmax, lse):
          indices int32 [B, S_q, top_k] (THD: [total_q, top_k]), -1 padding;
          logits FP32 (FP64 for FP64 inputs), same leading shape, the selected scores, -inf padding;
          softmax same dtype and shape, softmax over the valid slots, 0 on padding and on empty rows
          (None unless return_softmax): usable directly as indexer_backward's index_score;
          lse [B, S_q] (THD: [total_q]), logsumexp of the valid slots, -inf for empty rows (None unless
          return_lse).
        Both impls select the same set (up to scores equal within rounding). The reference's slot order is
        descending score with ties toward the smallest local KV index; the fused path's is ascending key id.
        The reference's logits/softmax/lse are differentiable with respect to the inputs for the fixed
        selection; indices are not; the fused path's outputs have no grad_fn.

    Raises:
        as indexer_scores, plus TypeError/ValueError for top_k (an int in [0, 2**31 - 1] whose outputs fit
        in the device's memory; the message names top_k and the size), the bool flags, and B * S_k past int32
        with topk_indices_global.
    """
    key = None
    if impl == "fused" and cu_seqlens_q is None and cu_seqlens_k is None and eager_call(q_indexer):
        # BSHD reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q_indexer, k_indexer, weights, top_k, ratio, q_causal_offsets, return_softmax,
                             return_lse, topk_indices_global, deterministic, precision, q_scale, k_scale)
        plan = _FORWARD_TOPK_FAST.get(key)
        if plan is not None:
            return IndexerTopK(*plan(q_indexer, k_indexer, weights, q_causal_offsets, q_scale, k_scale))
    check_impl(impl)
    fp8 = check_precision(precision, q_scale, k_scale)
    b, packed, thd = check_dense_inputs(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q,
                                        cu_seqlens_k, qk_dtypes=FP8_DTYPES if fp8 else FLOAT_DTYPES)
    if fp8:
        check_fp8_scales(q_indexer, k_indexer, weights, q_scale, k_scale)
    check_bool("return_softmax", return_softmax)
    value_dtype = torch.float64 if q_indexer.dtype == torch.float64 else torch.float32
    check_topk("top_k", top_k, tuple(q_indexer.shape[:-2]), 4 + (2 if return_softmax else 1) * value_dtype.itemsize,
               q_indexer.device, what=f"int32 indices, {value_dtype} logits" + (" and softmax" if return_softmax else ""))
    check_bool("return_lse", return_lse)
    check_bool("topk_indices_global", topk_indices_global)
    check_bool("deterministic", deterministic)
    if topk_indices_global and not packed and b * k_indexer.shape[1] > 2 ** 31 - 1:
        raise ValueError(f"topk_indices_global=True gives flat int32 ids b * S_k + local, but B * S_k = "
                         f"{b} * {k_indexer.shape[1]} exceeds 2**31 - 1; pass topk_indices_global=False")
    kwargs = dict(ratio=ratio, q_causal_offsets=q_causal_offsets, return_softmax=return_softmax,
                  return_lse=return_lse, topk_indices_global=topk_indices_global)
    if impl == "reference":
        from ..reference.indexer import indexer_forward_topk as reference

        if fp8:
            q_indexer, k_indexer, weights = dequantize_fp8(q_indexer, k_indexer, weights, q_scale, k_scale)
        return reference(q_indexer, k_indexer, weights, top_k, **kwargs, **thd)
    from ._fused import fused_impl

    fn = fused_impl("indexer_forward_topk", q_indexer.device)
    cu_q = cu_k = None
    width = k_indexer.shape[1]
    if packed:
        cu_q, cu_k = int32_offsets(thd["cu_seqlens_q"]), int32_offsets(thd["cu_seqlens_k"])
        width = max_key_len(thd_segments(thd["cu_seqlens_q"], thd["cu_seqlens_k"]))
    offsets = None if q_causal_offsets is None else q_causal_offsets.contiguous()
    scales = dict(q_scale=q_scale, k_scale=k_scale) if fp8 else {}
    keep = None if key is None else (lambda plan: _FORWARD_TOPK_FAST.put(key, plan))
    return IndexerTopK(*fn(q_indexer, k_indexer, weights, top_k, ratio=ratio, q_causal_offsets=offsets,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, width=width, return_softmax=return_softmax,
                           return_lse=return_lse, topk_indices_global=topk_indices_global, keep_plan=keep, **scales))
