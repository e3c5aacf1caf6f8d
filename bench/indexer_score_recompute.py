"""Sparse indexer score recompute (cuDNN frontend DSA §6): the fused sm_90a kernel against the plain-PyTorch
reference and against its floor, in one run (GPU).

    python bench/indexer_score_recompute.py [--reps N] [--ref-max-T T] [--variants 4x2,6x2,8x1]

Shapes: T = 4096 and 32768 query rows (B = 1) over 32768 or 131072 key rows, the DeepSeek-V3.2 indexer (H 64, D 128,
bf16), top-k 2048, ids distinct per row and all valid. FLOPs = 2 * T * H * topk * D (the S products). The floor's
bytes are what must be read or written once: q, weights, ids, the output and the key pool (2 * T * H * D + 2 * T *
H + 4 * T * topk * 2 + 2 * S_k * D); floor = max(FLOPs / 780 TFLOP/s, bytes / 4.2 TB/s). "gather GB/s" is the key
rows the kernel gathers (2 * T * topk * D bytes, mostly from L2) per second. Time: CUDA events around `reps`
back-to-back calls after a warm-up, median of 7 rounds; `--variants` also times other configs (STAGESxCTAS_PER_SM)
on the same inputs (they must be in the cache), interleaved with the op's round by round in a shuffled order
(common.paired_time_ms), and checks that they return the op's output bitwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import distinct_ids, op_and_variants_ms  # noqa: E402

import dsagen  # noqa: E402
from dsagen.kernels.indexer_score_recompute import host as isr_host  # noqa: E402
from dsagen.kernels.indexer_score_recompute.spec import IndexerScoreRecomputeConfig  # noqa: E402

CASES = [(4096, 32768), (4096, 131072), (32768, 32768)]
H, D = 64, 128


def parse_variants(text: str) -> list[IndexerScoreRecomputeConfig]:
    out = []
    for v in filter(None, text.split(",")):
        stages, ctas = (int(x) for x in v.split("x"))
        out.append(IndexerScoreRecomputeConfig(stages=stages, ctas_per_sm=ctas))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ref-max-T", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default="", help="other configs to time, e.g. 4x2,6x2,8x1 (STAGESxCTAS_PER_SM)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H {H}  D {D}  topk {args.topk}")
    print(f"{'T':>6} {'KV':>6} {'config':>6} | {'fused ms':>9} {'TFLOP/s':>8} {'gather GB/s':>11} {'floor ms':>9} "
          f"{'of floor':>8} | {'ref ms':>8} {'x':>6}")
    for s_q, n_kv in CASES:
        gen = torch.Generator().manual_seed(0)
        ids = distinct_ids(s_q, args.topk, n_kv, gen).cuda().view(1, s_q, args.topk)
        cg = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((1, s_q, H, D), generator=cg, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, n_kv, D), generator=cg, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn((1, s_q, H), generator=cg, device="cuda") * H ** -0.5).bfloat16()
        scale = D ** -0.5
        flops = 2.0 * s_q * H * args.topk * D
        nbytes = 2 * s_q * H * D + 2 * s_q * H + 4 * s_q * args.topk * 2 + 2 * n_kv * D
        floor = max(flops / 780e12, nbytes / 4.2e12) * 1e3
        gathered = 2.0 * s_q * args.topk * D
        runs = [("op", lambda: dsagen.sparse_indexer_score_recompute(q, k, w, ids, sm_scale=scale))]
        for cfg in variants:
            runs.append((f"{cfg.stages}x{cfg.ctas_per_sm}", lambda cfg=cfg: isr_host.sparse_indexer_score_recompute(
                q, k, w, ids, sm_scale=scale, config=cfg)))
        reference = None
        if s_q <= args.ref_max_T:
            reference = lambda: dsagen.sparse_indexer_score_recompute(q, k, w, ids, sm_scale=scale,  # noqa: E731
                                                                      impl="reference")
        for name, ms, ref in op_and_variants_ms(runs, args.reps, reference):
            print(f"{s_q:6d} {n_kv:6d} {name:>6} | {ms:9.3f} {flops / ms / 1e9:8.1f} {gathered / ms / 1e6:11.0f} "
                  f"{floor:9.3f} {floor / ms:8.2f} | {ref}", flush=True)
        del q, k, w, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
