"""Sparse attention score recompute (cuDNN frontend DSA §7): the fused sm_90a kernel against the plain-PyTorch
reference and against its floor, in one run (GPU).

    python bench/attn_score_recompute.py [--reps N] [--ref-max-T T] [--variants ss,prefetch_ids]

Shapes: T = 4096 and 32768 query rows (B = 1) over 32768 key rows, H=128 / D 576 and H=64 / D 512, top-k 2048, ids
distinct per row and all valid; lse from the fused forward. FLOPs = 2 * T * H * topk * D (the S products); bytes
= q + the gathered key rows once per row's CTA from L2 are not counted: the floor's bytes are q, ids, lse and the
output, read or written once (2 * T * H * D + 4 * T * topk * 2 + 4 * T * H). Floor = max(FLOPs / 780 TFLOP/s,
bytes / 4.2 TB/s). Time: CUDA events around `reps` back-to-back calls after a warm-up, median of 7 rounds, the op
and the `--variants` configs interleaved (bench/common.paired_time_ms; each variant's largest difference from the
op's output is printed).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import distinct_ids, op_and_variants_ms  # noqa: E402

import dsagen  # noqa: E402
from dsagen.kernels.attn_score_recompute import host as asr_host  # noqa: E402
from dsagen.kernels.attn_score_recompute.spec import AttnScoreRecomputeConfig  # noqa: E402

CASES = [(4096, 128, 576, 32768), (32768, 128, 576, 32768), (4096, 64, 512, 32768), (32768, 64, 512, 32768)]


def parse_variants(text: str) -> list[tuple[str, AttnScoreRecomputeConfig]]:
    """`--variants`: comma-separated configs, each '+'-joined flags of AttnScoreRecomputeConfig set to True
    ('ss' for none), e.g. 'ss,prefetch_ids'."""
    out = []
    for v in filter(None, text.split(",")):
        flags = [] if v == "ss" else v.split("+")
        out.append((v, AttnScoreRecomputeConfig(**{f: True for f in flags})))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ref-max-T", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default="",
                    help="other configs to time beside the op's, e.g. ss,prefetch_ids (flags set to True)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  topk {args.topk}")
    print(f"{'T':>6} {'H':>4} {'D':>4} {'KV':>6} {'config':>10} | {'fused ms':>9} {'TFLOP/s':>8} {'floor ms':>9} "
          f"{'of floor':>8} | {'ref ms':>8} {'x':>6}")
    for s_q, h, d, n_kv in CASES:
        gen = torch.Generator().manual_seed(0)
        ids = distinct_ids(s_q, args.topk, n_kv, gen).cuda().view(1, s_q, args.topk)
        cg = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((1, s_q, h, d), generator=cg, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn((1, n_kv, d), generator=cg, device="cuda", dtype=torch.bfloat16)
        scale = d ** -0.5
        _, lse, _ = dsagen.sparse_attention(q[0], kv[0], ids[0], softmax_scale=scale, d_v=512)
        lse = lse.view(1, s_q, h)
        call = lambda impl: dsagen.sparse_attn_score_recompute(q, kv, lse, ids, scale, impl=impl)  # noqa: E731
        flops = 2.0 * s_q * h * args.topk * d
        nbytes = 2 * s_q * h * d + 4 * s_q * args.topk * 2 + 4 * s_q * h
        floor = max(flops / 780e12, nbytes / 4.2e12) * 1e3
        runs = [("op", lambda: call("fused"))]
        for name, cfg in variants:
            runs.append((name, lambda cfg=cfg: asr_host.sparse_attn_score_recompute(q, kv, lse, ids, scale,
                                                                                    config=cfg)))
        reference = (lambda: call("reference")) if s_q <= args.ref_max_T else None
        for name, ms, ref in op_and_variants_ms(runs, args.reps, reference, exact=False):
            print(f"{s_q:6d} {h:4d} {d:4d} {n_kv:6d} {name:>10} | {ms:9.3f} {flops / ms / 1e9:8.1f} {floor:9.3f} "
                  f"{floor / ms:8.2f} | {ref}", flush=True)
        del q, kv, lse, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
