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
alone (one slab loop with each kernel launched alone). --variant selects tile choices that are not the
default yet (VARIANTS: spec options of the score and top-k kernels); several names run one after the
other on the same inputs. `ablate-persistent-*` / `ablate-topk-*` are TIMING PROBES, not correct kernels
(IndexerScoreSpec / IndexerTopkSpec.ablate: one stage left out); use them with --profile and read only
the ablated kernel's column (score_ms or topk_ms); `--variant ablations` runs default + all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from common import cuda_time_ms

PEAK_TFLOPS = 780.0
#: --variant -> (IndexerScoreSpec options, IndexerTopkSpec options)
VARIANTS = {
    "default": ({}, {}),
    "topk_s3": ({}, {"compact": False}),                       # top-k: 512 threads (1024 if one wave), no plan
    "pingpong": ({"schedule": "pingpong"}, {}),               # ping-pong WGs, one CTA per work item
    "persistent": ({"schedule": "persistent"}, {}),           # ping-pong WGs, ~1 CTA per SM looping over items
    "c2": ({"consumers": 2}, {}),                              # persistent with 2 consumer WGs (default: 3, 512 threads)
    "lean": ({"lean_epilogue": True}, {}),                     # persistent, 3 consumer WGs, lean epilogue (reduce-scatter)
    "lean_free": ({"lean_epilogue": True, "free_issue": True}, {}),  # lean + no turn barriers (wgmmas issued when ready)
    "t512": ({}, {"threads": 512}),                            # top-k: always 512 threads (never the wide one)
    "t1024": ({}, {"threads": 1024}),                          # top-k: always 1024 threads (1 CTA per SM)
    "t256": ({}, {"threads": 256}),
    "t128": ({}, {"threads": 128}),                            # 8 rows in flight per SM
    "t64": ({}, {"threads": 64}),                              # 16 rows in flight per SM
    "compact": ({}, {"compact": True}),                        # top-k: candidates compacted into smem (both widths)
    "nomma": ({"mma_head_sum": False}, {}),                    # score: the CUDA-core head sum epilogue
    "mma": ({"mma_head_sum": True}, {}),                       # score: the head sum on the tensor cores
    "lean_compact": ({"lean_epilogue": True}, {"compact": True}),              # lean score + compact top-k
    "lean_free_compact": ({"lean_epilogue": True, "free_issue": True}, {"compact": True}),
}
#: host variants: the default kernels with another score-slab cap (fused.SLAB_BYTES, MiB; default 128)
SLAB_VARIANTS = {"slab16": 16, "slab32": 32, "slab64": 64}
#: host variants: the default kernels with another slab row cap (fused.SLAB_MAX_ROWS; default 1024)
ROWS_VARIANTS = {"rows2048": 2048, "rows4096": 4096}
#: host variants: another top-k plan (spec family TOPK_BY_ROW_LENGTH, TOPK_WIDE_BY_ROW_LENGTH); plan_s4a = the
#: the plan without the sampled threshold (128 threads up to 12288 candidates, else 512 + compact)
PLAN_VARIANTS = {"plan_s4a": (((12288, {"threads": 128}), (None, {"threads": 512, "compact": True})),
                              ((12288, {"threads": 1024}), (None, {"threads": 1024, "compact": True})))}
#: host variants: the score kernel's work items cover that many candidates (fused.CHUNK_ROWS; default 4096)
CHUNK_VARIANTS = {"chunk2048": 2048, "chunk8192": 8192, "chunk16384": 16384}
VARIANTS.update({name: ({}, {}) for name in (*SLAB_VARIANTS, *ROWS_VARIANTS, *PLAN_VARIANTS, *CHUNK_VARIANTS)})
# Timing ablations (not correct kernels; see dsagen.spec.families.indexer INDEXER_*_ABLATIONS).
SCORE_ABLATIONS = ("no_epilogue", "mma_k16")
TOPK_ABLATIONS = ("hist1", "read1", "no_emit")
# score probes of the persistent kernel (IndexerScoreSpec ablate with schedule="persistent")
VARIANTS.update({f"ablate-persistent-{a}": ({"schedule": "persistent", "ablate": a}, {}) for a in SCORE_ABLATIONS})
VARIANTS.update({f"ablate-topk-{a}": ({}, {"ablate": a}) for a in TOPK_ABLATIONS})
#: --variant ablations: the default, the persistent kernel the score ablations probe, every ablation
ABLATION_SET = (["default", "persistent"] + [f"ablate-persistent-{a}" for a in SCORE_ABLATIONS]
                + [f"ablate-topk-{a}" for a in TOPK_ABLATIONS])


def causal_pairs(t: int, ratio: int) -> int:
    s = t // ratio
    return sum(min(s, (tt + 1) // ratio) for tt in range(t))


class _Skip:
    """Stands in for one of the two kernels so that the other is timed alone."""

    @staticmethod
    def launch(*args, **kwargs):
        return None


def _profile(fused, q, k, w, topk, ratio, reps) -> dict:
    import dsagen

    call = lambda: dsagen.lightning_indexer(q, k, w, topk, causal=True, compress_ratio=ratio, impl="fused")
    kernels = fused._kernels_for(q.device, q.shape[2], q.shape[3], q.dtype)
    # the entry _kernels_for just filled for this variant (its key ends with repr(SPEC_OPTIONS))
    key = next(key for key, v in fused._kernels.items() if v is kernels and key[-1] == repr(fused.SPEC_OPTIONS))
    try:
        fused._kernels[key] = dataclasses.replace(kernels, topk=dict.fromkeys(kernels.topk, _Skip))
        score_ms = cuda_time_ms(call, rounds=reps)
        fused._kernels[key] = dataclasses.replace(kernels, score=_Skip)
        topk_ms = cuda_time_ms(call, rounds=reps)
    finally:
        fused._kernels[key] = kernels
    return {"score_ms": round(score_ms, 3), "topk_ms": round(topk_ms, 3)}


def _trace(q, k, w, topk, ratio, reps) -> dict:
    """Device time per kernel inside the real op (torch.profiler / CUPTI), ms per call: score and top-k."""
    import dsagen
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            dsagen.lightning_indexer(q, k, w, topk, causal=True, compress_ratio=ratio, impl="fused")
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
    ap.add_argument("--variant", choices=list(VARIANTS) + ["ablations"], nargs="+", default=["default"],
                    help="pingpong / persistent: score-kernel schedules (IndexerScoreSpec.schedule); c2: 2 consumer "
                         "warpgroups (default 3); lean / lean_free: IndexerScoreSpec.lean_epilogue / free_issue; "
                         "nomma / mma: IndexerScoreSpec.mma_head_sum off / on (default off); slab16 / slab32 / slab64: "
                         "the score slab capped at that many MiB (default fused.SLAB_BYTES, 128 MiB); chunk2048 / chunk8192 / chunk16384: score work items of that many candidates (default fused.CHUNK_ROWS, "
                         "4096); rows2048 / rows4096: at that "
                         "many rows (default fused.SLAB_MAX_ROWS, 1024); "
                         "t64 / t128 / t256 / t512 / t1024: top-k with that many threads per row (default: per slab, "
                         "TOPK_BY_ROW_LENGTH); topk_s3: the unplanned top-k (512, 1024 when a slab's rows fit one wave); plan_s4a: the plan "
                         "without the sampled threshold; compact: IndexerTopkSpec.compact; "
                         "ablate-persistent-* / ablate-topk-*: timing probes (not correct); ablations: default + all probes")
    args = ap.parse_args(argv)
    names = []
    for v in args.variant:
        for n in (ABLATION_SET if v == "ablations" else [v]):
            if n not in names:
                names.append(n)
    if any(n.startswith("ablate-") for n in names) and not args.profile:
        print("# note: ablate-* variants are timing probes; add --profile to see the ablated kernel alone")
    results = [_run_variant(n, args) for n in names]
    if len(results) > 1 and args.profile:
        print("\n# per-kernel times (ms; ablated kernel's column is the probe, the other is the real kernel)")
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
    from dsagen.fused import lightning_indexer as fused

    from dsagen.spec.families import indexer as family

    fused.SPEC_OPTIONS = VARIANTS[variant]
    default_plan = family.TOPK_BY_ROW_LENGTH, family.TOPK_WIDE_BY_ROW_LENGTH
    if variant in PLAN_VARIANTS:
        family.TOPK_BY_ROW_LENGTH, family.TOPK_WIDE_BY_ROW_LENGTH = PLAN_VARIANTS[variant]
    fused._kernels.clear()                      # the plan is not part of the loaded-kernel key
    default_slab, default_rows, default_chunk = fused.SLAB_BYTES, fused.SLAB_MAX_ROWS, fused.CHUNK_ROWS
    fused.CHUNK_ROWS = CHUNK_VARIANTS.get(variant, default_chunk)
    fused.SLAB_BYTES = SLAB_VARIANTS.get(variant, default_slab >> 20) << 20
    fused.SLAB_MAX_ROWS = ROWS_VARIANTS.get(variant, default_rows)

    h, d = 64, 128
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H={h} D={d} bf16 causal  "
          f"variant {variant} {fused.SPEC_OPTIONS}")
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
                fused_ms = cuda_time_ms(lambda: dsagen.lightning_indexer(q, k, w, topk, causal=True,
                                                                         compress_ratio=ratio, impl="fused"),
                                        rounds=args.reps)
                if args.queued:
                    queued_ms = cuda_time_ms(lambda: dsagen.lightning_indexer(q, k, w, topk, causal=True,
                                                                               compress_ratio=ratio, impl="fused"),
                                             rounds=args.reps, queued=True)
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
                    row.update(_profile(fused, q, k, w, topk, ratio, args.reps))
                if args.trace:
                    row.update(_trace(q, k, w, topk, ratio, max(2, min(args.reps, 5))))
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
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variant": variant,
           "spec_options": fused.SPEC_OPTIONS, "rows": rows}
    fused.SPEC_OPTIONS = ({}, {})
    fused.SLAB_BYTES, fused.SLAB_MAX_ROWS, fused.CHUNK_ROWS = default_slab, default_rows, default_chunk
    family.TOPK_BY_ROW_LENGTH, family.TOPK_WIDE_BY_ROW_LENGTH = default_plan
    fused._kernels.clear()
    return out


if __name__ == "__main__":
    sys.exit(main())
