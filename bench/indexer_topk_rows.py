"""Standalone indexer top-k (cuDNN frontend DSA §5, `dsagen.indexer_topk`): the fused sm_90a kernel against
torch.topk on the same rows, in one run (GPU).

    python bench/indexer_topk_rows.py [--rows 4096] [--cols 32768 131072] [--topk 2048]
    python bench/indexer_topk_rows.py --kernels 128,0 512,1 1024,1     # one kernel (threads, sample) per row

Rows: realistic indexer scores (bench/indexer_topk.realistic_rows: the weighted ReLU head sums of random bf16 q / k,
H 64, D 128) and plain normal values, FP32, every row of full length. Timed: the whole op with return_values=True
(indices and values; the fused op's ids come back in ascending order, torch.topk's by value) and with
return_values=False, against torch.topk(x, k, dim=-1) (values and indices; sorted=True and sorted=False). CUDA
events around back-to-back calls after a warm-up, median of 5 rounds; the fused sets are checked against torch.topk's
values (the k-th largest value and the count above it agree).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_time_ms  # noqa: E402
from indexer_topk import realistic_rows  # noqa: E402

import dsagen  # noqa: E402


def kernel_sweep(args) -> None:
    """The fused op with values, one kernel of `--kernels` (threads, sample) for every row in turn (a single-kernel
    TopkPlan through dsagen.kernels.indexer_topk.host, the sets checked against torch.topk), on the indexer rows."""
    from dsagen.kernels.indexer_topk.host import indexer_topk as fused_topk
    from dsagen.kernels.indexer_topk.spec import IndexerTopkRowsSpec
    from dsagen.kernels.lightning_indexer.topk_limits import TopkPlan

    kernels = [tuple(int(v) for v in k.split(",")) for k in args.kernels]
    print(f"{'cols':>7} | " + " | ".join(f"{t:>4} thr {'sampled' if s else 'passes':>7}" for t, s in kernels))
    for n in args.cols:
        gen = torch.Generator(device="cuda").manual_seed(n)
        x = realistic_rows(args.rows, n, gen)
        lens = torch.full((args.rows,), n, dtype=torch.int32, device="cuda")
        kth = torch.topk(x, args.topk, dim=-1).values[:, -1:]
        times = []
        for threads, sample in kernels:
            plan = TopkPlan.single(IndexerTopkRowsSpec(arch="sm_90a", threads=threads, sample=bool(sample)))
            _, vals = fused_topk(x, lens, args.topk, plan=plan)
            assert torch.equal(vals.min(-1, keepdim=True).values, kth)
            times.append(cuda_time_ms(lambda: fused_topk(x, lens, args.topk, plan=plan), calls=5, rounds=5))
        print(f"{n:7d} | " + " | ".join(f"{t:16.3f}" for t in times), flush=True)
        del x
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kernels", nargs="+", help="instead of the table: the ms of each kernel THREADS,SAMPLE (0/1)")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  rows {args.rows}  topk {args.topk}")
    if args.kernels:
        kernel_sweep(args)
        return
    print(f"{'cols':>7} {'rows are':>9} | {'fused ms':>9} {'no values':>9} | {'torch.topk':>10} {'unsorted':>9} | "
          f"{'x sorted':>8} {'x unsorted':>10}")
    for n in args.cols:
        gen = torch.Generator(device="cuda").manual_seed(n)
        for kind in ("indexer", "normal"):
            x = realistic_rows(args.rows, n, gen) if kind == "indexer" else \
                torch.randn((args.rows, n), generator=gen, device="cuda")
            lens = torch.full((args.rows,), n, dtype=torch.int32, device="cuda")
            got = dsagen.indexer_topk(x, lens, args.topk)
            ref_vals = torch.topk(x, args.topk, dim=-1).values
            kth = ref_vals[:, -1:]
            assert torch.equal(got.values.min(-1, keepdim=True).values, kth)
            assert torch.equal((got.values > kth).sum(-1), (ref_vals > kth).sum(-1))
            fused = cuda_time_ms(lambda: dsagen.indexer_topk(x, lens, args.topk), calls=5, rounds=5)
            fused_nv = cuda_time_ms(lambda: dsagen.indexer_topk(x, lens, args.topk, return_values=False), calls=5,
                                    rounds=5)
            ts = cuda_time_ms(lambda: torch.topk(x, args.topk, dim=-1), calls=5, rounds=5)
            tu = cuda_time_ms(lambda: torch.topk(x, args.topk, dim=-1, sorted=False), calls=5, rounds=5)
            print(f"{n:7d} {kind:>9} | {fused:9.3f} {fused_nv:9.3f} | {ts:10.3f} {tu:9.3f} | {ts / fused:8.1f} "
                  f"{tu / fused:10.1f}", flush=True)
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
