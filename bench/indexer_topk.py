"""Benchmark: the lightning-indexer top-k kernel alone, by row length and kernel variant (GPU).

    python bench/indexer_topk.py [--n 1024 4096 16384 32768 ...] [--variant t128 s512 ...] [--json FILE]

Each case is one launch over a slab of R rows of n candidates each (R = the rows the fused op puts in one slab at
S = n: fused.slab_rows with config_for's caps), rows filled with realistic scores (sum over 64 heads of
w * relu(q . k), H=64, D=128, random q/k/w: the key distribution decides how many radix passes run), topk 2048.
Prints microseconds per launch and nanoseconds per row; the basis of config_for's top-k plan.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import cuda_time_ms

#: --variant -> IndexerTopkSpec options: tN = N threads per row, sN = N threads with the sampled threshold
VARIANTS = {f"t{t}": {"threads": t} for t in (128, 512, 1024)}
VARIANTS.update({"s512": {"threads": 512, "sample": True}, "s1024": {"threads": 1024, "sample": True}})


def realistic_rows(rows: int, n: int, gen: torch.Generator, h: int = 64, d: int = 128) -> torch.Tensor:
    """fp32 [rows, n]: the reference's weighted_relu_scores of random bf16 q [rows, h, d] against n random bf16 keys
    with fp32 weights, scaled by 1 / sqrt(h d) as the score kernel writes them (in row chunks of ~256 MiB)."""
    from dsagen.reference.indexer import weighted_relu_scores

    dev = torch.device("cuda")
    k = torch.randn((1, n, d), device=dev, generator=gen, dtype=torch.bfloat16).float()
    out = torch.empty((rows, n), device=dev, dtype=torch.float32)
    step = max(1, 2 ** 28 // (h * n * 4))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q = torch.randn((1, r1 - r0, h, d), device=dev, generator=gen, dtype=torch.bfloat16).float()
        w = torch.randn((1, r1 - r0, h), device=dev, generator=gen, dtype=torch.float32)
        out[r0:r1] = weighted_relu_scores(q, k, w)[0] / (h * d) ** 0.5
    return out


def main(argv=None) -> int:
    from dsagen.kernels.lightning_indexer.host import slab_rows
    from dsagen.jit import get_kernel
    from dsagen.kernels.lightning_indexer.spec import IndexerTopkSpec, config_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 24576, 32768, 65536, 131072])
    ap.add_argument("--variant", choices=list(VARIANTS), nargs="+", default=list(VARIANTS))
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kernels = {v: get_kernel(IndexerTopkSpec(arch="sm_90a", **VARIANTS[v]), 0) for v in args.variant}
    config = config_for(64, 128, "bfloat16", "sm_90a")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  topk {args.topk}  (us per launch / ns per row)")
    print(f"{'n':>7} {'rows':>5} " + " ".join(f"{v:>14}" for v in args.variant))
    results = []
    for n in args.n:
        rows = slab_rows(64, n, config)
        ld = -(-n // 4) * 4
        slab = torch.zeros((rows, ld), device="cuda", dtype=torch.float32)
        slab[:, :n] = realistic_rows(rows, n, gen)
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * n
        out = torch.empty((1, rows, args.topk), dtype=torch.int32, device="cuda")
        line, row = [], {"n": n, "rows": rows}
        for v, kern in kernels.items():
            # args: slab, out, cu_q, cu_k, n_docs, T, S, n_tblk, blk0, qc, nrows, topk, causal, ratio, ld_slab
            us = 1e3 * cuda_time_ms(lambda: kern.launch(slab, out, cu_q, cu_k, rows, rows, rows * n, rows, 0, 1, rows,
                                                         args.topk, 0, 1, ld), rounds=args.reps)
            row[v] = round(us, 2)
            line.append(f"{us:7.1f}/{1e3 * us / rows:6.0f}")
        results.append(row)
        print(f"{n:>7} {rows:>5} " + " ".join(f"{c:>14}" for c in line), flush=True)
        slab = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "topk": args.topk,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
