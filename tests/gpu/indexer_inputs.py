"""Random inputs of the dense indexer GPU tests (indexer_scores, dense_indexer_score_recompute,
indexer_forward_topk), on the CUDA device, drawn from a CPU generator so a seed gives the same tensors everywhere."""

from __future__ import annotations

import torch

DEV = "cuda"


def bshd(b, sq, sk, h, d, gen, dtype=torch.bfloat16, k4=False):
    """q [B, S_q, H, D], k [B, S_k, D] (k4: [B, S_k, 1, D]), weights [B, S_q, H], randn in `dtype`."""
    q = torch.randn((b, sq, h, d), generator=gen).to(dtype).to(DEV)
    k = torch.randn((b, sk, 1, d) if k4 else (b, sk, d), generator=gen).to(dtype).to(DEV)
    w = torch.randn((b, sq, h), generator=gen).to(dtype).to(DEV)
    return q, k, w


def thd(lens_q, lens_k, tail_q, h, d, gen, dtype=torch.bfloat16, int64=False):
    """Packed inputs: segments of lens_q / lens_k rows, plus tail_q query rows after the last segment and 3 key rows
    in no segment; returns q, k, weights, cu_seqlens_q, cu_seqlens_k (int32, or int64)."""
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int64 if int64 else torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=cu_q.dtype)
    total_q, total_k = int(cu_q[-1]) + tail_q, int(cu_k[-1]) + 3
    q = torch.randn((total_q, h, d), generator=gen).to(dtype).to(DEV)
    k = torch.randn((total_k, d), generator=gen).to(dtype).to(DEV)
    w = torch.randn((total_q, h), generator=gen).to(dtype).to(DEV)
    return q, k, w, cu_q.to(DEV), cu_k.to(DEV)


def fp8_inputs(shape_q, shape_k, shape_w, gen, w_dtype=torch.bfloat16):
    """E4M3 q / k (randn * 4: values over E4M3's range of exponents), weights of w_dtype, positive FP32 descales
    q_scale (shape_w) and k_scale (shape_k without D): q, k, weights, q_scale, k_scale."""
    q = (torch.randn(shape_q, generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    k = (torch.randn(shape_k, generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    w = torch.randn(shape_w, generator=gen).to(w_dtype).to(DEV)
    q_scale = (torch.rand(shape_w, generator=gen) + 0.05).to(DEV)
    k_scale = (torch.rand(shape_k[:-1], generator=gen) + 0.05).to(DEV)
    return q, k, w, q_scale, k_scale
