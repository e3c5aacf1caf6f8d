"""Sparse MLA backward: the fused sm_90a kernel (atomic and deterministic modes) against the plain-PyTorch reference
backward, in one run (GPU).

    python bench/sparse_attention_backward.py [--quick] [--reps N] [--ref-max-T T] [--cases 0,2] [--kv N]
    python bench/sparse_attention_backward.py --cases 0 --bucket-rows 2048 4096 8192     # KV window sizes
    python bench/sparse_attention_backward.py --cases 0 --configs '[{}, {"regs_producer": 48, "regs_a": 232}]'
    python bench/sparse_attention_backward.py --cases 0 --deterministic --configs '[{}, {"regs_a": 232, "regs_b": 232}]'
    python bench/sparse_attention_backward.py --cases 0,4 --item-split        # the same work in items of 3 sizes
    python bench/sparse_attention_backward.py --cases 0 --id-order            # each row's ids drawn / sorted / shuffled
    python bench/sparse_attention_backward.py --cases 0 --clocks 4            # SM clock and power while it runs
    python bench/sparse_attention_backward.py --cudnn [--energy 2]           # cuDNN's SM90 kernel beside ours

Shapes: T = 4096 and 32768 query rows over a KV pool of 32768 and 131072 rows, H=128, D_qk 576, d_v 512, top-k
2048, with sink; H=64 with D_qk 512 (--quick: T = 4096 only). Ids are distinct per row (start + i * odd stride mod
pool), all valid; out / lse come from the fused forward, dout is random (q, kv, dout drawn on the GPU).

FLOPs = 2 * T * H * topk * (3 * D_qk + 2 * d_v) (the five products: S, dP, dQ, and dKV's two). Columns: fused
(atomic dKV) ms and TFLOP/s, the deterministic mode's ms and its cost (det / fused), the reference backward's ms
(only for T <= --ref-max-T, default 4096) and the fused speedup over it, and one training step of the attention
(fused forward + fused backward through autograd, `out.backward(dout)`) against the same step with
impl="reference".
Time: CUDA events around `reps` back-to-back calls after a warm-up, median of 7 rounds; the fused variants run
interleaved round by round (common.paired_time_ms).

--cudnn: the cuDNN frontend's SM90 DSA backward (`cudnn.DSA.sparse_attention_backward_wrapper`, CuTe-DSL kernels;
../shared/peers/ shows how to carry the frontend and CuTe-DSL to the GPU machine) joins the interleaved timing on the
same tensors (dsagen's forward out and KV-only lse, the sink; cuDNN has no deterministic mode on SM90), and its dq,
dkv and d_sink are compared with dsagen's atomic mode's (largest difference relative to the largest value, against
bf16's 2e-2). Optional: without the import a note is printed and the table has dsagen's rows only. --energy SECONDS
adds each contender's energy per call from the board's NVML counter (bench/energy.py's method: back-to-back calls
for SECONDS per segment, interleaved rotating rounds, idle segment for the board's idle power), so the comparison
is also per joule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_time_ms, cudnn_namespace, distinct_ids, paired_time_ms  # noqa: E402

import dsagen  # noqa: E402
from dsagen.kernels.sparse_mla_bwd import host as bwd_host  # noqa: E402
from dsagen.reference import sparse_attention as ref  # noqa: E402

CASES = [(4096, 128, 576, 32768), (4096, 128, 576, 131072), (32768, 128, 576, 32768), (32768, 128, 576, 131072),
         (4096, 64, 512, 32768)]


def backward_flops(s_q, h, d_qk, topk):
    """The FLOPs of one backward (module docstring): S, dP, dQ and dKV's two products, d_v 512."""
    return 2.0 * s_q * h * topk * (3 * d_qk + 2 * 512)


def make_inputs(s_q, h, d_qk, n_kv, topk):
    """One case's tensors (module docstring): q, kv, dout, ids, sink, the softmax scale, and out / lse from the fused
    forward."""
    gen = torch.Generator().manual_seed(0)
    ids = distinct_ids(s_q, topk, n_kv, gen).cuda()
    sink = torch.randn(h, generator=gen).cuda()
    cgen = torch.Generator(device="cuda").manual_seed(0)           # the large tensors are drawn on the GPU
    q = torch.randn((s_q, h, d_qk), generator=cgen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((n_kv, d_qk), generator=cgen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn((s_q, h, 512), generator=cgen, device="cuda", dtype=torch.bfloat16)
    scale = d_qk ** -0.5
    out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, softmax_scale=scale, d_v=512, impl="fused")
    return q, kv, dout, ids, sink, scale, out, lse


def config_sweep(s_q, h, d_qk, n_kv, topk, reps, overrides, deterministic=False):
    """The atomic (or deterministic) mode's ms for each dict of SparseAttnBwdConfig field overrides in `overrides`
    ({}: the op's config), timed interleaved round by round on the same inputs."""
    import dataclasses

    from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdConfig
    inputs = make_inputs(s_q, h, d_qk, n_kv, topk)
    configs = [dataclasses.replace(SparseAttnBwdConfig(), **o) for o in overrides]
    return paired_time_ms([op_call(inputs, config=c, deterministic=deterministic) for c in configs], calls=reps)


def op_call(inputs, ids=None, config=None, deterministic=False):
    """One call of the op (atomic mode unless `deterministic`) on make_inputs' tensors (`ids`: other ids of the
    same shape; `config`: a SparseAttnBwdConfig, None for the op's)."""
    q, kv, dout, ids0, sink, scale, out, lse = inputs
    ids = ids0 if ids is None else ids
    return lambda: bwd_host.sparse_attention_backward(q, kv, out, dout, lse, ids, attn_sink=sink, topk_length=None,
                                                      softmax_scale=scale, d_v=512, config=config,
                                                      deterministic=deterministic)


def item_split(s_q, h, d_qk, n_kv, topk, reps):
    """The atomic mode's ms for the same FLOPs in items of three sizes: (s_q, topk), (s_q / 2, 2 topk) and (2 s_q,
    topk / 2) query rows x slots, timed interleaved. The differences are what the per-item work costs (the item's Q,
    dO and delta loads, its first tile's gather, the grid barrier, the dq stores)."""
    shapes = [(s_q, topk), (s_q // 2, topk * 2), (s_q * 2, topk // 2)]
    fns = [op_call(make_inputs(t, h, d_qk, n_kv, k)) for t, k in shapes]
    return shapes, paired_time_ms(fns, calls=reps)


def id_orders(s_q, h, d_qk, n_kv, topk, reps):
    """The atomic mode's ms with each row's ids as make_inputs draws them, sorted ascending (the lightning indexer's
    order) and shuffled, the same sets, timed interleaved (the op orders them by KV window in every case)."""
    inputs = make_inputs(s_q, h, d_qk, n_kv, topk)
    ids = inputs[3]
    g = torch.Generator(device="cuda").manual_seed(1)
    shuffled = torch.gather(ids, 1, torch.rand(ids.shape, generator=g, device="cuda").argsort(dim=1)).contiguous()
    orders = {"as drawn": ids, "sorted": ids.sort(dim=1).values.contiguous(), "shuffled": shuffled}
    return list(orders), paired_time_ms([op_call(inputs, o) for o in orders.values()], calls=reps)


def clocks(s_q, h, d_qk, n_kv, topk, seconds):
    """ms per call of the atomic mode run back to back for `seconds`, and nvidia-smi's SM clock, board power and
    clock-event reasons sampled every 100 ms meanwhile (0x4: the software power cap)."""
    import subprocess
    import time

    fn = op_call(make_inputs(s_q, h, d_qk, n_kv, topk))
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        fn()
        n += 1
        if n % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    smi.terminate()
    return elapsed / n * 1e3, smi.stdout.read().strip().splitlines()[3:-1]


def probes(cases, args) -> None:
    """--item-split, --id-order and --clocks on each case, printed."""
    for s_q, h, d, n_kv in cases:
        n_kv = args.kv or n_kv
        print(f"T {s_q} H {h} D {d} KV {n_kv}:", flush=True)
        if args.item_split:
            shapes, ms = item_split(s_q, h, d, n_kv, args.topk, args.reps)
            for (t, k), m in zip(shapes, ms):
                print(f"  T {t:6d} topk {k:5d}: {m:8.3f} ms  {backward_flops(t, h, d, k) / m / 1e9:6.1f} TFLOP/s "
                      f"({t * h // 64} items)", flush=True)
        if args.id_order:
            names, ms = id_orders(s_q, h, d, n_kv, args.topk, args.reps)
            for name, m in zip(names, ms):
                print(f"  ids {name:8s}: {m:8.3f} ms", flush=True)
        if args.clocks:
            ms, samples = clocks(s_q, h, d, n_kv, args.topk, args.clocks)
            print(f"  {ms:.3f} ms per call back to back; nvidia-smi (SM clock, power, clock-event reasons):")
            for line in samples:
                print(f"    {line}")
        torch.cuda.empty_cache()


def cudnn_call(dsa, inputs):
    """One call of cuDNN's SM90 backward on make_inputs' tensors: (dq, dkv, d_sink)."""
    q, kv, dout, ids, sink, scale, out, lse = inputs

    def call():
        r = dsa.sparse_attention_backward_wrapper(q, kv, out, dout, lse, sink, ids, softmax_scale=scale,
                                                  deterministic=False)
        return r["dq"], r["dkv"], r["d_sink"]
    return call


def agreement(got, want) -> dict:
    """Per gradient (dq, dkv, d_sink): the largest |got - want| over the largest |want|."""
    out = {}
    for name, a, b in zip(("dq", "dkv", "d_sink"), got, want):
        out[name] = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
    return out


def energy_rows(fns: dict, seconds: float) -> dict:
    """bench/energy.py's measurement of `fns` (plus an idle segment): per name J, W, ms and MHz per call."""
    from energy import Nvml, measure
    return measure(Nvml(), {"idle": None, **fns}, seconds, rounds=3)


def run_case(s_q, h, d_qk, n_kv, topk, reps, ref_max_t, dsa=None, energy=None):
    inputs = make_inputs(s_q, h, d_qk, n_kv, topk)
    q, kv, dout, ids, sink, scale, out, lse = inputs
    kw = dict(attn_sink=sink, topk_length=None, softmax_scale=scale, d_v=512)
    fused = lambda det: bwd_host.sparse_attention_backward(q, kv, out, dout, lse, ids, deterministic=det, **kw)  # noqa
    flops = backward_flops(s_q, h, d_qk, topk)
    fns = [lambda: fused(False), lambda: fused(True)] + ([cudnn_call(dsa, inputs)] if dsa is not None else [])
    ms, det_ms, *peer = paired_time_ms(fns, calls=reps)
    row = dict(T=s_q, H=h, d_qk=d_qk, kv=n_kv, topk=topk, fused_ms=ms, tflops=flops / ms / 1e9, det_ms=det_ms,
               det_cost=det_ms / ms)
    if peer:
        row.update(cudnn_ms=peer[0], cudnn_tflops=flops / peer[0] / 1e9, vs_cudnn=peer[0] / ms,
                   agreement=agreement(fused(False), fns[2]()))
    if energy:
        named = {"dsagen": fns[0], **({"cudnn": fns[2]} if peer else {})}
        row["energy"] = energy_rows(named, energy)
    if s_q <= ref_max_t:
        row["ref_ms"] = cuda_time_ms(lambda: ref.sparse_attention_backward(q, kv, out, dout, lse, sink, ids,
                                                                           softmax_scale=scale, d_v=512), rounds=3)
        row["speedup"] = row["ref_ms"] / ms

        def step(impl):
            qg, kvg, sg = (q.detach().requires_grad_(), kv.detach().requires_grad_(), sink.detach().requires_grad_())
            o, _, _ = dsagen.sparse_attention(qg, kvg, ids, attn_sink=sg, softmax_scale=scale, d_v=512, impl=impl)
            o.backward(dout)
        row["step_ms"] = cuda_time_ms(lambda: step("fused"), rounds=5)
        row["step_ref_ms"] = cuda_time_ms(lambda: step("reference"), rounds=3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the T=4096 cases")
    ap.add_argument("--reps", type=int, default=3, help="calls per timing round")
    ap.add_argument("--ref-max-T", type=int, default=4096, help="time the reference only up to this T")
    ap.add_argument("--cases", help="comma list of case indices to run (default: all)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kv", type=int, help="KV pool rows of every chosen case (default: each case's)")
    ap.add_argument("--bucket-rows", type=int, nargs="+",
                    help="instead of the table: the atomic mode's ms per KV window size (0: no ordering)")
    ap.add_argument("--configs", help="instead of the table: the atomic mode's ms per config, a JSON list of "
                                      "SparseAttnBwdConfig field overrides ({}: the op's config)")
    ap.add_argument("--deterministic", action="store_true", help="with --configs: the deterministic mode's ms")
    ap.add_argument("--item-split", action="store_true",
                    help="instead of the table: the same work as (T, topk), (T/2, 2 topk) and (2T, topk/2)")
    ap.add_argument("--id-order", action="store_true",
                    help="instead of the table: each row's ids as drawn, sorted and shuffled")
    ap.add_argument("--clocks", type=float, metavar="SECONDS",
                    help="instead of the table: SM clock and board power while the op runs back to back")
    ap.add_argument("--cudnn", action="store_true", help="cuDNN frontend's SM90 backward beside ours (optional)")
    ap.add_argument("--energy", type=float, metavar="SECONDS", help="energy per call (NVML) of each contender")
    ap.add_argument("--json", metavar="FILE", help="the table's rows as JSON")
    args = ap.parse_args()
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    if args.quick:
        cases = [c for c in cases if c[0] == 4096]
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  topk {args.topk}  sink")
    overrides = None
    if args.bucket_rows:
        overrides = [dict(bucket_rows=b or None) for b in args.bucket_rows]
    elif args.configs:
        overrides = json.loads(args.configs)
    if args.item_split or args.id_order or args.clocks:
        probes(cases, args)
        return
    if overrides is not None:
        for s_q, h, d, n_kv in cases:
            n_kv = args.kv or n_kv
            ms = config_sweep(s_q, h, d, n_kv, args.topk, args.reps, overrides, args.deterministic)
            print(f"T {s_q} H {h} D {d} KV {n_kv}:", flush=True)
            for o, t in zip(overrides, ms):
                print(f"  {t:8.3f} ms  {backward_flops(s_q, h, d, args.topk) / t / 1e9:6.1f} TFLOP/s  "
                      f"{json.dumps(o) if o else 'the op config'}", flush=True)
        return
    dsa = cudnn_namespace("DSA", "sparse_attention_backward_wrapper") if args.cudnn else None
    print(f"{'T':>6} {'H':>4} {'D':>4} {'KV':>7} | {'fused ms':>9} {'TFLOP/s':>8} | {'det ms':>8} {'cost':>5} | "
          f"{'ref ms':>8} {'x':>6} | {'step ms':>8} {'ref step':>9}" + (" | cuDNN ms  TFLOP/s  dsagen / cuDNN"
                                                                           if dsa is not None else ""))
    rows = []
    for s_q, h, d, n_kv in cases:
        n_kv = args.kv or n_kv
        r = run_case(s_q, h, d, n_kv, args.topk, args.reps, args.ref_max_T, dsa, args.energy)
        rows.append(r)
        ref_cols = (f"{r['ref_ms']:8.2f} {r['speedup']:6.1f} | {r['step_ms']:8.2f} {r['step_ref_ms']:9.2f}"
                    if "ref_ms" in r else f"{'-':>8} {'-':>6} | {'-':>8} {'-':>9}")
        peer_cols = (f" | {r['cudnn_ms']:8.3f} {r['cudnn_tflops']:8.1f} {r['vs_cudnn']:8.3f}x"
                     if "cudnn_ms" in r else "")
        print(f"{s_q:6d} {h:4d} {d:4d} {n_kv:7d} | {r['fused_ms']:9.3f} {r['tflops']:8.1f} | {r['det_ms']:8.2f} "
              f"{r['det_cost']:5.2f} | {ref_cols}{peer_cols}", flush=True)
        if "agreement" in r:
            worst = max(r["agreement"].values())
            print("    vs cuDNN: " + "  ".join(f"{k} {v:.2e}" for k, v in r["agreement"].items())
                  + f"  ({'within' if worst <= 2e-2 else 'OUTSIDE'} bf16's 2e-2)", flush=True)
        for name, e in r.get("energy", {}).items():
            tfl = f"  {backward_flops(s_q, h, d, args.topk) / e['j_per_call'] / 1e12:6.2f} TFLOP/J" \
                if name != "idle" else ""
            print(f"    energy {name:<7} {e['j_per_call']:8.3f} J/call  {e['watts']:5.0f} W  "
                  f"{e['ms_per_call']:8.3f} ms  {e['mhz']:5.0f} MHz{tfl}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "topk": args.topk,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
