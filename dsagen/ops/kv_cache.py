"""DeepSeek-V3.2's FP8 MLA KV cache format (the paged cache FlashMLA's sparse decode reads): the per-token writer a
serving stack calls when it appends tokens, the reader, and sparse MLA decode over a paged cache. The format, 656
bytes per token (512 E4M3 NoPE values in 4 tiles of 128 with one power-of-two FP32 scale each, then the 64 BF16
RoPE values), is in dsagen.reference.kv_cache."""

from __future__ import annotations

import torch

from ..validate import check_impl, check_tensor
from ._fused import fused_impl

__all__ = ["quantize_kv_fp8", "dequantize_kv_fp8", "sparse_attention_decode"]


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
        impl: "fused" (default; no generated kernel yet: ValueError off the GPU, NotImplementedError on it) or
            "reference".

    Returns:
        uint8 [..., 656], a new contiguous tensor on kv's device.

    Raises:
        TypeError when kv is not a bfloat16 tensor; ValueError when its last dim is not 576, for a sparse layout, or
        a bad impl; NotImplementedError for impl="fused" on a GPU.
    """
    check_impl(impl)
    check_tensor("kv", kv, dtypes=(torch.bfloat16,))
    if kv.dim() == 0 or kv.shape[-1] != 576:
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
        impl: "fused" (default; no generated kernel yet: ValueError off the GPU, NotImplementedError on it) or
            "reference".

    Returns:
        bfloat16 [..., 576] on cache's device.

    Raises:
        TypeError for another dtype; ValueError when the last dim is not 656, for a sparse layout, or a bad impl;
        NotImplementedError for impl="fused" on a GPU.
    """
    check_impl(impl)
    check_tensor("cache", cache, dtypes=(torch.uint8, torch.float8_e4m3fn))
    if cache.dim() == 0 or cache.shape[-1] != 656:
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
        impl: "fused" (default; no generated kernel yet: ValueError off the GPU, NotImplementedError on it) or
            "reference" (gathers and dequantizes only the rows the indices name).

    Returns:
        (out [B, s_q, H, d_v] bfloat16, lse [B, s_q, H] FP32): sparse_attention's out and KV-only natural-log lse
        (a row without a valid slot: out 0, lse +inf).

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes or devices (the cache's last dim must be
        656 for the FP8 format and q's 576 for a BF16 cache); NotImplementedError for impl="fused" on a GPU.
    """
    check_impl(impl)
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=4)
    b, s_q, h, d_qk = q.shape
    if d_qk != 576:
        raise ValueError(f"q must have shape [B, s_q, H, 576], got {tuple(q.shape)}")
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8, torch.float8_e4m3fn, torch.bfloat16), ndim=4,
                 device=q.device)
    fp8 = kv_cache.dtype != torch.bfloat16
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != (656 if fp8 else 576):
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
    return fused_impl("sparse_attention_decode", q.device)(q, kv_cache, indices, attn_sink=attn_sink,
                                                           topk_length=topk_length, softmax_scale=softmax_scale,
                                                           d_v=d_v)


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
