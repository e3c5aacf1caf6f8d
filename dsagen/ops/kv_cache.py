"""DeepSeek-V3.2's FP8 MLA KV cache format (the paged cache FlashMLA's sparse decode reads): the per-token writer a
serving stack calls when it appends tokens, the reader, and sparse MLA decode over a paged cache; and the indexer's
paged FP8 key cache (DeepGEMM's fp8_paged_mqa_logits layout) with the decode-time indexer over it. The format, 656
bytes per token (512 E4M3 NoPE values in 4 tiles of 128 with one power-of-two FP32 scale each, then the 64 BF16
RoPE values), is in dsagen.reference.kv_cache."""

from __future__ import annotations

import torch

from ..reference.kv_cache import KV_DIM, KV_FP8_TOKEN_BYTES
from ..validate import check_impl, check_tensor
from ._fast_path import FastPaths, call_signature, eager_call
from ._fused import fused_impl

#: sparse_attention_decode's plans of eager fused calls, by signature (dsagen.ops._fast_path)
_DECODE_FAST = FastPaths("sparse_attention_decode")
#: indexer_decode_topk's plans of eager fused calls, by signature
_INDEXER_DECODE_FAST = FastPaths("indexer_decode_topk")

__all__ = ["quantize_kv_fp8", "dequantize_kv_fp8", "sparse_attention_decode", "quantize_index_k_fp8",
           "indexer_decode_topk"]


def quantize_kv_fp8(kv: torch.Tensor, *, impl: str = "fused") -> torch.Tensor:
    """Quantize MLA KV rows into DeepSeek-V3.2's FP8 cache format (FlashMLA's "FP8 with scale" sparse-decode cache,
    its tests/quant.py layout V32_FP8Sparse), byte for byte:

        bytes [0, 512)    NoPE values kv[..., :512] / s_t as float8_e4m3fn, tile t = 128 consecutive values
        bytes [512, 528)  the 4 scales s_t = 2 ** ceil(log2(max(amax_t / 448, 1e-4))) as float32
        bytes [528, 656)  RoPE values kv[..., 512:] as bfloat16, unchanged

    A serving stack writes the result into its paged cache at the appended tokens' slots, e.g.
    `cache.view(-1, 656)[slots] = quantize_kv_fp8(kv)` for a cache of shape [num_blocks, page_block_size, 1, 656].

    Args:
        kv: [..., 576] bfloat16 (512 NoPE + 64 RoPE values per token), any leading dims (none: one token).
        impl: "fused" (default: one launch of the sm_90a codec kernel, a warp per token, the same bytes; ValueError
            off the GPU, NotImplementedError on a GPU other than sm_90a) or "reference".

    Returns:
        uint8 [..., 656], a new contiguous tensor on kv's device.

    Raises:
        TypeError when kv is not a bfloat16 tensor; ValueError when its last dim is not 576, for a sparse layout, or
        a bad impl; NotImplementedError for impl="fused" on a GPU other than sm_90a.
    """
    check_impl(impl)
    check_tensor("kv", kv, dtypes=(torch.bfloat16,))
    if kv.dim() == 0 or kv.shape[-1] != KV_DIM:
        raise ValueError(f"kv must have shape [..., 576] (512 NoPE + 64 RoPE values), got {tuple(kv.shape)}")
    if impl == "reference":
        from ..reference.kv_cache import quantize_kv_fp8 as reference

        return reference(kv)
    return fused_impl("quantize_kv_fp8", kv.device)(kv)


def dequantize_kv_fp8(cache: torch.Tensor, *, impl: str = "fused") -> torch.Tensor:
    """Read DeepSeek-V3.2's FP8 MLA cache bytes back into bfloat16 KV rows (quantize_kv_fp8's format): NoPE = E4M3
    value x its tile's scale (exact in FP32) rounded to bfloat16, RoPE copied. dequantize_kv_fp8(quantize_kv_fp8(kv))
    keeps the RoPE values bit for bit and each NoPE value within half an E4M3 step of its tile's scale.

    Args:
        cache: [..., 656] uint8 or float8_e4m3fn (FlashMLA's tests store the cache as float8_e4m3fn), any leading
            dims, any strides (a paged cache [num_blocks, page_block_size, 1, 656] or a view of it).
        impl: "fused" (default: one launch of the sm_90a codec kernel, a warp per token, the same bytes; a layout
            whose rows are not 16-byte aligned is copied first; ValueError off the GPU, NotImplementedError on a GPU
            other than sm_90a) or "reference".

    Returns:
        bfloat16 [..., 576] on cache's device.

    Raises:
        TypeError for another dtype; ValueError when the last dim is not 656, for a sparse layout, or a bad impl;
        NotImplementedError for impl="fused" on a GPU other than sm_90a.
    """
    check_impl(impl)
    check_tensor("cache", cache, dtypes=(torch.uint8, torch.float8_e4m3fn))
    if cache.dim() == 0 or cache.shape[-1] != KV_FP8_TOKEN_BYTES:
        raise ValueError(f"cache must have shape [..., 656] (the FP8 cache's bytes per token), got "
                         f"{tuple(cache.shape)}")
    if impl == "reference":
        from ..reference.kv_cache import dequantize_kv_fp8 as reference

        return reference(cache)
    return fused_impl("dequantize_kv_fp8", cache.device)(cache)


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                            attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                            softmax_scale: float | None = None, d_v: int = 512,
                            impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over a paged KV cache (FlashMLA's sparse decoding: `flash_mla_with_kvcache` with
    `indices`), the FP8 cache of quantize_kv_fp8's format or a BF16 one: for batch b, query token t (s_q of them
    per sequence: 1, or up to 4 with speculative decoding) and head h, the sparse_attention of q[b, t, h] over the
    cache rows indices[b, t, :], each a page-encoded row id page_block * page_block_size + offset into the cache's
    num_blocks x page_block_size rows (FlashMLA's `indices_in_kvcache`: no block table is needed); -1, ids outside
    the cache and slots at or past topk_length[b] are empty. K = all 576 columns, V = the first d_v. FP8 rows are
    read as dequantize_kv_fp8 gives them (bf16), so the result is sparse_attention's on the dequantized rows.

    Args:
        q: [B, s_q, H, 576] bfloat16.
        kv_cache: [num_blocks, page_block_size, 1, 656] uint8 or float8_e4m3fn (the FP8 format), or
            [num_blocks, page_block_size, 1, 576] bfloat16; any strides.
        indices: int32 [B, s_q, topk], page-encoded row ids, -1 for none.
        attn_sink: optional FP32 [H] sink logits (as sparse_attention). topk_length: optional int32 [B] (per
            sequence, as FlashMLA's) or [B, s_q] valid-prefix lengths.
        softmax_scale: default 1 / sqrt(576). d_v: 512 (the MLA latent; RoPE columns are not in V).
        impl: "fused" (default: the sparse MLA forward kernel over the cache viewed as one flat pool of rows, no
            gather; the FP8 cache's rows dequantized to bf16 in shared memory by the kernel, the values
            dequantize_kv_fp8 gives; ValueError off the GPU) or "reference" (gathers and dequantizes only the rows
            the indices name).

    Returns:
        (out [B, s_q, H, d_v] bfloat16, lse [B, s_q, H] FP32): sparse_attention's out and KV-only natural-log lse
        (a row without a valid slot: out 0, lse +inf).

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes or devices (the cache's last dim must be
        656 for the FP8 format and q's 576 for a BF16 cache); NotImplementedError for impl="fused" with a cache
        whose page blocks are not evenly strided rows.
    """
    key = None
    if impl == "fused" and eager_call(q):
        # the fused decode reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q, kv_cache, indices, attn_sink, topk_length, softmax_scale, d_v)
        plan = _DECODE_FAST.get(key)
        if plan is not None:
            return plan(q, kv_cache, indices, attn_sink, topk_length)
    check_impl(impl)
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=4)
    b, s_q, h, d_qk = q.shape
    if d_qk != KV_DIM:
        raise ValueError(f"q must have shape [B, s_q, H, 576], got {tuple(q.shape)}")
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8, torch.float8_e4m3fn, torch.bfloat16), ndim=4,
                 device=q.device)
    fp8 = kv_cache.dtype != torch.bfloat16
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != (KV_FP8_TOKEN_BYTES if fp8 else KV_DIM):
        want = "[num_blocks, page_block_size, 1, 656] (FP8)" if fp8 else "[num_blocks, page_block_size, 1, 576] (bf16)"
        raise ValueError(f"kv_cache must have shape {want}, got {tuple(kv_cache.shape)}")
    check_tensor("indices", indices, dtypes=(torch.int32,), ndim=3, device=q.device)
    if tuple(indices.shape[:2]) != (b, s_q):
        raise ValueError(f"indices must have shape [B, s_q, topk] with B, s_q = {(b, s_q)}, got "
                         f"{tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=(torch.int32,), ndim=(1, 2), device=q.device)
        if tuple(topk_length.shape) not in ((b,), (b, s_q)):
            raise ValueError(f"topk_length must have shape [B] or [B, s_q] = {(b,)} or {(b, s_q)}, got "
                             f"{tuple(topk_length.shape)}")
    if isinstance(d_v, bool) or not isinstance(d_v, int) or d_v != 512:
        raise ValueError(f"d_v must be 512 (the MLA latent), got {d_v!r}")
    if impl == "reference":
        return _decode_reference(q, kv_cache, indices, attn_sink, topk_length, softmax_scale, d_v, fp8)
    keep = None if key is None else (lambda plan: _DECODE_FAST.put(key, plan))
    return fused_impl("sparse_attention_decode", q.device)(q, kv_cache, indices, attn_sink=attn_sink,
                                                           topk_length=topk_length, softmax_scale=softmax_scale,
                                                           d_v=d_v, keep_plan=keep)


def _decode_reference(q, kv_cache, indices, attn_sink, topk_length, softmax_scale, d_v, fp8):
    """sparse_attention(impl="reference") over the rows the indices name, gathered (and dequantized) first: row r
    of the gathered block is slot r of the flattened [B * s_q, topk] indices."""
    from ..reference.kv_cache import dequantize_kv_fp8 as dequantize
    from .sparse_attention import sparse_attention

    b, s_q, h, d_qk = q.shape
    topk = indices.shape[-1]
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flat_cache = kv_cache.reshape(rows, kv_cache.shape[-1])
    ids = indices.reshape(b * s_q, topk).long()
    valid = (ids >= 0) & (ids < rows)
    picked = flat_cache[ids.clamp(0, max(rows - 1, 0)).reshape(-1)] if rows else flat_cache.new_zeros(
        (ids.numel(), flat_cache.shape[-1]))
    kv = dequantize(picked) if fp8 else picked                                      # [B * s_q * topk, 576]
    local = torch.arange(b * s_q * topk, device=q.device, dtype=torch.int32).view(b * s_q, topk)
    local = torch.where(valid, local, torch.full_like(local, -1))
    length = None
    if topk_length is not None:
        length = (topk_length[:, None].expand(b, s_q) if topk_length.dim() == 1 else topk_length).reshape(b * s_q)
        length = length.contiguous()
    out, lse, _ = sparse_attention(q.reshape(b * s_q, h, d_qk), kv, local, attn_sink=attn_sink,
                                   topk_length=length, softmax_scale=softmax_scale, d_v=d_v, impl="reference")
    return out.view(b, s_q, h, d_v), lse.view(b, s_q, h)


def quantize_index_k_fp8(k: torch.Tensor, *, impl: str = "fused") -> torch.Tensor:
    """Write index keys into the indexer's paged FP8 key cache in DeepGEMM's fp8_paged_mqa_logits layout (the
    format serving stacks keep the DeepSeek-V3.2 indexer keys in): per page block its block_size x D E4M3 values,
    token-major, then its block_size FP32 scales s_t = max(amax_t, 1e-4) / 448 (value = k / s_t), the block's
    block_size x (D + 4) bytes viewed as [block_size, 1, D + 4] (a view of the block, not one token per row).

    Args:
        k: [num_blocks, block_size, D] bfloat16 / float16 / float32 index keys (page blocks of the cache).
        impl: "fused" (default; no generated kernel yet: ValueError off the GPU, NotImplementedError on it) or
            "reference".

    Returns:
        uint8 [num_blocks, block_size, 1, D + 4] on k's device.

    Raises:
        TypeError for another dtype; ValueError when k is not 3-D or has D = 0, for a sparse layout, or a bad impl;
        NotImplementedError for impl="fused" on a GPU.
    """
    check_impl(impl)
    check_tensor("k", k, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    if k.shape[-1] == 0:
        raise ValueError(f"k must have shape [num_blocks, block_size, D] with D >= 1, got {tuple(k.shape)}")
    if impl == "reference":
        from ..reference.kv_cache import quantize_index_k_fp8 as reference

        return reference(k)
    return fused_impl("quantize_index_k_fp8", k.device)(k)


def indexer_decode_topk(q_indexer: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                        block_table: torch.Tensor, cache_seqlens: torch.Tensor, top_k: int, *,
                        impl: str = "fused") -> torch.Tensor:
    """The decode-time lightning indexer over a paged key cache (DeepGEMM's fp8_paged_mqa_logits, then top-k),
    returning page-encoded ids that sparse_attention_decode takes.

    Batch b holds L_b = cache_seqlens[b] tokens in its pages (block_table[b, i] is the page block of its tokens
    i * block_size .. (i + 1) * block_size - 1), the last next_n of which are the queries: query j sits at position
    p = L_b - next_n + j and sees the keys s <= p, s < L_b. Its scores are

        score[s] = sum_h weights[b, j, h] * relu(q_indexer[b, j, h, :] . k[s, :])

    with k the cache's keys (FP8: E4M3 value x its token's scale; the FP8 q's own scale belongs in the weights, as
    DeepGEMM takes it). The top_k keys by score become page-encoded ids block_table[b, s // block_size] *
    block_size + s % block_size; rows with fewer visible keys end with -1.

    Args:
        q_indexer: [B, next_n, H, D] bfloat16, or float8_e4m3fn with the FP8 cache.
        weights: [B, next_n, H] float32.
        k_cache: FP8: [num_blocks, block_size, 1, D + 4] uint8 (quantize_index_k_fp8's layout); BF16:
            [num_blocks, block_size, D] bfloat16.
        block_table: int32 [B, max_blocks_per_seq]. cache_seqlens: int32 [B], each >= next_n.
        top_k: >= 0.
        impl: "fused" (default: indexer_forward_topk's score and top-k kernels on sm_90a with the keys read through
            the block table; pages of 64 tokens, H / D / dtype as indexer_forward_topk's (FP8: H >= 16, D = 128);
            reads nothing on the host, so lengths and the table are not checked: a row sees the keys below
            cache_seqlens[b] - next_n + j + 1 clamped to the table's max_pages x 64, a page outside the cache reads
            zeros; slots in ascending position, equal scores at the k-th toward the lower position; the BF16 form
            rounds the weights to bf16; ValueError off the GPU) or "reference" (reads cache_seqlens on the host;
            slots in descending score, equal scores toward the lower position).

    Returns:
        int32 [B, next_n, top_k] page-encoded ids, -1 padded (slot order as above).

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes, devices or values (impl="fused": also
        outside the kernels' limits above); NotImplementedError for impl="fused" on a GPU other than sm_90a.
    """
    key = None
    if impl == "fused" and eager_call(q_indexer):
        # the fused path reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k)
        plan = _INDEXER_DECODE_FAST.get(key)
        if plan is not None:
            return plan(q_indexer, weights, k_cache, block_table, cache_seqlens)
    check_impl(impl)
    check_tensor("q_indexer", q_indexer, dtypes=(torch.bfloat16, torch.float8_e4m3fn), ndim=4)
    b, next_n, h, d = q_indexer.shape
    dev = q_indexer.device
    check_tensor("weights", weights, dtypes=(torch.float32,), ndim=3, device=dev)
    if tuple(weights.shape) != (b, next_n, h):
        raise ValueError(f"weights must have shape [B, next_n, H] = {(b, next_n, h)}, got {tuple(weights.shape)}")
    fp8 = q_indexer.dtype == torch.float8_e4m3fn
    if fp8:
        check_tensor("k_cache", k_cache, dtypes=(torch.uint8,), ndim=4, device=dev)
        if k_cache.shape[2] != 1 or k_cache.shape[3] != d + 4:
            raise ValueError(f"k_cache must have shape [num_blocks, block_size, 1, D + 4 = {d + 4}] with an FP8 "
                             f"q_indexer, got {tuple(k_cache.shape)}")
    else:
        check_tensor("k_cache", k_cache, dtypes=(torch.bfloat16,), ndim=3, device=dev)
        if k_cache.shape[2] != d:
            raise ValueError(f"k_cache must have shape [num_blocks, block_size, D = {d}] with a bf16 q_indexer, "
                             f"got {tuple(k_cache.shape)}")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape [B = {b}, max_blocks], got {tuple(block_table.shape)}")
    check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1, device=dev)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have shape [B = {b}], got {tuple(cache_seqlens.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if impl == "reference":
        return _indexer_decode_reference(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k, fp8)
    keep = None if key is None else (lambda plan: _INDEXER_DECODE_FAST.put(key, plan))
    return fused_impl("indexer_decode_topk", dev)(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k,
                                                   keep_plan=keep)


def _indexer_decode_reference(q, weights, k_cache, block_table, cache_seqlens, top_k, fp8):
    """Per batch: the sequence's keys from its pages, the scores of its next_n queries, select_topk, page ids."""
    from ..reference.indexer import select_topk
    from ..reference.kv_cache import dequantize_index_k_fp8

    b, next_n, h, d = q.shape
    keys = dequantize_index_k_fp8(k_cache) if fp8 else k_cache.float()                # [num_blocks, bs, D]
    n_blocks, bs = keys.shape[:2]
    out = torch.full((b, next_n, top_k), -1, dtype=torch.int32, device=q.device)
    lengths = cache_seqlens.tolist()
    for bi in range(b):
        length = lengths[bi]
        if length < next_n or length > block_table.shape[1] * bs:
            raise ValueError(f"cache_seqlens[{bi}] = {length} must be in [next_n = {next_n}, max_blocks x "
                             f"block_size = {block_table.shape[1] * bs}]")
        pages = block_table[bi, :-(-length // bs)].long()
        if ((pages < 0) | (pages >= n_blocks)).any():
            raise ValueError(f"block_table[{bi}] names a page block outside [0, {n_blocks}) for its "
                             f"{length} tokens")
        k = keys[pages].reshape(-1, d)[:length]                                          # [L, D]
        dots = torch.einsum("jhd,sd->jhs", q[bi].float(), k)
        scores = torch.einsum("jh,jhs->js", weights[bi].float(), torch.relu(dots))
        pos = torch.arange(length, device=q.device)
        valid = pos[None, :] <= (length - next_n + torch.arange(next_n, device=q.device))[:, None]
        sel = select_topk(scores, valid, top_k)                                            # [next_n, <= top_k]
        page_ids = pages[sel.clamp_min(0) // bs] * bs + sel.clamp_min(0) % bs
        out[bi, :, :sel.shape[1]] = torch.where(sel >= 0, page_ids, -1).to(torch.int32)
    return out
