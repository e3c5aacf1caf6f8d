"""Public packed query sparse attention (QSA) ops of FlashInfer QSA: `qsa_indexed_forward` (int32 token
indices) and `qsa_bitmap_forward` (uint8 four-token block bitmap). Both are differentiable in q, k and v (every
output may take a gradient): impl="fused" through generated backward kernels (dq, then dk / dv), impl="reference"
through plain autograd.

`impl="fused"` (the default) runs a generated CUDA kernel through `dsagen.ops._fused.fused_impl`
(ValueError on CPU tensors, NotImplementedError on a GPU other than sm_90a); `impl="reference"` runs
dsagen.reference.qsa on CPU or CUDA. FlashInfer QSA's kernels support BF16, head dim 256 and 12/1 or 24/2 query/KV
heads; dsagen's kernels (dsagen/kernels/qsa, both forms) BF16 / FP16, up to 64 query heads per KV head and head dims
64 / 128 / 256, bitwise repeatable, and the bitmap form without any [T, NB]-sized scratch; the reference any GQA
ratio, head dim and FP16/BF16/FP32/FP64.
"""

from __future__ import annotations

import torch

from ._fused import fused_impl
from ..reference import qsa as ref
from ..validate import FLOAT_DTYPES, check_float, check_impl, check_same_dtype, check_tensor

MAX_INDEX_WIDTH = 2052  # FlashInfer QSA: "Width must be divisible by four and at most 2052"


def _check_qkv(q, k, v) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, hq, d = q.shape
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x, ndim=3, device=q.device)
        check_same_dtype(name, x, "q", q)
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k must have shape [T, Hkv, D] = [{t}, Hkv, {d}] to match q, got {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k must have a KV head count Hkv dividing q's Hq={hq}, got Hkv={hkv}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must have shape [T, Hkv, Dv] = [{t}, {hkv}, Dv] like k, got {tuple(v.shape)}")


def _scale(scale) -> float | None:
    return None if scale is None else check_float("scale", scale)


def qsa_indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                        scale: float | None = None, *, impl: str = "fused"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed query sparse attention over selected token indices (FlashInfer QSA, `qsa_indexed_forward`).

    For query t and head h (KV head h // (Hq // Hkv)), attend the tokens listed in indices[t]:
    s_u = scale * q[t, h] . k[u], out = softmax(s) @ v[u], lse = logsumexp(s) (natural log).

    Args:
        q: `[T, Hq, D]` packed queries, BF16 for the fused kernel (FP16/FP32/FP64 also by the reference).
        k: `[T, Hkv, D]` keys, dtype of q; Hq must be a multiple of Hkv (FlashInfer QSA: 12/1).
        v: `[T, Hkv, Dv]` values, dtype of q.
        indices: int32 `[T, W]`, W a positive multiple of four and at most 2052: absolute packed token
            ids. Seed contract (a caller promise, not checked): each four-slot group is a distinct
            complete block, four -1 padding slots, or a partial causal tail followed by -1; tokens
            belong to the query's sequence and do not exceed its position. The reference attends exactly
            the listed ids in [0, T) and skips every other value (-1 padding, out-of-range ids); a
            repeated id counts once per slot.
        scale: finite attention score scale; default 1 / sqrt(D) (1/16 at D = 256).
        impl: "fused" (default: one CTA per (token, KV head) gathers the listed K / V rows; every sum in slot
            order, so the same inputs give the same bytes on every call) or "reference".

    Returns:
        `(out, out_fp32, lse)`: out `[T, Hq, Dv]` in q.dtype (BF16), out_fp32 `[T, Hq, Dv]` FP32 (the
        output before casting; FP64 for FP64 inputs), lse `[Hq, T]` FP32 natural-log LSE. A row with no
        valid id gives zero outputs and lse = -inf.

    Gradients: with q, k or v requiring grad, autograd gives dq, dk, dv in their dtypes from the gradients of all
    three outputs (not of the indices; a row with no valid id contributes nothing). impl="fused" (first run on an
    H200: notes/kernels/qsa.md) runs the forward kernel, then a dq kernel over the same tiles
    (bitwise repeatable) and a dk / dv kernel that adds each slot's contribution into FP32 buffers by atomics, so
    dk and dv can differ in their last bits from call to call; under torch.compile both are opaque custom ops.

    Raises:
        TypeError: wrong dtypes (k/v not q's dtype, indices not int32), scale not a number.
        ValueError: wrong ranks/shapes/devices, Hq not a multiple of Hkv, W not a positive multiple of
            four or above 2052, non-finite scale, unknown impl, impl="fused" on CPU tensors or outside the kernel's
            limits (dtype, more than 64 query heads per KV head, head dims other than 64 / 128 / 256).
        NotImplementedError: impl="fused" on a GPU other than sm_90a.
    """
    check_impl(impl)
    _check_qkv(q, k, v)
    t = q.shape[0]
    check_tensor("indices", indices, dtypes=(torch.int32,), ndim=2, device=q.device)
    w = indices.shape[1]
    if indices.shape[0] != t:
        raise ValueError(f"indices must have shape [T, W] with T={t} (q's tokens), got {tuple(indices.shape)}")
    if w == 0 or w % 4 or w > MAX_INDEX_WIDTH:
        raise ValueError(f"indices width W must be a positive multiple of four and at most "
                         f"{MAX_INDEX_WIDTH}, got W={w}")
    s = _scale(scale)
    if impl == "reference":
        return ref.indexed_forward(q, k, v, indices, s)
    return fused_impl("qsa_indexed_forward", q.device)(q, k, v, indices, scale=s)


def qsa_bitmap_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor,
                       scale: float | None = None, *, cu_seqlens: torch.Tensor | None = None,
                       impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed query sparse attention from a four-token block bitmap (FlashInfer QSA, bitmap API).

    Blocks are four consecutive tokens of one sequence; they restart at each sequence boundary (a
    sequence's last block may be partial) and are numbered sequence after sequence, so without
    cu_seqlens block b holds tokens [4b, 4b + 4). Query t attends token u when block_bitmap[t, block(u)]
    is nonzero, u lies in t's sequence and u <= t: the bitmap API is causal, the query's own block is
    cut at t (the "partial causal tail"). This fixes the key bounds the underlying cuDNN call takes as
    lo/hi tensors to lo = the sequence's first token, hi = t.

    Args:
        q, k, v: as in qsa_indexed_forward (FlashInfer QSA: 12/1 or 24/2 heads, D = 256, BF16).
        block_bitmap: uint8 (or bool) `[T, NB]`, NB = the number of blocks (ceil(T / 4) without
            cu_seqlens, sum over sequences of ceil(len / 4) with it). Nonzero selects the block.
        cu_seqlens: optional int32 `[N + 1]` packed sequence offsets: starts at 0, non-decreasing,
            ends at T (checked on the host by the reference). None = one sequence.
        scale: finite score scale; default 1 / sqrt(D).
        impl: "fused" (default: one CTA per (token, KV head) reads the token's bitmap row and gathers its selected
            blocks' K / V rows; cu_seqlens' values are not read on the host, and a bitmap column past NB or a token
            outside [0, T) is never read) or "reference".

    Returns:
        `(out, out_fp32, lse)` as qsa_indexed_forward; an empty selection gives zeros and lse = -inf.

    Gradients: as qsa_indexed_forward's (dq repeatable, dk / dv by atomics); the fused backward's kernels read
    the bitmap themselves (the forward's tiles, no compacted-index scratch).

    Raises:
        TypeError: wrong dtypes (bitmap not uint8/bool, cu_seqlens not int32), scale not a number.
        ValueError: wrong shapes/devices (including NB), bad cu_seqlens values (impl="reference"), non-finite
            scale, unknown impl, impl="fused" on CPU tensors or outside the kernel's limits (as
            qsa_indexed_forward's).
        NotImplementedError: impl="fused" on a GPU other than sm_90a.
    """
    check_impl(impl)
    _check_qkv(q, k, v)
    t = q.shape[0]
    check_tensor("block_bitmap", block_bitmap, dtypes=(torch.uint8, torch.bool), ndim=2, device=q.device)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device=q.device)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if impl == "reference":
            cu = cu_seqlens.tolist()
            if cu[0] != 0 or cu[-1] != t or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={t}, got {cu}")
    if impl == "reference":
        nb = ref.bitmap_token_layout(t, cu_seqlens, q.device)[2]
    else:
        nb = block_bitmap.shape[1] if cu_seqlens is not None else -(-t // 4)  # no host read when fused
    if tuple(block_bitmap.shape) != (t, nb):
        raise ValueError(f"block_bitmap must have shape [T, NB] = ({t}, {nb}) (one column per four-token "
                         f"block), got {tuple(block_bitmap.shape)}")
    s = _scale(scale)
    if impl == "reference":
        return ref.bitmap_forward(q, k, v, block_bitmap, cu_seqlens=cu_seqlens, scale=s)
    return fused_impl("qsa_bitmap_forward", q.device)(q, k, v, block_bitmap, cu_seqlens=cu_seqlens, scale=s)


__all__ = ["qsa_indexed_forward", "qsa_bitmap_forward"]
