"""Sparse indexer backward (cuDNN frontend DSA §9): the fused sm_90a kernel (atomic and deterministic d_index_k)
against the plain-PyTorch reference and against its floor, in one run (GPU).

    python bench/indexer_backward.py [--reps N] [--ref-max-T T]

Shapes: T = 4096 and 32768 query rows (B = 1) over 32768 or 131072 key rows, the DeepSeek-V3.2 indexer (H 64, D 128,
bf16), top-k 2048, ids distinct per row and all valid, attn_score / index_score random distributions. FLOPs = 3 * 2
* T * H * topk * D (S = K Q^T, dQ = G^T K, dK = G Q). The floor's bytes are what must be read or written once: q,
weights, ids, both scores, d_index_q, d_weights, the key pool and d_index_k (FP32 accumulator and the output);
floor = max(FLOPs / 780 TFLOP/s, bytes / 4.2 TB/s). "atomic GB/s": the FP32 d_index_k bytes the kernel adds with
atomics (4 * T * topk * D) per second. Time: CUDA events around `reps` back-to-back calls after a warm-up, median
of 7 rounds (the whole op: the score gradient in torch, the kernel, the casts).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_time_ms, distinct_ids  # noqa: E402

import dsagen  # noqa: E402

CASES = [(4096, 32768), (4096, 131072), (32768, 32768)]
H, D = 64, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ref-max-T", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H {H}  D {D}  topk {args.topk}")
    print(f"{'T':>6} {'KV':>6} {'mode':>13} | {'fused ms':>9} {'TFLOP/s':>8} {'atomic GB/s':>11} {'floor ms':>9} "
          f"{'of floor':>8} | {'ref ms':>8} {'x':>6}")
    for s_q, n_kv in CASES:
        gen = torch.Generator().manual_seed(0)
        ids = distinct_ids(s_q, args.topk, n_kv, gen).cuda().view(1, s_q, args.topk)
        cg = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((1, s_q, H, D), generator=cg, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, n_kv, D), generator=cg, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn((1, s_q, H), generator=cg, device="cuda") * H ** -0.5).bfloat16()
        tgt = torch.softmax(torch.randn((1, s_q, args.topk), generator=cg, device="cuda") * 2, -1)
        p = torch.softmax(torch.randn((1, s_q, args.topk), generator=cg, device="cuda") * 2, -1)
        kw = dict(sm_scale=D ** -0.5, grad_loss=torch.ones((), device="cuda"))
        flops = 3 * 2.0 * s_q * H * args.topk * D
        nbytes = 2 * (2 * s_q * H * D + 2 * s_q * H) + 3 * 4 * s_q * args.topk + 2 * n_kv * D + (4 * 2 + 2) * n_kv * D
        floor = max(flops / 780e12, nbytes / 4.2e12) * 1e3
        atomic_bytes = 4.0 * s_q * args.topk * D
        for det in (False, True):
            fn = lambda det=det: dsagen.indexer_backward(q, w, k, tgt, p, ids, deterministic=det, **kw)  # noqa: E731
            ms = cuda_time_ms(fn, calls=args.reps, rounds=7)
            ref = "-        -"
            if not det and s_q <= args.ref_max_T:
                rms = cuda_time_ms(lambda: dsagen.indexer_backward(q, w, k, tgt, p, ids, impl="reference", **kw),
                                   rounds=3)
                ref = f"{rms:8.2f} {rms / ms:6.1f}"
            mode = "deterministic" if det else "atomic"
            print(f"{s_q:6d} {n_kv:6d} {mode:>13} | {ms:9.3f} {flops / ms / 1e9:8.1f} {atomic_bytes / ms / 1e6:11.0f} "
                  f"{floor:9.3f} {floor / ms:8.2f} | {ref}", flush=True)
        del q, k, w, tgt, p, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
