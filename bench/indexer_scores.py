"""Benchmark: fused dsagen.indexer_scores (sm_90a: the lightning indexer's wgmma score kernel in its dense_scores form +
the mask / LSE pass) against the plain-PyTorch reference, in one process (GPU).

    python bench/indexer_scores.py [--T 4096 8192 32768] [--ratio 1 4] [--reps 5] [--ref-max-T 8192]
                                   [--json FILE] [--queued] [--trace]

BSHD, B = 1, H=64, D=128, bf16, S_k = T // ratio, fresh random inputs, no q_causal_offsets. Each figure is the median
of --reps timed calls (CUDA events) after one warm-up call (common.cuda_time_ms; --queued also times each call
behind a spin kernel: the op's GPU time as inside a model step). Columns:
  fused        the op, allocating its output (scores only);
  +lse         return_lse=True (the mask pass also reads the valid scores back);
  owned        scores and LSE into caller-owned out / lse_out (what a captured CUDA graph runs);
  TFLOP/s      causal: 2 H D x (valid score entries), the work the kernel does; dense: 2 H D S_q S_k (the figure a
               dense kernel without causal skipping would quote) over the `fused` time;
  floor        the causal FLOPs at 780 TFLOP/s (dense bf16 measured on the H200) plus the output's bytes
               (4 S_q S_k) at 4.8 TB/s, as if nothing overlapped;
  ref          the reference (FP32, chunked), only up to --ref-max-T.
--trace reports each kernel's device time inside the op (torch.profiler): score launches and the mask / LSE pass.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import cuda_time_ms

PEAK_TFLOPS = 780.0
PEAK_TBPS = 4.8
H, D = 64, 128


def valid_entries(t: int, ratio: int) -> int:
    """sum over query rows t of min(S_k, (t + 1) // ratio): the entries the score kernel computes."""
    s = t // ratio
    return sum(min(s, (tt + 1) // ratio) for tt in range(t))


def _trace(call, reps: int) -> dict:
    """Device time per kernel inside the real op (torch.profiler / CUPTI), ms per call: score and mask / LSE."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    us = {"score": 0.0, "mask": 0.0}
    for ev in prof.key_averages():
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if "lightning_indexer_score" in ev.key:
            us["score"] += t
        elif "indexer_scores_mask_lse" in ev.key:
            us["mask"] += t
    return {"trace_score_ms": round(us["score"] / reps / 1e3, 3), "trace_mask_ms": round(us["mask"] / reps / 1e3, 3)}


def one_shape(t: int, ratio: int, args, gen: torch.Generator) -> dict:
    """Time one (T, ratio); the inputs and outputs are freed on return."""
    import dsagen

    dev = torch.device("cuda")
    s = t // ratio
    q = torch.randn((1, t, H, D), device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn((1, s, D), device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn((1, t, H), device=dev, generator=gen, dtype=torch.bfloat16)
    ikw = {"ratio": ratio}
    if args.precision == "fp8":
        # E4M3 q / k with positive FP32 descales (the FP8 kernel's contract)
        q, k = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        ikw.update(precision="fp8", q_scale=torch.full((1, t, H), 0.5, device=dev),
                   k_scale=torch.full((1, s), 0.25, device=dev))
    bufs = {"out": torch.empty((1, t, s), device=dev), "lse": torch.empty((1, t), device=dev)}
    flops = 2 * H * D * valid_entries(t, ratio)
    floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3 + 4 * t * s / (PEAK_TBPS * 1e12) * 1e3

    def fused():
        return dsagen.indexer_scores(q, k, w, **ikw)

    def with_lse():
        return dsagen.indexer_scores(q, k, w, return_lse=True, **ikw)

    def owned():
        return dsagen.indexer_scores(q, k, w, return_lse=True, out=bufs["out"], lse_out=bufs["lse"], **ikw)

    fused_ms = cuda_time_ms(fused, rounds=args.reps)
    row = {"T": t, "ratio": ratio, "fused_ms": round(fused_ms, 3),
           "lse_ms": round(cuda_time_ms(with_lse, rounds=args.reps), 3),
           "owned_ms": round(cuda_time_ms(owned, rounds=args.reps), 3),
           "causal_tflops": round(flops / (fused_ms * 1e9), 1),
           "dense_tflops": round(2 * H * D * t * s / (fused_ms * 1e9), 1), "floor_ms": round(floor_ms, 3),
           "fraction_of_floor": round(floor_ms / fused_ms, 3), "reference_ms": None, "speedup": None}
    if args.queued:
        row["queued_owned_ms"] = round(cuda_time_ms(owned, rounds=args.reps, queued=True), 3)
    if args.trace:
        row.update(_trace(with_lse, max(2, min(args.reps, 5))))
    if t <= args.ref_max_T:
        bufs.clear()
        torch.cuda.empty_cache()
        ref = cuda_time_ms(lambda: dsagen.indexer_scores(q, k, w, impl="reference", **ikw),
                           rounds=max(1, min(args.reps, 3)))
        row.update(reference_ms=round(ref, 2), speedup=round(ref / fused_ms, 1))
    return row


def run(args) -> list[dict]:
    gen = torch.Generator(device=torch.device("cuda")).manual_seed(0)
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H={H} D={D} {args.precision} B=1 ratio-causal")
    print(f"{'T':>7} {'ratio':>5} {'fused ms':>9} {'+lse ms':>8} {'owned ms':>9} {'causal TF/s':>11} "
          f"{'dense TF/s':>10} {'floor ms':>9} {'of floor':>8} {'ref ms':>9} {'speedup':>8}")
    for t in args.T:
        for ratio in args.ratio:
            row = one_shape(t, ratio, args, gen)
            torch.cuda.empty_cache()
            rows.append(row)
            ref = row["reference_ms"]
            speedup = f"{row['speedup']}x" if ref else "-"
            print(f"{t:>7} {ratio:>5} {row['fused_ms']:>9.2f} {row['lse_ms']:>8.2f} {row['owned_ms']:>9.2f} "
                  f"{row['causal_tflops']:>11.1f} {row['dense_tflops']:>10.1f} {row['floor_ms']:>9.2f} "
                  f"{row['fraction_of_floor']:>8.2f} {(f'{ref:.1f}' if ref else '-'):>9} "
                  f"{speedup:>8}"
                  + (f"   queued (owned) {row['queued_owned_ms']:.2f} ms" if args.queued else "")
                  + (f"   in the op: score {row['trace_score_ms']:.2f} ms, mask+lse {row['trace_mask_ms']:.2f} ms"
                     if args.trace else ""), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 8192, 32768])
    ap.add_argument("--ratio", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="bf16 inputs, or E4M3 q / k with FP32 descales (indexer_scores(precision='fp8'))")
    ap.add_argument("--ref-max-T", type=int, default=8192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--queued", action="store_true",
                    help="also time the caller-owned call queued behind a spin kernel (common.cuda_time_ms)")
    ap.add_argument("--trace", action="store_true",
                    help="also report each kernel's device time inside the op (torch.profiler)")
    args = ap.parse_args(argv)
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
