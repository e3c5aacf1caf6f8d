"""Benchmark: fused lightning_indexer (sm_90a wgmma scores + radix top-k) against the plain-PyTorch
chunked reference, in one process (GPU). Results go to BENCHMARKS.md.

    python bench/indexer.py [--T 8192 32768 131072] [--topk 512 2048] [--ratio 1 4] [--reps 5]
                            [--ref-max-T 32768] [--json FILE] [--queued] [--profile] [--trace]
                            [--variant NAME [NAME ...]]

Causal, H=64, D=128, bf16, fresh random inputs. Each figure is the median of --reps timed calls
(CUDA events) after one warm-up call, each call timed alone from an idle GPU (host launch latency and the GPU's
clock ramp-up included); --queued also times each call behind a spin kernel (busy GPU, every launch queued: the
op's GPU time as inside a model step, 1-1.5 ms less at T=32768 on some H200s). FLOPs count the causal pairs only: 2*H*D*sum_t #candidates(t);
the tensor-core floor is that at 780 TFLOP/s (dense bf16 measured on the H200). The reference is timed
only up to --ref-max-T (it takes seconds beyond). --profile also times the score and top-k kernels
alone (one slab loop with each kernel launched alone). --variant runs the op with another IndexerConfig (VARIANTS:
a replaced copy of config_for's, passed as dsagen.kernels.lightning_indexer.host.lightning_indexer(..., config=...));
"default" is the public op itself. Several names run one after the other on the same inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from common import cuda_time_ms

PEAK_TFLOPS = 780.0
H, D = 64, 128


def variants(arch: str = "sm_90a") -> dict:
    """--variant -> the IndexerConfig it runs (None: the public op with config_for's config)."""
    from dsagen.kernels.lightning_indexer.spec import IndexerTopkSpec, TopkPlan, config_for

    cfg = config_for(H, D, "bfloat16", arch)
    def one(threads):
        return dataclasses.replace(cfg, topk=TopkPlan.single(IndexerTopkSpec(arch=arch, threads=threads)))

    out = {"default": None,
           # top-k: one kernel for every slab instead of the plan (512 threads, 1024 when a slab's rows fit one wave)
           "topk_one": dataclasses.replace(cfg, topk=TopkPlan.single(IndexerTopkSpec(arch=arch, threads=512),
                                                                     IndexerTopkSpec(arch=arch, threads=1024)))}
    out.update({f"t{t}": one(t) for t in (128, 512, 1024)})              # top-k: always that many threads per row
    out.update({f"slab{m}": dataclasses.replace(cfg, slab_bytes=m << 20) for m in (16, 32, 64)})    # slab cap, MiB
    out.update({f"rows{r}": dataclasses.replace(cfg, slab_max_rows=r) for r in (2048, 4096)})       # slab row cap
    out.update({f"chunk{c}": dataclasses.replace(cfg, chunk_rows=c) for c in (2048, 8192, 16384)})  # work items
    return out


def causal_pairs(t: int, ratio: int) -> int:
    s = t // ratio
    return sum(min(s, (tt + 1) // ratio) for tt in range(t))


class _Skip:
    """Stands in for one of the two kernels so that the other is timed alone."""

    @staticmethod
    def launch(*args, **kwargs):
        return None


def _call(q, k, w, topk, ratio, config):
    """One op call: the public op (config None) or the fused entry point with `config`."""
    import dsagen
    from dsagen.kernels.lightning_indexer import host as fused

    if config is None:
        return dsagen.lightning_indexer(q, k, w, topk, causal=True, compress_ratio=ratio, impl="fused")
    return fused.lightning_indexer(q, k, w, topk, causal=True, compress_ratio=ratio, cu_seqlens=None,
                                   cu_seqlens_k=None, kernel_options=None, config=config)


def _profile(q, k, w, topk, ratio, config, reps) -> dict:
    from dsagen.kernels.lightning_indexer import host as fused

    call = lambda: _call(q, k, w, topk, ratio, config)   # noqa: E731
    kernels = fused._kernels_for(q.device, q.shape[2], q.shape[3], q.dtype, config)
    key = next(key for key, v in fused._kernels.items() if v is kernels)
    try:
        fused._kernels[key] = dataclasses.replace(kernels, topk=dict.fromkeys(kernels.topk, _Skip))
        score_ms = cuda_time_ms(call, rounds=reps)
        fused._kernels[key] = dataclasses.replace(kernels, score=_Skip)
        topk_ms = cuda_time_ms(call, rounds=reps)
    finally:
        fused._kernels[key] = kernels
    return {"score_ms": round(score_ms, 3), "topk_ms": round(topk_ms, 3)}


def _trace(q, k, w, topk, ratio, config, reps) -> dict:
    """Device time per kernel inside the real op (torch.profiler / CUPTI), ms per call: score and top-k."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            _call(q, k, w, topk, ratio, config)
        torch.cuda.synchronize()
    us = {"score": 0.0, "topk": 0.0}
    for ev in prof.key_averages():
        for part in us:
            if part in ev.key and "lightning_indexer" in ev.key:
                us[part] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {"trace_score_ms": round(us["score"] / reps / 1e3, 3), "trace_topk_ms": round(us["topk"] / reps / 1e3, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--topk", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--ratio", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ref-max-T", type=int, default=32768)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also time the score and top-k kernels alone")
    ap.add_argument("--queued", action="store_true",
                    help="also time each call queued behind a spin kernel (busy GPU, launches queued: the op's GPU "
                         "time as inside a model step; common.cuda_time_ms)")
    ap.add_argument("--trace", action="store_true",
                    help="also report each kernel's device time inside the real op (torch.profiler)")
    ap.add_argument("--variant", choices=list(variants()), nargs="+", default=["default"],
                    help="default: the public op; topk_one: one top-k kernel for every slab (512 threads, 1024 when a "
                         "slab's rows fit one wave); t128 / t512 / t1024: top-k with that many threads per row for every "
                         "slab; slab16 / slab32 / slab64: the score slab capped at that many MiB (default 128); "
                         "rows2048 / rows4096: at that many rows (default 1024); chunk2048 / chunk8192 / chunk16384: "
                         "score work items of that many candidates (default 4096)")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.variant))
    results = [_run_variant(n, args) for n in names]
    if len(results) > 1 and args.profile:
        print("\n# per-kernel times (ms)")
        print(f"{'variant':<26} {'T':>7} {'topk':>5} {'ratio':>5} {'score ms':>9} {'top-k ms':>9} {'total ms':>9}")
        for res in results:
            for row in res["rows"]:
                print(f"{res['variant']:<26} {row['T']:>7} {row['topk']:>5} {row['ratio']:>5} {row['score_ms']:>9.3f} "
                      f"{row['topk_ms']:>9.3f} {row['fused_ms']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else {"variants": results}, f, indent=1)
    return 0


def _run_variant(variant: str, args) -> dict:
    import dsagen

    config = variants()[variant]
    h, d = H, D
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H={h} D={d} bf16 causal  "
          f"variant {variant}")
    print(f"{'T':>7} {'topk':>5} {'ratio':>5} {'fused ms':>9} {'TFLOP/s':>8} {'floor ms':>9} {'of floor':>8} "
          f"{'ref ms':>9} {'speedup':>8}")
    for t in args.T:
        for ratio in args.ratio:
            s = t // ratio
            q = torch.randn((1, t, h, d), device=dev, generator=gen, dtype=torch.bfloat16)
            k = torch.randn((1, s, d), device=dev, generator=gen, dtype=torch.bfloat16)
            w = torch.randn((1, t, h), device=dev, generator=gen, dtype=torch.bfloat16)
            flops = 2 * h * d * causal_pairs(t, ratio)
            floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
            for topk in args.topk:
                fused_ms = cuda_time_ms(lambda: _call(q, k, w, topk, ratio, config), rounds=args.reps)
                if args.queued:
                    queued_ms = cuda_time_ms(lambda: _call(q, k, w, topk, ratio, config), rounds=args.reps,
                                             queued=True)
                ref = None
                if t <= args.ref_max_T:
                    ref = cuda_time_ms(lambda: dsagen.lightning_indexer(q, k, w, topk, causal=True,
                                                                        compress_ratio=ratio, impl="reference"),
                                       rounds=max(1, min(args.reps, 3)))
                tflops = flops / (fused_ms * 1e-3) / 1e12
                row = {"T": t, "topk": topk, "ratio": ratio, "fused_ms": round(fused_ms, 3),
                       "tflops": round(tflops, 1), "floor_ms": round(floor_ms, 3),
                       "fraction_of_floor": round(floor_ms / fused_ms, 3),
                       "reference_ms": round(ref, 2) if ref else None,
                       "speedup": round(ref / fused_ms, 1) if ref else None}
                if args.queued:
                    row["queued_ms"] = round(queued_ms, 3)
                if args.profile:
                    row.update(_profile(q, k, w, topk, ratio, config, args.reps))
                if args.trace:
                    row.update(_trace(q, k, w, topk, ratio, config, max(2, min(args.reps, 5))))
                rows.append(row)
                print(f"{t:>7} {topk:>5} {ratio:>5} {fused_ms:>9.2f} {tflops:>8.1f} {floor_ms:>9.2f} "
                      f"{floor_ms / fused_ms:>8.2f} {(f'{ref:.1f}' if ref else '-'):>9} "
                      f"{(f'{ref / fused_ms:.1f}x' if ref else '-'):>8}"
                      + (f"   score only {row['score_ms']:.2f} ms, top-k only {row['topk_ms']:.2f} ms"
                         if args.profile else "")
                      + (f"   queued {queued_ms:.2f} ms" if args.queued else "")
                      + (f"   in the op: score {row['trace_score_ms']:.2f} ms, top-k {row['trace_topk_ms']:.2f} ms"
                         if args.trace else ""), flush=True)
            del q, k, w
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variant": variant,
            "config": None if config is None else repr(config), "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
