"""Dense indexer backward (cuDNN frontend DSA §10): dsagen's fused sm_90a kernel (indexer_bwd dense_host, the kernel
of DenseIndexerBwdSpec) beside cuDNN frontend's SM90 dense_indexer_backward_wrapper in one process on the same
tensors (GPU).

    python bench/dense_indexer_backward.py [--T 2048 4096 16384] [--D 128] [--rounds 7] [--no-cudnn]

B = 1, H = 64, S_k = T, ratio 1 (causal), bf16 indexer inputs, FP32 dense score rows (attention scores >= 0 with
their L1 norms, indexer scores with their LSE, -inf past the causal limit), grad_loss a device scalar. cuDNN
overwrites its two score inputs, so each of its calls gets its own fresh copies, made before the timed rounds
(rounds + 2 pairs); dsagen leaves its inputs alone. FLOPs: three GEMMs (S, dQ, dK) over the causal pairs, 6 H D per
pair, as ../shared/peers/cudnn_dsa_bench.py counts them for the figures it quotes. Timing:
bench/common.paired_time_ms (interleaved, median of the rounds; every call from an idle GPU). Before timing the
gradients of the two are compared (largest difference relative to the largest magnitude).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dsa_bench_start, print_paired  # noqa: E402

from dsagen.kernels.indexer_bwd import dense_host  # noqa: E402

H = 64


def inputs(t: int, d: int):
    gen = torch.Generator(device="cuda").manual_seed(t + d)
    q = (torch.randn((1, t, H, d), device="cuda", generator=gen) * 0.3).bfloat16()
    w = torch.randn((1, t, H), device="cuda", generator=gen).bfloat16()
    k = (torch.randn((1, t, d), device="cuda", generator=gen) * 0.3).bfloat16()
    vis = torch.ones((t, t), dtype=torch.bool, device="cuda").tril()[None]
    attn = torch.rand((1, t, t), device="cuda", generator=gen).masked_fill_(~vis, -math.inf)
    index = torch.randn((1, t, t), device="cuda", generator=gen).masked_fill_(~vis, -math.inf)
    norm = torch.where(vis, attn, 0.0).sum(-1)
    lse = torch.logsumexp(index, dim=-1)
    return q, w, k, attn, norm, index, lse, torch.ones(1, device="cuda")


def one(t: int, d: int, args, dsa) -> None:
    q, w, k, attn, norm, index, lse, grad = inputs(t, d)
    fns = [("dsagen", lambda: dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, grad_loss=grad))]
    if dsa is not None:
        pool = [(attn.clone(), index.clone()) for _ in range(args.rounds + 2)]

        def cudnn():
            a, i = pool.pop()
            return dsa.dense_indexer_backward_wrapper(q, w, k, a, norm, i, lse, grad, ratio=1)

        fns.append(("cudnn", cudnn))
        mine = fns[0][1]()
        theirs = cudnn()
        for name, a_, b_ in zip(("d_index_q", "d_weights", "d_index_k"), mine,
                                (theirs["d_index_q"], theirs["d_weights"], theirs["d_index_k"].view_as(mine[2]))):
            rel = ((a_.float() - b_.float()).abs().max() / b_.float().abs().max().clamp(min=1e-30)).item()
            print(f"T {t} D {d}: {name} rel diff {rel:.2e}", flush=True)
    print_paired(f"T {t} D {d}", fns, 6 * H * d * t * (t + 1) / 2, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-cudnn", action="store_true")
    args = ap.parse_args()
    dsa = dsa_bench_start(args.no_cudnn)
    for t in args.T:
        one(t, args.D, args, dsa)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
