"""The dense warm-up indexer step (cuDNN frontend DSA §8 + §10): dsagen's three fused ops (dense_attn_score_recompute,
dense_indexer_score_recompute, dense_indexer_backward) and its fused loss path dsagen.dense_indexer_kl_backward
(no [S_q, S_k] tensor) beside cuDNN frontend's three SM90 calls (dense_attn_score_recompute_wrapper,
dense_indexer_score_recompute_wrapper, dense_indexer_backward_wrapper) in one process on the same tensors (GPU).

    python bench/dense_warmup_step.py [--T 2048 4096 16384] [--peak-T 131072] [--rounds 5] [--no-cudnn]

B = 1, attention H 128 D 576 (one key head), indexer H 64 D 128, ratio 1 (causal), bf16, grad_loss a device scalar.
The attention LSE is the true dense one (FP32) up to T 16384 and a constant beyond (the values do not change the
work). Before timing, the KL path's gradients are compared with the three-op path's (largest difference relative
to the largest magnitude). Timing: bench/common.print_paired (interleaved, median of the rounds; every call from
an idle GPU); the FLOPs counted are those of the three cuDNN-style ops over the causal pairs (attention 2 H D,
indexer scores 2 H D, indexer backward 6 H D per pair). --peak-T: the KL path's peak CUDA memory beyond its inputs
at that T (torch.cuda.max_memory_allocated), and its time for one call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dsa_bench_start, print_paired  # noqa: E402
from dense_attn_recompute import dense_lse  # noqa: E402

import dsagen  # noqa: E402

H_A, D_A, H_I, D_I = 128, 576, 64, 128


def inputs(t: int):
    gen = torch.Generator(device="cuda").manual_seed(t)
    q = (torch.randn((1, t, H_A, D_A), device="cuda", generator=gen) * 0.5).bfloat16()
    k = (torch.randn((1, t, D_A), device="cuda", generator=gen) * 0.5).bfloat16()
    scale = D_A ** -0.5
    lse = dense_lse(q, k, scale) if t <= 16384 else torch.full((1, t, H_A), 12.0, device="cuda")
    iq = (torch.randn((1, t, H_I, D_I), device="cuda", generator=gen) * 0.3).bfloat16()
    w = torch.randn((1, t, H_I), device="cuda", generator=gen).bfloat16()
    ik = (torch.randn((1, t, D_I), device="cuda", generator=gen) * 0.3).bfloat16()
    return q, k, lse, scale, iq, w, ik, torch.ones(1, device="cuda")


def one(t: int, args, dsa) -> None:
    q, k, lse, scale, iq, w, ik, grad = inputs(t)
    sm = D_I ** -0.5

    def three_ops():
        a = dsagen.dense_attn_score_recompute(q, k, lse, scale)
        s = dsagen.dense_indexer_score_recompute(iq, ik, w, sm_scale=sm)
        return dsagen.dense_indexer_backward(iq, w, ik, a[0], a[1], s.out, s.denom, grad_loss=grad, sm_scale=sm)

    def kl_path():
        return dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, softmax_scale=scale, sm_scale=sm,
                                                grad_loss=grad)

    fns = [("dsagen 3 ops", three_ops), ("dsagen kl path", kl_path)]
    if dsa is not None:
        k4, ik4 = k.unsqueeze(2), ik.unsqueeze(2)

        def cudnn():
            a = dsa.dense_attn_score_recompute_wrapper(q, k4, lse, scale, ratio=1)
            s = dsa.dense_indexer_score_recompute_wrapper(iq, ik4, w, sm_scale=sm, ratio=1)
            return dsa.dense_indexer_backward_wrapper(iq, w, ik, a["out"], a["denom"], s["out"], s["denom"], grad,
                                                      sm_scale=sm, ratio=1)

        fns.insert(1, ("cudnn 3 calls", cudnn))
    ref, kl = three_ops(), kl_path()
    for name, a_, b_ in zip(("d_index_q", "d_weights", "d_index_k"), kl[1:], ref):
        rel = ((a_.float() - b_.float()).abs().max() / b_.float().abs().max().clamp(min=1e-30)).item()
        print(f"T {t}: kl path vs 3 ops {name} rel diff {rel:.2e}", flush=True)
    del ref, kl
    pairs = t * (t + 1) / 2
    flops = pairs * (2 * H_A * D_A + 2 * H_I * D_I + 6 * H_I * D_I)
    ms = print_paired(f"T {t}", fns, flops, args.rounds)
    names = [n for n, _ in fns]
    kl = ms[names.index("dsagen kl path")]
    vs = f"3 ops vs cuDNN {ms[names.index('cudnn 3 calls')] / ms[0]:.2f}x; " if "cudnn 3 calls" in names else ""
    print(f"T {t}: {vs}kl path / 3 ops {kl / ms[0]:.2f}", flush=True)


def peak(t: int) -> None:
    q, k, lse, scale, iq, w, ik, grad = inputs(t)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    res = dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, softmax_scale=scale, sm_scale=D_I ** -0.5,
                                           grad_loss=grad)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"T {t}: kl path peak memory beyond its inputs {extra:.2f} GiB (inputs {base / 2**30:.2f} GiB), one call "
          f"{sec:.2f} s (first call), loss {res.loss.item():.4g}; an [S_q, S_k] FP32 tensor would be "
          f"{t * t * 4 / 2**30:.0f} GiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[2048, 4096, 16384])
    ap.add_argument("--peak-T", type=int, nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-cudnn", action="store_true")
    args = ap.parse_args()
    dsa = dsa_bench_start(args.no_cudnn)
    for t in args.T:
        one(t, args, dsa)
        torch.cuda.empty_cache()
    for t in args.peak_T:
        peak(t)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
