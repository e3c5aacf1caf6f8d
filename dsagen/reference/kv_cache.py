"""Plain-PyTorch writer and reader of DeepSeek-V3.2's FP8 MLA KV cache token format, as FlashMLA's sparse decode
reads it (FlashMLA README, "FP8 KV cache"; its tests/quant.py, layout V32_FP8Sparse): 656 bytes per token,

    bytes [0, 512)    the 512 NoPE values as float8_e4m3fn, in 4 tiles of 128 values, value / s_t
    bytes [512, 528)  the 4 tiles' scales s_t as float32: s_t = 2 ** ceil(log2(max(amax_t / 448, 1e-4)))
                      (a power of two: the tile's largest |value| maps to at most 448, E4M3's largest)
    bytes [528, 656)  the 64 RoPE values as bfloat16, unchanged

and the reader's inverse: NoPE = e4m3 value * s_t (exact in FP32), rounded to bfloat16; RoPE copied.
"""

from __future__ import annotations

import torch

KV_FP8_TOKEN_BYTES = 656
KV_DIM = 576
KV_NOPE = 512
KV_ROPE = 64
KV_TILE = 128
KV_TILES = KV_NOPE // KV_TILE
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4          # smallest amax / 448 a scale is made from (an all-zero tile gets 2 ** -13)


def tile_scales(nope: torch.Tensor) -> torch.Tensor:
    """The tiles' power-of-two scales, FP32 [N, 4], from the NoPE values [N, 512] (any float dtype)."""
    amax = nope.reshape(-1, KV_TILES, KV_TILE).abs().amax(dim=-1).float()
    return torch.pow(2, torch.clamp_min(amax / E4M3_MAX, SCALE_FLOOR).log2().ceil())


def quantize_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 576] bfloat16 -> the cache bytes [..., 656] uint8 (the module docstring's layout)."""
    lead = tuple(kv.shape[:-1])
    x = kv.reshape(-1, KV_DIM)
    n = x.shape[0]
    out = torch.empty((n, KV_FP8_TOKEN_BYTES), dtype=torch.uint8, device=kv.device)
    scales = tile_scales(x[:, :KV_NOPE])                                        # [N, 4]
    q = (x[:, :KV_NOPE].float().view(n, KV_TILES, KV_TILE) / scales[..., None]).to(torch.float8_e4m3fn)
    out[:, :KV_NOPE] = q.view(n, KV_NOPE).view(torch.uint8)
    out[:, KV_NOPE:KV_NOPE + 4 * KV_TILES] = scales.contiguous().view(torch.uint8)
    out[:, KV_NOPE + 4 * KV_TILES:] = x[:, KV_NOPE:].contiguous().view(torch.uint8)
    return out.view(*lead, KV_FP8_TOKEN_BYTES)


def dequantize_kv_fp8(cache: torch.Tensor) -> torch.Tensor:
    """The cache bytes [..., 656] (uint8 or float8_e4m3fn) -> kv [..., 576] bfloat16."""
    lead = tuple(cache.shape[:-1])
    b = cache.reshape(-1, KV_FP8_TOKEN_BYTES)
    if b.dtype != torch.uint8:
        b = b.view(torch.uint8)
    n = b.shape[0]
    q = b[:, :KV_NOPE].contiguous().view(torch.float8_e4m3fn).float().view(n, KV_TILES, KV_TILE)
    scales = b[:, KV_NOPE:KV_NOPE + 4 * KV_TILES].contiguous().view(torch.float32)   # [N, 4]
    out = torch.empty((n, KV_DIM), dtype=torch.bfloat16, device=cache.device)
    out[:, :KV_NOPE] = (q * scales[..., None]).view(n, KV_NOPE).to(torch.bfloat16)
    out[:, KV_NOPE:] = b[:, KV_NOPE + 4 * KV_TILES:].contiguous().view(torch.bfloat16)
    return out.view(*lead, KV_DIM)


# --- the indexer's paged FP8 key cache (DeepGEMM's fp8_paged_mqa_logits layout) ---------------------------------

def quantize_index_k_fp8(k: torch.Tensor) -> torch.Tensor:
    """Index keys k [num_blocks, block_size, D] (any float dtype) -> the paged FP8 cache [num_blocks, block_size,
    1, D + 4] uint8 in DeepGEMM's fp8_paged_mqa_logits layout: each page block holds its block_size x D E4M3 values
    (token-major) and then its block_size FP32 scales s = max(amax, 1e-4) / 448 (token t's value / s); the
    [.., 1, D + 4] shape is a view of those block_size x (D + 4) bytes, not one token per row."""
    n_blocks, bs, d = k.shape
    x = k.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(SCALE_FLOOR) / E4M3_MAX            # [nb, bs, 1]
    q = (x * (1.0 / scale)).to(torch.float8_e4m3fn)
    out = torch.empty((n_blocks, bs * (d + 4)), dtype=torch.uint8, device=k.device)
    out[:, :bs * d] = q.reshape(n_blocks, bs * d).view(torch.uint8)
    out[:, bs * d:] = scale.reshape(n_blocks, bs).contiguous().view(torch.uint8)
    return out.view(n_blocks, bs, 1, d + 4)


def dequantize_index_k_fp8(cache: torch.Tensor) -> torch.Tensor:
    """quantize_index_k_fp8's cache [num_blocks, block_size, 1, D + 4] (uint8) -> FP32 keys [num_blocks,
    block_size, D] (value x scale)."""
    n_blocks, bs, _, dd = cache.shape
    d = dd - 4
    flat = cache.reshape(n_blocks, bs * dd)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    q = flat[:, :bs * d].contiguous().view(torch.float8_e4m3fn).float().view(n_blocks, bs, d)
    scale = flat[:, bs * d:].contiguous().view(torch.float32).view(n_blocks, bs, 1)
    return q * scale
