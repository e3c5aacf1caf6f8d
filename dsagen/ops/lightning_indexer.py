"""dsagen.lightning_indexer: top-k candidate selection with multi-head weighted ReLU scores (attention-gym)."""

from __future__ import annotations

import torch

from ..validate import (FLOAT_DTYPES, check_bool, check_contiguous, check_cu_seqlens, check_impl, check_int,
                        check_reference_options, check_same_dtype, check_shape, check_tensor, check_topk)
from ._fast_path import FastPaths, call_signature, eager_call

#: the fused path's plans of eager calls by signature (dsagen.ops._fast_path)
_FAST = FastPaths("lightning_indexer")


def _check_offsets(name: str, t, device: torch.device) -> torch.Tensor:
    check_tensor(name, t, dtypes=(torch.int32,), ndim=1, device=device)
    check_contiguous(name, t)
    if t.numel() < 1:
        raise ValueError(f"{name} must have N + 1 >= 1 entries (offsets starting at zero), got shape {tuple(t.shape)}")
    return t


def check_offset_values(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, t_count: int, s_count: int,
                        compress_ratio: int) -> None:
    """The packed offsets' values (read on the host: one device-to-host copy each, not CUDA-graph capturable):
    each starts at 0, never decreases and ends at or before its packed length (T for cu_seqlens, S for
    cu_seqlens_k; the check indexer_scores runs), and every document's candidate span equals its token count
    // compress_ratio. ValueError naming the first offending entry."""
    check_cu_seqlens("cu_seqlens", cu_seqlens, total=t_count, total_name="T", device=cu_seqlens.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=s_count, total_name="S", device=cu_seqlens.device)
    cu_q, cu_k = cu_seqlens.tolist(), cu_seqlens_k.tolist()
    for d in range(len(cu_q) - 1):
        tokens, span = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        if span != tokens // compress_ratio:
            raise ValueError(f"document {d} has {tokens} tokens (cu_seqlens[{d}:{d + 2}] = {cu_q[d:d + 2]}) and "
                             f"{span} candidates (cu_seqlens_k[{d}:{d + 2}] = {cu_k[d:d + 2]}); with "
                             f"compress_ratio={compress_ratio} it must have {tokens} // {compress_ratio} = "
                             f"{tokens // compress_ratio}")


def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, causal: bool = False,
                      compress_ratio: int = 1, cu_seqlens: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None, impl: str = "fused",
                      kernel_options: dict[str, str] | None = None, check_offsets: bool | None = None
                      ) -> torch.Tensor:
    """Return the top-k candidate indices for every (batch, query) row (attention-gym lightning_indexer).

    ::

        dots[b, t, h, s] = q[b, t, h, :] . k[b, s, :]
        score[b, t, s]   = sum_h(weights[b, t, h] * relu(dots[b, t, h, s])) / sqrt(H * D)
        output[b, t, :]  = the topk highest-scoring valid candidates s

    Args:
        q: [B, T, H, D] queries; H >= 1, D >= 1.
        k: [B, S, D] candidate pool shared by all heads. Without packed offsets S must equal
            T // compress_ratio (a trailing partial window forms no candidate). With offsets, the
            documents' candidates are concatenated in document order and S may include inactive capacity.
        weights: [B, T, H] per-head weights; may be negative.
        topk: output width, >= 0. topk=0 returns an empty last dimension; topk > S is allowed.
        causal: query t may only select candidates s < (t + 1) // compress_ratio (those whose tokens all
            lie at positions <= t; candidates 0..t for ratio 1). Positions restart per packed document.
        compress_ratio: tokens per candidate, >= 1. Values other than 1 require causal=True.
        cu_seqlens: packed query offsets [N + 1], contiguous int32 on q.device, B must be 1. They start at
            0, never decrease, may repeat (empty documents) and may end before T; rows at or past the last
            offset return only -1. Must come with cu_seqlens_k. Offset values are caller invariants and
            are not read on the host.
        cu_seqlens_k: packed candidate offsets [N + 1], contiguous int32 on q.device, ending at or before S;
            document d owns candidates [cu_seqlens_k[d], cu_seqlens_k[d + 1]), whose span must equal
            (cu_seqlens[d + 1] - cu_seqlens[d]) // compress_ratio. Returned ids are document-local.
        check_offsets: read the offsets on the host and raise ValueError unless they keep the invariants above
            (check_offset_values; the check indexer_scores runs, plus the spans). None (default): on for
            impl="reference", off for impl="fused", whose offsets then stay on the device (CUDA graphs,
            torch.compile without a graph break). Unchecked invalid offsets (decreasing, negative, past the end,
            spans that disagree with compress_ratio) give unspecified ids in [-1, S) but never make a kernel
            access memory out of bounds.
        impl: "fused" (default; generated CUDA kernels) or "reference" (plain PyTorch, CPU or CUDA).
        kernel_options: fused-backend override, passed to the fused implementation (which validates it);
            must be None for impl="reference".

    Returns:
        Contiguous int32 [B, T, topk]. impl="reference" orders a row's valid indices by descending score,
        resolving equal scores toward the lower index (deterministic); rows with fewer valid candidates
        than topk end with -1 padding. Masked candidates (other documents, causal future, inactive
        capacity) are excluded before selection, never selected. The fused path's order and tie-breaking
        are unspecified (attention-gym leaves them open). The result has no grad_fn: selection is
        nondifferentiable even when inputs require gradients. Mask -1 before gathering (a raw -1 index
        selects the last position).
        Selection with NaN/Inf scores is unspecified.

    The reference accumulates FP16/BF16/FP32 in FP32 and FP64 in FP64, and scores query rows in chunks so
    its [rows, H, S] temporary stays under ~256 MiB.

    Raises:
        TypeError: q, k or weights is not a floating tensor (fp16/bf16/fp32/fp64), k or weights has a
            dtype other than q's, topk / compress_ratio is not an int, causal is not a bool, an offset
            tensor is not int32, kernel_options is not a dict, check_offsets is not a bool or None.
        ValueError: bad impl; wrong rank or shape (k [B, S, D], weights [B, T, H], S != T // compress_ratio
            when unpacked, H or D zero); inputs on different devices; topk < 0; compress_ratio < 1;
            compress_ratio != 1 without causal; only one of cu_seqlens / cu_seqlens_k; offsets that are not
            1-D contiguous with N + 1 >= 1 entries, differ in length, or packed input with B != 1; with
            check_offsets, offset values that break the invariants above; kernel_options given with
            impl="reference"; impl="fused" on CPU tensors.
        NotImplementedError: impl="fused" where no kernel exists for the device.
    """
    key = None
    if impl == "fused" and not check_offsets and eager_call(q):
        # the fused path reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q, k, weights, topk, causal, compress_ratio, cu_seqlens, cu_seqlens_k, kernel_options,
                             check_offsets)
        plan = _FAST.get(key)
        if plan is not None:
            return plan(q, k, weights, cu_seqlens, cu_seqlens_k)
    check_impl(impl)
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    device = q.device
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndim=3, device=device)
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, ndim=3, device=device)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("weights", weights, "q", q)
    b, t_count, h, d = q.shape
    if h < 1 or d < 1:
        raise ValueError(f"q must have H >= 1 heads and head dimension D >= 1, got shape {tuple(q.shape)}")
    check_topk("topk", topk, (b, t_count), 4, device, what="int32 indices")
    check_bool("causal", causal)
    check_int("compress_ratio", compress_ratio, minimum=1)
    if compress_ratio != 1 and not causal:
        raise ValueError(f"compress_ratio={compress_ratio} requires causal=True (only 1 is allowed without it)")
    if k.shape[0] != b or k.shape[2] != d:
        raise ValueError(f"k must have shape [B={b}, S, D={d}], got {tuple(k.shape)}")
    check_shape("weights", weights, (b, t_count, h), "[B, T, H]")
    if (cu_seqlens is None) != (cu_seqlens_k is None):
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens"
        raise ValueError(f"cu_seqlens and cu_seqlens_k must be passed together; {missing} is missing")
    if cu_seqlens is not None:
        _check_offsets("cu_seqlens", cu_seqlens, device)
        _check_offsets("cu_seqlens_k", cu_seqlens_k, device)
        if cu_seqlens.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens ({cu_seqlens.numel()}), "
                             f"got {cu_seqlens_k.numel()}")
        if b != 1:
            raise ValueError(f"q must have batch size B = 1 with packed cu_seqlens, got shape {tuple(q.shape)}")
    elif k.shape[1] != t_count // compress_ratio:
        raise ValueError(f"k must hold S = T // compress_ratio = {t_count} // {compress_ratio} = "
                         f"{t_count // compress_ratio} candidates without packed offsets, got shape {tuple(k.shape)}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    if check_offsets is not None:
        check_bool("check_offsets", check_offsets)
    if cu_seqlens is not None and (impl == "reference" if check_offsets is None else check_offsets):
        check_offset_values(cu_seqlens, cu_seqlens_k, t_count, k.shape[1], compress_ratio)

    if impl == "reference":
        check_reference_options("kernel_options", kernel_options)
        from ..reference.lightning_indexer import lightning_indexer as reference

        return reference(q, k, weights, topk, causal=causal, compress_ratio=compress_ratio,
                         cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k)
    from ._fused import fused_impl

    keep = None if key is None else (lambda plan: _FAST.put(key, plan))
    return fused_impl("lightning_indexer", device)(q, k, weights, topk, causal=causal, compress_ratio=compress_ratio,
                                                   cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
                                                   kernel_options=kernel_options, keep_plan=keep)
