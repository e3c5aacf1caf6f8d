"""DeepSeek-V3.2's FP8 MLA KV cache format (the paged cache FlashMLA's sparse decode reads): the per-token writer a
serving stack calls when it appends tokens, and the reader. The format, 656 bytes per token (512 E4M3 NoPE values
in 4 tiles of 128 with one power-of-two FP32 scale each, then the 64 BF16 RoPE values), is in
dsagen.reference.kv_cache."""

from __future__ import annotations

import torch

from ..validate import check_impl, check_tensor
from ._fused import fused_impl

__all__ = ["quantize_kv_fp8", "dequantize_kv_fp8"]


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
