"""Public native sparse attention (NSA) op of ejkernel NSA (`native_sparse_attention`).

`impl="fused"` (the default) runs a generated CUDA kernel through `dsagen.ops._fused.fused_impl`
(ValueError on CPU tensors, NotImplementedError where no kernel exists); `impl="reference"` runs
dsagen.reference.nsa on CPU or CUDA, differentiable through plain autograd.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ._fused import fused_impl
from ..reference import nsa as ref
from ..validate import (FLOAT_DTYPES, check_float, check_impl, check_int, check_same_dtype, check_shape, check_tensor,
                        check_topk)

_INDEX_DTYPES = (torch.int32, torch.int64)


def native_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            g_cmp: torch.Tensor | None = None, g_slc: torch.Tensor | None = None,
                            block_indices: torch.Tensor | None = None, block_counts: int | torch.Tensor = 16,
                            cu_seqlens: torch.Tensor | None = None, *, softmax_scale: float | None = None,
                            block_size: int = 64, impl: str = "fused") -> torch.Tensor:
    """Native sparse attention: per-query selected key blocks, optional compressed branch, gates, GQA.

    For query token t and query head hq (KV head h = hq // (HQ // H)):

    * selected branch o_slc: softmax attention over the tokens of the blocks block_indices[b, t, h, s]
      (block j = tokens [j * block_size, (j + 1) * block_size)) for slots s < block_counts, limited
      causally to tokens <= t. Ids outside [0, ceil(T / block_size)) (e.g. -1) are empty slots;
      a repeated block counts once per slot.
    * compressed branch o_cmp (only when g_cmp is given): attention over mean-pooled block keys/values
      of the complete blocks c < (t + 1) // block_size. Its probabilities, summed over the KV head's
      query heads with t's own block forced to 1 and future blocks excluded, choose the top
      block_counts blocks per (t, h) (ties to the larger block id, unused slots -1); these replace
      block_indices, which is then ignored with a warning (ejkernel's behaviour).
    * out = o_slc * g_slc + o_cmp * g_cmp; g_slc=None means o_slc unscaled.

    A token with nothing to attend in a branch gets zeros from it (ejkernel's XLA path would spread
    weight over masked slots instead; we chose zeros, like the other ops).

    Args:
        query: `[B, T, HQ, D]` float (FP16/BF16/FP32/FP64).
        key: `[B, T, H, D]`, HQ a multiple of H; dtype of query.
        value: `[B, T, H, Dv]`; dtype of query.
        g_cmp, g_slc: optional float gates `[B, T, HQ]`.
        block_indices: int32/int64 block ids (sequence-local with cu_seqlens), in either layout of the
            ejkernel: per token `[B, T, H, S]`, or per query block `[B, H, NQB, S]` (row [b, h, j] holds the
            blocks of every token of query block j; query blocks are the key blocks' block_size-token
            tiles, NQB = ceil(T / block_size); with cu_seqlens they restart at every sequence and are
            numbered sequence after sequence, NQB = sum_i ceil(len_i / block_size)). The per-query-block
            layout is expanded to the per-token one on the device before either impl runs, so both
            layouts give identical results and gradients. The layout is read from the shape; when both
            fit (T = H = NQB: block_size 1 or T = H = 1) it is per token, as in ejkernel. Required when
            g_cmp is None.
        block_counts: int >= 0 (all tokens) or int32/int64 counts per token `[B, T, H]` or per query
            block `[B, H, NQB]` (expanded like block_indices; the two tensors' layouts are independent).
            With g_cmp the selection width is the int, or the tensor's maximum (each token keeps its
            first count blocks, highest-scoring first).
        cu_seqlens: optional int32/int64 `[N + 1]` offsets of packed sequences (B must be 1): starts at
            0, never decreases, ends at T (checked on the host by the reference, and by either impl when
            a per-query-block tensor needs the sequences' block counts: then a host read). Each sequence
            is independent; positions and blocks restart at its first token.
        softmax_scale: finite float; default 1 / sqrt(D).
        block_size: tokens per block, >= 1 (default 64).
        impl: "fused" (default) or "reference".

    Returns:
        `[B, T, HQ, Dv]` in query.dtype; differentiable in query, key, value, g_cmp and g_slc.

    Raises:
        TypeError: non-tensor or wrong-dtype arguments, block_counts neither int nor tensor.
        ValueError: wrong ranks/shapes/devices (block_indices / block_counts in neither layout), HQ not a
            multiple of H, neither g_cmp nor block_indices,
            cu_seqlens with B != 1 or bad values, block_size < 1, negative block_counts, unknown impl,
            impl="fused" on CPU tensors; with g_cmp, an int block_counts above 2**31 - 1 or whose
            selection [B, T, H, block_counts] would not fit in the device's memory (the message names
            block_counts and the size).
        NotImplementedError: impl="fused" where no generated kernel exists.
    """
    check_impl(impl)
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=4)
    b, t, hq, d = query.shape
    check_tensor("key", key, ndim=4, device=query.device)
    check_same_dtype("key", key, "query", query)
    if key.shape[:2] != query.shape[:2] or key.shape[3] != d:
        raise ValueError(f"key must have shape [B, T, H, D] = ({b}, {t}, H, {d}), got {tuple(key.shape)}")
    h = key.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"key must have a head count H dividing query's HQ={hq}, got H={h}")
    check_tensor("value", value, ndim=4, device=query.device)
    check_same_dtype("value", value, "query", query)
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value must have shape [B, T, H, Dv] = ({b}, {t}, {h}, Dv), got {tuple(value.shape)}")
    for name, gate in (("g_cmp", g_cmp), ("g_slc", g_slc)):
        if gate is not None:
            check_tensor(name, gate, dtypes=FLOAT_DTYPES, device=query.device)
            check_shape(name, gate, (b, t, hq), "[B, T, HQ]")
    check_int("block_size", block_size, minimum=1)
    if softmax_scale is not None:
        softmax_scale = check_float("softmax_scale", softmax_scale)
    cu_host: list[int] | None = None
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=_INDEX_DTYPES, ndim=1, device=query.device)
        if b != 1:
            raise ValueError(f"cu_seqlens requires a packed batch of one (query [1, T, HQ, D]), got B={b}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")

    def offsets_on_host() -> list[int]:
        # A host read (sync): always for the reference, otherwise only to place query blocks.
        nonlocal cu_host
        if cu_host is None:
            cu_host = [int(x) for x in cu_seqlens.tolist()]
            if cu_host[0] != 0 or cu_host[-1] != t or any(y < x for x, y in zip(cu_host, cu_host[1:])):
                raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={t}, got {cu_host}")
        return cu_host

    if cu_seqlens is not None and impl == "reference":
        offsets_on_host()

    def num_query_blocks() -> int:
        return ref.num_query_blocks(t, block_size, None if cu_seqlens is None else offsets_on_host())

    indices_per_block = counts_per_block = False
    if block_indices is not None:
        check_tensor("block_indices", block_indices, dtypes=_INDEX_DTYPES, ndim=4, device=query.device)
        indices_per_block = _per_query_block("block_indices", block_indices.shape, b, t, h, num_query_blocks,
                                             slots=True)
    elif g_cmp is None:
        raise ValueError("block_indices must be given when g_cmp is None (without the compressed branch "
                         "nothing selects the blocks)")
    if isinstance(block_counts, torch.Tensor):
        check_tensor("block_counts", block_counts, dtypes=_INDEX_DTYPES, device=query.device)
        if block_counts.dim() != 3:
            raise ValueError(f"block_counts must have 3 dimensions ([B, T, H] or [B, H, NQB]), "
                             f"got shape {tuple(block_counts.shape)}")
        counts_per_block = _per_query_block("block_counts", block_counts.shape, b, t, h, num_query_blocks,
                                            slots=False)
        if impl == "reference" and block_counts.numel() and int(block_counts.min()) < 0:
            raise ValueError("block_counts must be >= 0 everywhere")
    elif g_cmp is not None:  # the int is the selection width: [B, T, H, block_counts] block ids (int64)
        check_topk("block_counts", block_counts, (b, t, h), 8, query.device, what="int64 selected block ids")
    else:
        check_int("block_counts", block_counts, minimum=0)
    if g_cmp is not None and block_indices is not None:
        warnings.warn("native_sparse_attention: block_indices is ignored when g_cmp is given (the "
                      "compressed branch selects the blocks)", UserWarning, stacklevel=2)
        block_indices = indices_per_block = None
    if indices_per_block or counts_per_block:
        qb = ref.query_block_of_token(t, block_size, None if cu_seqlens is None else offsets_on_host(), query.device)
        if indices_per_block:
            block_indices = ref.blocks_to_tokens(block_indices, qb)
        if counts_per_block:
            block_counts = ref.blocks_to_tokens(block_counts, qb)

    args = (query, key, value, g_cmp, g_slc, block_indices, block_counts, cu_seqlens)
    kwargs = dict(softmax_scale=softmax_scale, block_size=block_size)
    if impl == "reference":
        return ref.native_sparse_attention(*args, **kwargs)
    return fused_impl("native_sparse_attention", query.device)(*args, **kwargs)


def _per_query_block(name: str, shape: torch.Size, b: int, t: int, h: int, num_query_blocks: Callable[[], int],
                     slots: bool) -> bool:
    """The layout of `name` (`shape`; `slots`: a trailing S dimension): False for per-token
    `[B, T, H(, S)]`, True for per-query-block `[B, H, NQB(, S)]`. Per-token wins when both match
    (ejkernel's order; possible only when T = H = NQB, i.e. block_size = 1 or T = H = 1). ValueError
    naming `name` when neither matches."""
    lead = tuple(shape[:3])
    if lead == (b, t, h):
        return False
    nqb = num_query_blocks() if lead[:2] == (b, h) else None
    if nqb is not None and lead[2] == nqb:
        return True
    tail = ", S" if slots else ""
    raise ValueError(f"{name} must have shape [B, T, H{tail}] = ({b}, {t}, {h}{tail}) (per token) or "
                     f"[B, H, NQB{tail}] = ({b}, {h}, {'NQB' if nqb is None else nqb}{tail}) (per query block), "
                     f"got {tuple(shape)}")


__all__ = ["native_sparse_attention"]
