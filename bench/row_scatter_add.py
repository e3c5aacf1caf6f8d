"""The row scatter-add (the deterministic backward modes' sum, dsagen/kernels/row_scatter_add): its kernel alone per
`unroll`, the reverse index, and the whole scatter_add_rows, on the chunks the backward ops hand it (GPU).

    python bench/row_scatter_add.py [--unrolls 1,2,4,8]

Cases: the sparse MLA backward's 1 GiB deterministic chunk at the headline shape (113 query rows x 2 head blocks x
2048 slots = 462848 rows of 576 FP32 values into a 32768-row accumulator, each query row's ids distinct) and the
indexer backward's (1024 query rows x 2048 slots of 128 values into 32768 rows). GB/s: the rows' bytes read per
second (each is read once; the accumulator's rows are read and written once more). Time: CUDA events around 3 calls
after a warm-up, median of 7 rounds, the kernels interleaved (common.paired_time_ms). Each variant's result is
checked bitwise against the op's kernel's. Build the variants first: dsagen build --spec '{"op": "row_scatter_add",
"fields": {"arch": "sm_90a", "width": 576, "unroll": 2}}' (and so on).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_time_ms, distinct_ids, paired_time_ms  # noqa: E402

from dsagen.jit import get_kernel  # noqa: E402
from dsagen.kernels.row_scatter_add import host as scatter_host  # noqa: E402
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec  # noqa: E402

CASES = [("sparse MLA backward chunk", 113, 2, 2048, 576, 32768), ("indexer backward chunk", 1024, 1, 2048, 128, 32768)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unrolls", default="1,2,4,8", help="kernel variants to time (RowScatterAddSpec.unroll)")
    args = ap.parse_args()
    unrolls = [int(u) for u in args.unrolls.split(",")]
    default = RowScatterAddSpec.unroll
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'case':28s} {'rows':>8s} {'width':>5s} {'variant':>14s} | {'ms':>8s} {'GB/s':>7s}")
    for name, q_rows, heads, slots, width, n_acc in CASES:
        ids = distinct_ids(q_rows, slots, n_acc, torch.Generator().manual_seed(0)).cuda()
        target = ids.unsqueeze(1).expand(q_rows, heads, slots).reshape(-1)
        m = target.numel()
        rows = torch.randn((m, width), device="cuda")
        acc0 = torch.randn((n_acc, width), device="cuda")
        order, ptr = scatter_host.reverse_index(target, n_acc)
        gb = m * width * 4 / 1e9
        runs, outs = [], []
        for u in [default] + [u for u in unrolls if u != default]:
            kernel = get_kernel(RowScatterAddSpec(arch="sm_90a", width=width, unroll=u))
            acc = acc0.clone()
            kernel.launch(acc, rows, order, ptr, n_acc)
            outs.append(acc)
            runs.append((f"kernel u{u}", lambda k=kernel, a=acc: k.launch(a, rows, order, ptr, n_acc)))
        for (label, _), out in zip(runs[1:], outs[1:]):
            assert torch.equal(out, outs[0]), label
        runs.append(("reverse index", lambda: scatter_host.reverse_index(target, n_acc)))
        times = paired_time_ms([fn for _, fn in runs], calls=3)
        whole = cuda_time_ms(lambda: scatter_host.scatter_add_rows(acc0.clone(), rows, target), calls=3, rounds=7)
        for (label, _), ms in zip(runs + [("scatter_add_rows", None)], times + [whole]):
            print(f"{name:28s} {m:8d} {width:5d} {label:>14s} | {ms:8.3f} {gb / ms * 1e3:7.0f}", flush=True)


if __name__ == "__main__":
    main()
