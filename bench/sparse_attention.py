"""Sparse MLA forward: the fused sm_90a kernel against the plain-PyTorch reference, in one run (GPU).

    python bench/sparse_attention.py [--quick] [--reps N] [--json FILE] [--schedule serial|split_halves|serial_lean [--l2-hint]] [--cases 0,2]
                                     [--topk 512,1024,2048,4096]
                                     [--ablate [no_gather,no_math,...]] [--ncu]

--schedule S also times the fused kernel under SparseAttnFwdSpec.schedule S (dsagen.fused.sparse_attention
.SCHEDULE) next to the default (each shape's: spec family default_schedule, "split_halves" everywhere;
the row's "schedule" in the JSON) in the same run, on the same inputs: columns `S ms`, `TFLOP/s`,
`x` (default time / S time) and, in the JSON, the max abs difference of S's out/lse from the default's.
--l2-hint (with --schedule split_halves) times that schedule with SparseAttnFwdSpec.l2_hint instead; --options A,B
with its options set (fused_sa.OPTIONS: l2_hint, vec_store, stream_hint, q_prefetch; NAME=0 turns one off).
--grid G runs the --schedule column with dsagen.fused.sparse_attention.GRID = G (split_halves: "items", one CTA per
(query row, 64 heads); "persistent", one CTA per SM looping over them; or a CTA count; the default column runs
each kernel shape's DEFAULT_GRID: persistent, one CTA per SM, at H64 and H128).

Shapes: prefill T = 4096 and 32768 query rows over a KV pool of 32768 and 131072 rows, H=128,
D_qk 576, d_v 512, top-k 2048, with sink; H=64 with D_qk 512; decode 64 and 128 sequences x 1 query row,
H=128. Ids are distinct per row (start + i * odd stride mod pool: scattered, no duplicates), all valid.

--ablate [LIST] (default: every SparseAttnFwdSpec ablation) also times the TIMING-ONLY ablated kernels
(dsagen.fused.sparse_attention.ablated_forward; each leaves one stage out: no_gather, no_math, no_softmax,
no_pv, no_mask) next to the real kernel on the same inputs, under the default schedule and under --schedule
when given (each schedule runs the ablations it has: SCHEDULE_ABLATIONS; split_halves has no_gather and
no_ready_fence), for the H=128 / D_qk=576 cases (the shapes built by tests/gpu/test_sparse_attention.py). A second
table lists each variant's time and its difference to the real kernel; the differences place the time.
--cases I,J keeps only those rows of the case list (0 = prefill 4096 / H128 / 576 / KV 32768).
--ncu launches the real kernel and each ablated kernel of --ablate (default all) once on case 0, under the default
schedule and --schedule, nothing else and no timing: run it under `ncu -k regex:sparse_attention_fwd` (ncu
flushes the caches before every replay pass, so a warm-up launch would change nothing).

FLOPs = 2 * S_q * H * topk * (D_qk + d_v) (both products, valid slots only). "GB/s" counts the bytes a
kernel must move at least once per CTA: the gathered rows (S_q * topk * D_qk * 2 per 64-head block),
q, out, ids and the FP32 stats; the gathered rows mostly come from L2, so this can exceed HBM bandwidth.
--flashmla DIR also times FlashMLA's SM90 sparse prefill (the peer to beat; built from its source by
DIR/build.sh, not part of dsagen) on the same inputs: columns `FlashMLA ms`, `TFLOP/s`, `x` (FlashMLA time /
default time: above 1, dsagen is faster).
Time: CUDA events around `reps` back-to-back calls after a warm-up, median of 7 such rounds; the default, the
--schedule column and FlashMLA run interleaved round by round, the order rotating (common.paired_time_ms), so GPU
clock drift and the power cap hit them alike.
--trace runs the split_halves trace ablation (timestamps per item; with --options, of that variant) on the chosen
cases and prints where an item's time goes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import cuda_time_ms, paired_time_ms

import dsagen
import dsagen.fused.sparse_attention as fused_sa
from dsagen.spec.families.sparse_attention import HALVES_OPTIONS, SCHEDULE_ABLATIONS


def distinct_ids(s_q: int, topk: int, n_kv: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, n_kv, (s_q, 1), generator=gen, dtype=torch.int64)
    stride = torch.randint(0, n_kv // 2, (s_q, 1), generator=gen, dtype=torch.int64) * 2 + 1  # odd: a cycle
    return ((start + torch.arange(topk).view(1, -1) * stride) % n_kv).to(torch.int32)


def case_inputs(s_q: int, h: int, d_qk: int, n_kv: int, topk: int, seed: int = 0):
    """A bench case's CUDA inputs, fresh and random: q (s_q, h, d_qk) and kv (n_kv, d_qk) bf16, distinct ids
    (s_q, topk) int32, an FP32 sink (h,)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((s_q, h, d_qk), generator=gen, dtype=torch.float32).bfloat16().cuda()
    kv = torch.randn((n_kv, d_qk), generator=gen, dtype=torch.float32).bfloat16().cuda()
    ids = distinct_ids(s_q, topk, n_kv, gen).cuda()
    sink = torch.randn(h, generator=gen).cuda()
    return q, kv, ids, sink


def with_knobs(fn, **knobs):
    """`fn` run with the given dsagen.fused.sparse_attention module attributes set (restored after each call)."""
    def run():
        prev = {k: getattr(fused_sa, k) for k in knobs}
        for k, v in knobs.items():
            setattr(fused_sa, k, v)
        try:
            return fn()
        finally:
            for k, v in prev.items():
                setattr(fused_sa, k, v)
    return run


def load_flashmla(folder: str):
    """The FlashMLA peer module (`flashmla_peer.py` + its library in `folder`, built from FlashMLA's source by
    its build.sh; not part of dsagen)."""
    sys.path.insert(0, folder)
    import flashmla_peer
    return flashmla_peer


ABLATE_SHAPES = {(128, 576)}      # (H, D_qk) of the ablated kernels that the GPU tests' REQUIRED_SPECS build


def run_case(name, s_q, h, d_qk, n_kv, topk, *, reps, ref_reps, d_v=512, seed=0, schedule=None, ablate=(),
             l2_hint=False, grid=None, options=None, flashmla=None):
    q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk, seed)
    call = lambda impl: dsagen.sparse_attention(q, kv, ids, attn_sink=sink, d_v=d_v, impl=impl)
    flops = 2.0 * s_q * h * topk * (d_qk + d_v)
    blocks = (h + 63) // 64
    nbytes = (s_q * topk * d_qk * 2 * blocks + q.numel() * 2 + s_q * h * d_v * 2 + ids.numel() * 4
              + 2 * s_q * h * 4)
    row = {"case": name, "s_q": s_q, "H": h, "d_qk": d_qk, "d_v": d_v, "kv_rows": n_kv, "topk": topk}
    default = fused_sa.resolved_schedule(h, d_qk, rows=s_q)
    row["schedule"] = default
    # the default, the --schedule variant and the FlashMLA peer, timed interleaved on the same inputs
    fns = {"fused": lambda: call("fused")}
    same = not l2_hint and grid == fused_sa.GRID and not options
    if schedule and not (schedule == default and same):
        fns[schedule] = with_knobs(lambda: call("fused"), SCHEDULE=schedule, L2_HINT=l2_hint, GRID=grid,
                                   OPTIONS=dict(options or {}))
    scale = d_qk ** -0.5
    if flashmla is not None and h % 64 == 0 and topk % 128 == 0:
        fns["flashmla"] = lambda: flashmla.sparse_prefill_fwd(q, kv, ids, scale, attn_sink=sink)
    times = dict(zip(fns, paired_time_ms(list(fns.values()), calls=reps)))
    ms = times["fused"]
    row.update(fused_ms=ms, fused_tflops=flops / ms / 1e9, fused_gbps=nbytes / ms / 1e6)
    base_out, base_lse, _ = call("fused")
    if schedule and schedule in times:
        sms = times[schedule]
        v_out, v_lse, _ = fns[schedule]()
        row.update({f"{schedule}_ms": sms, f"{schedule}_tflops": flops / sms / 1e9,
                    f"{schedule}_speedup": ms / sms,
                    f"{schedule}_max_abs_diff_out": (v_out.float() - base_out.float()).abs().max().item(),
                    f"{schedule}_max_abs_diff_lse": (v_lse - base_lse).abs().max().item()})
        del v_out, v_lse
    elif schedule:                                                      # the same launch as the default column
        row.update({f"{schedule}_ms": ms, f"{schedule}_tflops": flops / ms / 1e9, f"{schedule}_speedup": 1.0})
    if "flashmla" in times:
        fms = times["flashmla"]
        f_out, _, f_lse = fns["flashmla"]()
        row.update(flashmla_ms=fms, flashmla_tflops=flops / fms / 1e9, vs_flashmla=fms / ms,
                   flashmla_max_abs_diff_out=(f_out.float() - base_out.float()).abs().max().item(),
                   flashmla_max_abs_diff_lse=(f_lse - base_lse).abs().max().item())
        del f_out, f_lse
    del base_out, base_lse
    if ablate and (h, d_qk) in ABLATE_SHAPES:
        for sch in dict.fromkeys([default] + ([schedule] if schedule else [])):
            full = ms if sch == default else row[f"{sch}_ms"]
            for a in [a for a in ablate if a in SCHEDULE_ABLATIONS[sch]]:
                f = lambda: fused_sa.ablated_forward(q, kv, ids, ablate=a, attn_sink=sink, d_v=d_v, schedule=sch)
                ams = cuda_time_ms(f, calls=reps)
                row[f"{sch}/{a}_ms"] = ams
                row[f"{sch}/{a}_delta_ms"] = full - ams     # time the left-out stage costs on the critical path
    if ref_reps:
        rms = cuda_time_ms(lambda: call("reference"), calls=ref_reps, rounds=2)
        row.update(torch_ms=rms, torch_tflops=flops / rms / 1e9, speedup=rms / ms)
        out, lse, _ = call("fused")
        r_out, r_lse, _ = call("reference")
        row["max_abs_err_out"] = (out.float() - r_out.float()).abs().max().item()
        row["max_abs_err_lse"] = (lse - r_lse.float()).abs().max().item()
    del q, kv, ids
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only T=4096 prefill (H128 576 and H64 512) + decode")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true", help="skip the plain-PyTorch comparison")
    ap.add_argument("--json")
    ap.add_argument("--schedule", choices=fused_sa.SCHEDULES,
                    help="also time this kernel schedule next to the default (each shape's, see "
                         "default_schedule), in the same run")
    ap.add_argument("--l2-hint", action="store_true",
                    help="--schedule split_halves with SparseAttnFwdSpec.l2_hint (L2::256B prefetch + evict_last)")
    ap.add_argument("--options", default="",
                    help="comma list of split_halves options for the --schedule split_halves column "
                         "(fused_sa.OPTIONS): NAME turns one on, NAME=0 off (spec family HALVES_OPTIONS; the op's "
                         "own choice is SCHEDULE_OPTIONS)")
    ap.add_argument("--flashmla", metavar="DIR",
                    help="also time FlashMLA's SM90 sparse prefill on the same inputs (a folder with flashmla_peer.py "
                         "and its library, e.g. .peer/flashmla; H 64/128 and topk a multiple of 128 only)")
    ap.add_argument("--grid", default=None,
                    help="the --schedule column's fused_sa.GRID for split_halves: items, persistent or a CTA count "
                         "(default: the kernel shape's DEFAULT_GRID; the default column keeps the module's GRID)")
    ap.add_argument("--ablate", nargs="?", const=",".join(fused_sa.ABLATIONS), default="",
                    help="comma list of timing-only ablations to time next to the real kernel (default: all)")
    ap.add_argument("--cases", help="comma list of case indices to run (default: all of the list)")
    ap.add_argument("--ncu", action="store_true", help="launch each kernel once on case 0, no timing (for ncu)")
    ap.add_argument("--trace", action="store_true",
                    help="run the split_halves trace ablation on the chosen cases (default: case 0) and print where "
                         "an item's time goes (medians of the gaps between its timestamps, ns); no timing table")
    ap.add_argument("--topk", help="comma list of top-k widths: each chosen case runs once per width (a sweep's "
                                   "intercept is the fixed cost per CTA: prologue, epilogue, pipeline fill/drain)")
    args = ap.parse_args()
    ablate = [a for a in args.ablate.split(",") if a]
    bad = [a for a in ablate if a not in fused_sa.ABLATIONS]
    if bad:
        ap.error(f"--ablate {bad}: not in {tuple(fused_sa.ABLATIONS)}")
    if args.ncu:
        ncu_launches(ablate or list(fused_sa.ABLATIONS), args.schedule)
        return
    if args.l2_hint and args.schedule != "split_halves":
        ap.error("--l2-hint needs --schedule split_halves")
    options = {o.split("=")[0]: o.split("=")[1] != "0" if "=" in o else True for o in args.options.split(",") if o}
    if options and args.schedule != "split_halves" and not args.trace:
        ap.error("--options needs --schedule split_halves (or --trace)")
    bad = [o for o in options if o not in HALVES_OPTIONS]
    if bad:
        ap.error(f"--options {bad}: not in {HALVES_OPTIONS}")
    ref = 0 if args.no_torch else 1
    cases = [("prefill", 4096, 128, 576, 32768, 2048, ref), ("prefill", 4096, 128, 576, 131072, 2048, ref),
             ("prefill", 4096, 64, 512, 32768, 2048, ref)]
    if not args.quick:
        cases += [("prefill", 32768, 128, 576, 32768, 2048, ref), ("prefill", 32768, 128, 576, 131072, 2048, 0),
                  ("prefill", 32768, 64, 512, 131072, 2048, 0)]
    cases += [("decode", 64, 128, 576, 131072, 2048, ref), ("decode", 128, 128, 576, 131072, 2048, ref)]
    # the other two kernel shapes (not target shapes; they show whether a schedule's default holds there too)
    cases += [("prefill", 4096, 128, 512, 32768, 2048, 0), ("prefill", 4096, 64, 576, 32768, 2048, 0)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    if args.topk:
        cases = [c[:5] + (int(k),) + c[6:] for c in cases for k in args.topk.split(",")]
    if args.trace:
        fused_sa.OPTIONS = dict(options)           # --options: trace that variant
        for name, s_q, h, d, n_kv, topk, _ in (cases if args.cases else cases[:1]):
            rep = trace_report(name, s_q, h, d, n_kv, topk)
            width = max(len(k) for k in rep)
            for k, v in rep.items():
                print(f"{k:<{width}}  {v if isinstance(v, str) else round(v, 1)}")
            print()
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rep) + "\n")
        return
    flashmla = load_flashmla(args.flashmla) if args.flashmla else None
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    hdr = f"{'case':8} {'S_q':>6} {'H':>4} {'D':>4} {'kv':>7} {'topk':>5} | {'fused ms':>9} {'TFLOP/s':>8} " \
          f"{'GB/s':>7} | {'torch ms':>9} {'TFLOP/s':>8} {'x':>6}"
    if args.schedule:
        hdr += f" | {args.schedule + ' ms':>9} {'TFLOP/s':>8} {'x':>6}"
    if flashmla:
        hdr += f" | {'FlashMLA ms':>11} {'TFLOP/s':>8} {'x':>6}"
    print(hdr)
    for name, s_q, h, d, n_kv, topk, r in cases:
        row = run_case(name, s_q, h, d, n_kv, topk, reps=args.reps if s_q <= 4096 else max(2, args.reps // 4),
                       ref_reps=r, schedule=args.schedule, ablate=ablate, l2_hint=args.l2_hint,
                       grid=int(args.grid) if args.grid and args.grid.isdigit() else args.grid, options=options,
                       flashmla=flashmla)
        rows.append(row)
        tail = (f"{row['torch_ms']:9.2f} {row['torch_tflops']:8.1f} {row['speedup']:6.1f}" if "torch_ms" in row
                else f"{'-':>9} {'-':>8} {'-':>6}")
        if args.schedule:
            sch = args.schedule
            tail += f" | {row[sch + '_ms']:9.3f} {row[sch + '_tflops']:8.1f} {row[sch + '_speedup']:6.2f}"
        if flashmla:
            tail += (f" | {row['flashmla_ms']:11.3f} {row['flashmla_tflops']:8.1f} {row['vs_flashmla']:6.2f}"
                     if "flashmla_ms" in row else f" | {'-':>11} {'-':>8} {'-':>6}")
        print(f"{name:8} {s_q:6d} {h:4d} {d:4d} {n_kv:7d} {topk:5d} | {row['fused_ms']:9.3f} "
              f"{row['fused_tflops']:8.1f} {row['fused_gbps']:7.0f} | {tail}", flush=True)
    if ablate:
        print("\n# ablations (TIMING ONLY, outputs are not attention); delta = full kernel ms - variant ms, "
              "i.e. the critical-path cost of the stage the variant leaves out")
        print(f"{'case':8} {'S_q':>6} {'H':>4} {'D':>4} {'kv':>7} | {'schedule':8} {'variant':10} {'ms':>8} "
              f"{'delta ms':>9} {'delta %':>8} {'rows GB/s':>9}")
        for row in rows:
            for key in [k for k in row if k.endswith("_delta_ms")]:
                sch, a = key[:-len("_delta_ms")].split("/")
                full = row["fused_ms"] if sch == row["schedule"] else row[f"{sch}_ms"]
                ams = row[f"{sch}/{a}_ms"]
                gathered_bytes = row["s_q"] * row["topk"] * row["d_qk"] * 2 * (row["H"] // 64)
                for tag, v in (("full", full), (a, ams)) if a == ablate[0] else ((a, ams),):
                    d = full - v
                    print(f"{row['case']:8} {row['s_q']:6d} {row['H']:4d} {row['d_qk']:4d} {row['kv_rows']:7d} | "
                          f"{sch:8} {tag:10} {v:8.3f} {d:9.3f} {100 * d / full:7.1f}% "
                          f"{gathered_bytes / v / 1e6:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "default_schedule": "per row", "schedule": args.schedule, "l2_hint": args.l2_hint,
                       "grid": args.grid, "options": options,
                       "ablate": ablate,
                       "rows": rows}, f, indent=1)


# the trace ablation's timestamp slots (split_halves.py.j2: producer 0-3, consumer A 8-13, consumer B 16-20)
TRACE_SLOTS = {"P_item": 0, "P_qfree": 1, "P_end": 2, "P_v0l0": 3, "A_q": 8, "A_qk0": 9, "A_mid": 10, "A_last": 11,
               "A_epi": 12, "A_end": 13, "B_q": 16, "B_qk0": 17, "B_last": 18, "B_epi": 19, "B_end": 20}


def trace_report(name, s_q, h, d_qk, n_kv, topk, *, d_v=512, seed=0) -> dict:
    """Launch the split_halves "trace" ablation (the real kernel plus %globaltimer stamps per item) on a bench case
    and summarise where an item's time goes, per CTA in item order: the medians over all items but each CTA's first
    of the gaps between consecutive stamps (ns), the steady per-pair time of consumer A (A_mid - A_qk0 over the
    item's pairs - 1) and the item time (A_end - the previous item's A_end)."""
    import statistics
    q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk, seed)
    for _ in range(3):
        _, _, stamps = fused_sa.ablated_forward(q, kv, ids, ablate="trace", attn_sink=sink, d_v=d_v,
                                                schedule="split_halves")
    torch.cuda.synchronize()
    hp = fused_sa.kernel_heads(h)
    ts = stamps.contiguous().view(torch.int64).view(s_q * (hp // 64), 32).cpu()      # [item, slot]
    nctas = min(s_q * (hp // 64), fused_sa._grid_ctas(q.device, hp))
    npairs = ((topk + 63) // 64 + 1) // 2
    t0 = int(ts[:, 0].min())
    slot = lambda k, it: int(ts[it, TRACE_SLOTS[k]])
    gaps: dict[str, list[float]] = {}
    order = ["A_end(prev)", "A_q", "A_qk0", "A_mid", "A_last", "A_epi", "A_end"]
    for b in range(nctas):
        items = list(range(b, ts.shape[0], nctas))
        for j in range(1, len(items)):
            it, prev = items[j], items[j - 1]
            seq = [slot("A_end", prev)] + [slot(k, it) for k in order[1:]]
            for a, z, v0, v1 in zip(order, order[1:], seq, seq[1:]):
                gaps.setdefault(f"{a} -> {z}", []).append(v1 - v0)
            gaps.setdefault("item (A_end - A_end(prev))", []).append(seq[-1] - seq[0])
            if npairs > 1:
                gaps.setdefault("A steady pair ((A_mid - A_qk0) / (pairs - 1))", []).append(
                    (slot("A_mid", it) - slot("A_qk0", it)) / (npairs - 1))
            gaps.setdefault("B: q -> first QK^T retired", []).append(slot("B_qk0", it) - slot("B_q", it))
            gaps.setdefault("B: last pair done -> BAR_EPI", []).append(slot("B_epi", it) - slot("B_last", it))
            gaps.setdefault("B: BAR_EPI -> stores done", []).append(slot("B_end", it) - slot("B_epi", it))
            gaps.setdefault("B_end(prev) -> B_q", []).append(slot("B_q", it) - slot("B_end", prev))
            gaps.setdefault("P: item top -> q_free passed", []).append(slot("P_qfree", it) - slot("P_item", it))
            gaps.setdefault("P: q_free -> pair-0 V0L free", []).append(slot("P_v0l0", it) - slot("P_qfree", it))
            gaps.setdefault("P: q_free vs A_last(prev) (P_qfree - A_last(prev))", []).append(
                slot("P_qfree", it) - slot("A_last", prev))
    ends = [int(ts[i, TRACE_SLOTS["A_end"]]) for i in range(ts.shape[0])]
    report = {"case": name, "s_q": s_q, "H": h, "d_qk": d_qk, "kv_rows": n_kv, "topk": topk, "ctas": nctas,
              "pairs_per_item": npairs, "kernel_span_ns (first stamp -> last A_end)": max(ends) - t0}
    report.update({k: statistics.median(v) for k, v in gaps.items()})
    return report


def ncu_launches(ablate, schedule=None) -> None:
    """Case 0 (prefill 4096, H128, 576, KV 32768): each kernel (real, then each ablation; per schedule) launched
    once, with a synchronize after each. The launch order is printed on stderr."""
    s_q, h, d_qk, n_kv, topk = 4096, 128, 576, 32768, 2048
    q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk)
    n = 0
    for sch in dict.fromkeys([fused_sa.resolved_schedule(h, d_qk, rows=s_q)] + ([schedule] if schedule else [])):
        for a in [""] + [a for a in ablate if a in SCHEDULE_ABLATIONS[sch]]:
            if a:
                fused_sa.ablated_forward(q, kv, ids, ablate=a, attn_sink=sink, schedule=sch)
            else:
                fused_sa._launch(q, kv, ids, sink, None, d_qk ** -0.5, 512, schedule=sch)
            torch.cuda.synchronize()
            print(f"launch {n}: schedule={sch} ablate={a or '-'}", file=sys.stderr)
            n += 1


if __name__ == "__main__":
    main()
