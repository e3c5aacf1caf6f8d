"""Sparse MLA forward: the fused sm_90a kernel against the plain-PyTorch reference, in one run (GPU).

    python bench/sparse_attention.py [--quick] [--reps N] [--json FILE] [--cases 0,2] [--topk 512,1024,2048,4096]
                                     [--flashmla DIR] [--grid G] [--ncu]

Shapes: prefill T = 4096 and 32768 query rows over a KV pool of 32768 and 131072 rows, H=128,
D_qk 576, d_v 512, top-k 2048, with sink; H=64 with D_qk 512; decode 64 and 128 sequences x 1 query row,
H=128; then H128 / D512 and H64 / D576 prefill. Ids are distinct per row (start + i * odd stride mod pool:
scattered, no duplicates), all valid.
--cases I,J keeps only those rows of the case list (0 = prefill 4096 / H128 / 576 / KV 32768); --topk runs each
chosen case once per width (a sweep's intercept is the fixed cost per CTA: prologue, epilogue, pipeline fill/drain).

FLOPs = 2 * S_q * H * topk * (D_qk + d_v) (both products, valid slots only). "GB/s" counts the bytes a
kernel must move at least once per CTA: the gathered rows (S_q * topk * D_qk * 2 per 64-head block),
q, out, ids and the FP32 stats; the gathered rows mostly come from L2, so this can exceed HBM bandwidth.
--flashmla DIR also times FlashMLA's SM90 sparse prefill (the peer to beat; built from its source by
DIR/build.sh, not part of dsagen) on the same inputs: columns `FlashMLA ms`, `TFLOP/s`, `x` (FlashMLA time /
default time: above 1, dsagen is faster).
--grid G also times the op's kernel under SparseAttnFwdConfig(grid=G) (G: "persistent" or a CTA count; the op's
config_for choice is persistent) through the flat entry's config=, next to the default: columns `grid ms`,
`TFLOP/s`, `x` (default time / variant time) and, in the JSON, the max abs difference of its out / lse.
--ncu launches the op's kernel once on case 0, nothing else and no timing: run it under `ncu -k
regex:sparse_attention_fwd` (ncu flushes the caches before every replay pass, so a warm-up launch would change
nothing).
Time: CUDA events around `reps` back-to-back calls after a warm-up, median of 7 such rounds; the default, the
--grid column and FlashMLA run interleaved round by round, the order shuffled every round (common.paired_time_ms),
so GPU clock drift and the power cap hit them alike.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import cuda_time_ms, paired_time_ms, distinct_ids

import dsagen
import dsagen.kernels.sparse_mla.host as fused_sa
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdConfig


def case_inputs(s_q: int, h: int, d_qk: int, n_kv: int, topk: int, seed: int = 0):
    """A bench case's CUDA inputs, fresh and random: q (s_q, h, d_qk) and kv (n_kv, d_qk) bf16, distinct ids
    (s_q, topk) int32, an FP32 sink (h,)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((s_q, h, d_qk), generator=gen, dtype=torch.float32).bfloat16().cuda()
    kv = torch.randn((n_kv, d_qk), generator=gen, dtype=torch.float32).bfloat16().cuda()
    ids = distinct_ids(s_q, topk, n_kv, gen).cuda()
    sink = torch.randn(h, generator=gen).cuda()
    return q, kv, ids, sink


def load_flashmla(folder: str):
    """The FlashMLA peer module (`flashmla_peer.py` + its library in `folder`, built from FlashMLA's source by
    its build.sh; not part of dsagen)."""
    sys.path.insert(0, folder)
    import flashmla_peer
    return flashmla_peer


def run_case(name, s_q, h, d_qk, n_kv, topk, *, reps, ref_reps, d_v=512, seed=0, grid=None, flashmla=None):
    q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk, seed)
    call = lambda impl: dsagen.sparse_attention(q, kv, ids, attn_sink=sink, d_v=d_v, impl=impl)
    flops = 2.0 * s_q * h * topk * (d_qk + d_v)
    blocks = (h + 63) // 64
    nbytes = (s_q * topk * d_qk * 2 * blocks + q.numel() * 2 + s_q * h * d_v * 2 + ids.numel() * 4
              + 2 * s_q * h * 4)
    row = {"case": name, "s_q": s_q, "H": h, "d_qk": d_qk, "d_v": d_v, "kv_rows": n_kv, "topk": topk}
    # the op's kernel, the --grid variant and the FlashMLA peer, timed interleaved on the same inputs
    fns = {"fused": lambda: call("fused")}
    scale = d_qk ** -0.5
    if grid is not None:
        config = SparseAttnFwdConfig(grid=grid)
        fns["grid"] = lambda: fused_sa.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=None,
                                                        softmax_scale=scale, d_v=d_v, config=config)
    if flashmla is not None and h % 64 == 0 and topk % 128 == 0:
        fns["flashmla"] = lambda: flashmla.sparse_prefill_fwd(q, kv, ids, scale, attn_sink=sink)
    times = dict(zip(fns, paired_time_ms(list(fns.values()), calls=reps)))
    ms = times["fused"]
    row.update(fused_ms=ms, fused_tflops=flops / ms / 1e9, fused_gbps=nbytes / ms / 1e6)
    base_out, base_lse, _ = call("fused")
    if "grid" in times:
        gms = times["grid"]
        v_out, v_lse, _ = fns["grid"]()
        row.update(grid=grid, grid_ms=gms, grid_tflops=flops / gms / 1e9, grid_speedup=ms / gms,
                   grid_max_abs_diff_out=(v_out.float() - base_out.float()).abs().max().item(),
                   grid_max_abs_diff_lse=(v_lse - base_lse).abs().max().item())
        del v_out, v_lse
    if "flashmla" in times:
        fms = times["flashmla"]
        f_out, _, f_lse = fns["flashmla"]()
        row.update(flashmla_ms=fms, flashmla_tflops=flops / fms / 1e9, vs_flashmla=fms / ms,
                   flashmla_max_abs_diff_out=(f_out.float() - base_out.float()).abs().max().item(),
                   flashmla_max_abs_diff_lse=(f_lse - base_lse).abs().max().item())
        del f_out, f_lse
    del base_out, base_lse
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
    ap.add_argument("--flashmla", metavar="DIR",
                    help="also time FlashMLA's SM90 sparse prefill on the same inputs (a folder with flashmla_peer.py "
                         "and its library, e.g. .peer/flashmla; H 64/128 and topk a multiple of 128 only)")
    ap.add_argument("--grid", default=None,
                    help="also time the op's kernel under SparseAttnFwdConfig(grid=G): persistent or a CTA count")
    ap.add_argument("--cases", help="comma list of case indices to run (default: all of the list)")
    ap.add_argument("--ncu", action="store_true", help="launch the op's kernel once on case 0, no timing (for ncu)")
    ap.add_argument("--topk", help="comma list of top-k widths: each chosen case runs once per width (a sweep's "
                                   "intercept is the fixed cost per CTA: prologue, epilogue, pipeline fill/drain)")
    args = ap.parse_args()
    grid = int(args.grid) if args.grid and args.grid.isdigit() else args.grid
    if grid is not None:
        try:
            SparseAttnFwdConfig(grid=grid)
        except ValueError as e:
            ap.error(f"--grid: {e}")
    if args.ncu:
        ncu_launch()
        return
    ref = 0 if args.no_torch else 1
    cases = [("prefill", 4096, 128, 576, 32768, 2048, ref), ("prefill", 4096, 128, 576, 131072, 2048, ref),
             ("prefill", 4096, 64, 512, 32768, 2048, ref)]
    if not args.quick:
        cases += [("prefill", 32768, 128, 576, 32768, 2048, ref), ("prefill", 32768, 128, 576, 131072, 2048, 0),
                  ("prefill", 32768, 64, 512, 131072, 2048, 0)]
    cases += [("decode", 64, 128, 576, 131072, 2048, ref), ("decode", 128, 128, 576, 131072, 2048, ref)]
    # the other two kernel shapes (not target shapes; they show whether the config's choices hold there too)
    cases += [("prefill", 4096, 128, 512, 32768, 2048, 0), ("prefill", 4096, 64, 576, 32768, 2048, 0)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    if args.topk:
        cases = [c[:5] + (int(k),) + c[6:] for c in cases for k in args.topk.split(",")]
    flashmla = load_flashmla(args.flashmla) if args.flashmla else None
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    hdr = f"{'case':8} {'S_q':>6} {'H':>4} {'D':>4} {'kv':>7} {'topk':>5} | {'fused ms':>9} {'TFLOP/s':>8} " \
          f"{'GB/s':>7} | {'torch ms':>9} {'TFLOP/s':>8} {'x':>6}"
    if grid is not None:
        hdr += f" | {'grid ms':>9} {'TFLOP/s':>8} {'x':>6}"
    if flashmla:
        hdr += f" | {'FlashMLA ms':>11} {'TFLOP/s':>8} {'x':>6}"
    print(hdr)
    for name, s_q, h, d, n_kv, topk, r in cases:
        row = run_case(name, s_q, h, d, n_kv, topk, reps=args.reps if s_q <= 4096 else max(2, args.reps // 4),
                       ref_reps=r, grid=grid, flashmla=flashmla)
        rows.append(row)
        tail = (f"{row['torch_ms']:9.2f} {row['torch_tflops']:8.1f} {row['speedup']:6.1f}" if "torch_ms" in row
                else f"{'-':>9} {'-':>8} {'-':>6}")
        if grid is not None:
            tail += f" | {row['grid_ms']:9.3f} {row['grid_tflops']:8.1f} {row['grid_speedup']:6.2f}"
        if flashmla:
            tail += (f" | {row['flashmla_ms']:11.3f} {row['flashmla_tflops']:8.1f} {row['vs_flashmla']:6.2f}"
                     if "flashmla_ms" in row else f" | {'-':>11} {'-':>8} {'-':>6}")
        print(f"{name:8} {s_q:6d} {h:4d} {d:4d} {n_kv:7d} {topk:5d} | {row['fused_ms']:9.3f} "
              f"{row['fused_tflops']:8.1f} {row['fused_gbps']:7.0f} | {tail}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "grid": grid,
                       "rows": rows}, f, indent=1)


def ncu_launch() -> None:
    """Case 0 (prefill 4096, H128, 576, KV 32768): the op's kernel launched once, then a synchronize."""
    s_q, h, d_qk, n_kv, topk = 4096, 128, 576, 32768, 2048
    q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk)
    dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")
    torch.cuda.synchronize()
    print("launch 0: the op's kernel", file=sys.stderr)


if __name__ == "__main__":
    main()
