"""Sparse indexer backward (cuDNN frontend DSA §9): the fused sm_90a kernel (atomic and deterministic d_index_k)
against the plain-PyTorch reference and against its floor, in one run (GPU).

    python bench/indexer_backward.py [--reps N] [--ref-max-T T] [--variants as-given,ordered,...]

Shapes: T = 4096 and 32768 query rows (B = 1) over 32768 or 131072 key rows, the DeepSeek-V3.2 indexer (H 64, D 128,
bf16), top-k 2048, ids distinct per row and all valid, attn_score / index_score random distributions. FLOPs = 3 * 2
* T * H * topk * D (S = K Q^T, dQ = G^T K, dK = G Q). The floor's bytes are what must be read or written once: q,
weights, ids, both scores, d_index_q, d_weights, the key pool and d_index_k (FP32 accumulator and the output);
floor = max(FLOPs / 780 TFLOP/s, bytes / 4.2 TB/s). "atomic GB/s": the FP32 d_index_k bytes the kernel adds with
atomics (4 * T * topk * D) per second. Time: CUDA events around `reps` back-to-back calls after a warm-up, median
of 7 rounds (the whole op: the score gradient in torch, the kernel, the casts). `--variants` also times other configs
of the op, interleaved with it (bench/common.op_and_variants_ms; each prints its largest difference from the op's
gradients): "as-given" without the key-window ordering, "ordered" with it at any pool size, "w8192" / "w32768"
ordered by windows of that many key rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import distinct_ids, op_and_variants_ms  # noqa: E402

import dsagen  # noqa: E402
from dsagen.kernels.indexer_bwd import host as ib_host  # noqa: E402
from dsagen.kernels.indexer_bwd.spec import config_for  # noqa: E402

CASES = [(4096, 32768), (4096, 131072), (32768, 32768)]
H, D = 64, 128
VARIANTS = {"as-given": dict(bucket_rows=None), "ordered": dict(order_min_bytes=0),
            "w8192": dict(order_min_bytes=0, bucket_rows=8192), "w32768": dict(order_min_bytes=0, bucket_rows=32768)}


def flat(grads) -> torch.Tensor:
    """The three gradients as one FP32 vector (for the variants' comparison)."""
    return torch.cat([g.float().flatten() for g in grads])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ref-max-T", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default="", help=f"other configs to time, from {sorted(VARIANTS)}")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown --variants {unknown}; known: {sorted(VARIANTS)}")
    op_config = config_for(D, torch.bfloat16, "sm_90a", None)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H {H}  D {D}  topk {args.topk}")
    print(f"{'T':>6} {'KV':>6} {'mode':>13} {'config':>8} | {'fused ms':>9} {'TFLOP/s':>8} {'atomic GB/s':>11} "
          f"{'floor ms':>9} {'of floor':>8} | {'ref ms':>8} {'x':>6}")
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
            runs = [("op", lambda det=det: flat(dsagen.indexer_backward(q, w, k, tgt, p, ids, deterministic=det,
                                                                        **kw)))]
            for name in variants:
                cfg = dataclasses.replace(op_config, **VARIANTS[name])
                runs.append((name, lambda det=det, cfg=cfg: flat(ib_host.indexer_backward(
                    q, w, k, tgt, p, ids, deterministic=det, config=cfg, **kw))))
            reference = None
            if not det and s_q <= args.ref_max_T:
                reference = lambda: dsagen.indexer_backward(q, w, k, tgt, p, ids, impl="reference", **kw)  # noqa
            mode = "deterministic" if det else "atomic"
            for name, ms, ref in op_and_variants_ms(runs, args.reps, reference, exact=False):
                print(f"{s_q:6d} {n_kv:6d} {mode:>13} {name:>8} | {ms:9.3f} {flops / ms / 1e9:8.1f} "
                      f"{atomic_bytes / ms / 1e6:11.0f} {floor:9.3f} {floor / ms:8.2f} | {ref}", flush=True)
        del q, k, w, tgt, p, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
