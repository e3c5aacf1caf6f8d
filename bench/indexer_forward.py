"""Benchmark: the dense indexer forward beside cuDNN frontend DSA's SM90 kernels, in one process on the same tensors
(GPU): dense scores (dsagen.indexer_scores, BF16 and FP8) against cuDNN's indexer_forward_wrapper, and the combined
indexer + top-k (dsagen.indexer_forward_topk, with logits, softmax and LSE) against cuDNN's two-call pipeline
(indexer_forward_wrapper, then indexer_top_k_wrapper with values) and dsagen.lightning_indexer at the same shape.

    python bench/indexer_forward.py [--T 4096 8192 32768] [--topk 2048] [--rounds 7] [--no-cudnn] [--json FILE]
                                    [--slab-mib 32 128] [--recompute-T 2048 4096 16384]
                                    [--scores-variant chunk1024 launch4096 fp8-stages8 fp8-consumers3]

B = 1, H = 64, D = 128, S_k = T, ratio 1 (causal), fresh random inputs; FP8: E4M3 q / k with per-(token, head) and
per-token FP32 descales (amax / 448), BF16 weights. Every group of contenders is timed interleaved
(common.paired_time_ms: 7 rounds, shuffled order, median), so the ratios are same-run ratios. Rows:
  scores bf16 / fp8        the dense FP32 scores [1, T, T] (-inf masked), allocated by each call; "+lse" also the
                           row logsumexp (cuDNN: return_lse=True);
  forward_topk bf16 / fp8  indices, logits, softmax and LSE; `slab N MiB` the same op with another slab cap;
  lightning_indexer        dsagen.lightning_indexer(causal=True): ids only (the same score + top-k pipeline);
  cudnn pipeline           indexer_forward_wrapper(ratio=1) + indexer_top_k_wrapper(return_val=True).
TFLOP/s counts the causal pairs: 2 H D T (T + 1) / 2.
--slab-mib / --slab-rows: extra forward_topk contenders with those slab caps (bytes / rows), through the host loop
with a replaced config, beside the host loop with the default config; --topk-finish-pass: one more, whose top-k
kernels leave the finish (LSE, softmax, global ids) to the separate finishing kernel; --host-path: FP8 scores
through out= and through the host's run (what the public op's validation and dispatch add).
--recompute-T: dense_indexer_score_recompute (out + denom) beside cuDNN's dense_indexer_score_recompute_wrapper.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import torch
from common import cudnn_dsa, paired_time_ms

H, D = 64, 128


def to_fp8(x: torch.Tensor):
    """E4M3 values and FP32 descales over the last dim (amax / 448)."""
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-6)
    scale = amax / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale.float()


def _group(name_fns: list[tuple[str, object]], rounds: int) -> dict[str, float]:
    names = [n for n, _ in name_fns]
    times = paired_time_ms([f for _, f in name_fns], rounds=rounds)
    return dict(zip(names, times))


def _scores_variant(q, k, w, t: int, variant: str, fp8=None):
    """indexer_scores (+lse) with another ScoresConfig, through the host's run (no custom op) into preallocated
    outputs: "chunkN" (candidates per work item), "launchN" (query rows per score launch), "stagesN" (the score
    kernel's K ring: 2N slots) or "consumersN" (its consumer warpgroups: 3, or 4 for the FP8 form only, its default); "fillN" without
    the LSE: fill1 the score kernel writes the -inf tails (the default), fill0 the finishing kernel's own pass does;
    "longestN" without the LSE: the score kernel's longest_first item order (1) or the forward order (0);
    "qtilesN" without the LSE: N Q tiles per score work item (2: FP8 only);
    "fp8-" before it: the FP8 form (fp8: (q8, k8, q_scale, k_scale))."""
    from dsagen.kernels.lightning_indexer.scores_host import run
    from dsagen.kernels.lightning_indexer.spec import scores_config_for

    m = re.fullmatch(r"(fp8-)?(chunk|launch|stages|consumers|fill|longest|qtiles)(\d+)", variant)
    if m is None:
        raise SystemExit(f"--scores-variant {variant!r}: expected [fp8-]chunkN, [fp8-]launchN, [fp8-]stagesN, "
                         f"[fp8-]fill0 / fill1, [fp8-]longest0 / longest1, fp8-qtiles1 / 2 or fp8-consumers3 / 4")
    dtype = "float8_e4m3fn" if m.group(1) else "bfloat16"
    cfg = scores_config_for(H, D, dtype, "sm_90a")
    n = int(m.group(3))
    if m.group(2) in ("stages", "consumers"):
        cfg = dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, **{m.group(2): n}))
    elif m.group(2) == "fill":
        cfg = dataclasses.replace(cfg, score_fills=bool(n))
    elif m.group(2) == "longest":
        cfg = dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, longest_first=bool(n)))
    elif m.group(2) == "qtiles":
        cfg = dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, q_tiles=n))
    else:
        field = {"chunk": "chunk_rows", "launch": "launch_rows"}[m.group(2)]
        cfg = dataclasses.replace(cfg, **{field: n})
    out = torch.empty((1, t, t), device=q.device)
    lse = None if m.group(2) in ("fill", "longest", "qtiles") else torch.empty((1, t), device=q.device)
    if m.group(1):
        q8, k8, qs, ks = fp8
        return lambda: run(q8, k8, w, 1, None, None, None, out, lse, q_scale=qs, k_scale=ks, config=cfg)
    return lambda: run(q, k, w, 1, None, None, None, out, lse, config=cfg)


def one_shape(t: int, args, dsa, gen) -> dict:
    import dsagen
    from dsagen.kernels.lightning_indexer.forward_topk_host import indexer_forward_topk as host_op
    from dsagen.kernels.lightning_indexer.forward_topk_host import scratch_bytes
    from dsagen.kernels.lightning_indexer.spec import forward_topk_config_for

    dev = torch.device("cuda")
    q = torch.randn((1, t, H, D), device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn((1, t, D), device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn((1, t, H), device=dev, generator=gen, dtype=torch.bfloat16)
    q8, qs = to_fp8(q)                       # (1, t, H, D), (1, t, H)
    k8, ks = to_fp8(k)                       # (1, t, D), (1, t)
    k4, k84 = k.unsqueeze(2), k8.unsqueeze(2)
    ks4 = ks.unsqueeze(-1)
    lens = torch.arange(1, t + 1, dtype=torch.int32, device=dev)
    fp8 = dict(precision="fp8", q_scale=qs, k_scale=ks)
    topk = args.topk
    rec = {"T": t, "topk": topk}

    scores = [("dsagen bf16", lambda: dsagen.indexer_scores(q, k, w)),
              ("dsagen bf16 +lse", lambda: dsagen.indexer_scores(q, k, w, return_lse=True)),
              ("dsagen fp8", lambda: dsagen.indexer_scores(q8, k8, w, **fp8)),
              ("dsagen fp8 +lse", lambda: dsagen.indexer_scores(q8, k8, w, return_lse=True, **fp8))]
    if dsa is not None:
        scores += [("cudnn bf16", lambda: dsa.indexer_forward_wrapper(q, k4, w, ratio=1)["scores"]),
                   ("cudnn bf16 +lse", lambda: dsa.indexer_forward_wrapper(q, k4, w, ratio=1, return_lse=True)),
                   ("cudnn fp8", lambda: dsa.indexer_forward_wrapper(q8, k84, w, ratio=1, precision="fp8",
                                                                     q_scale=qs, k_scale=ks4)["scores"]),
                   ("cudnn fp8 +lse", lambda: dsa.indexer_forward_wrapper(q8, k84, w, ratio=1, precision="fp8",
                                                                          q_scale=qs, k_scale=ks4, return_lse=True))]
    for variant in args.scores_variant:
        lse = "" if any(x in variant for x in ("fill", "longest", "qtiles")) else " +lse"
        label = f"dsagen fp8{lse} {variant[4:]}" if variant.startswith("fp8-") else f"dsagen bf16{lse} {variant}"
        scores.append((label, _scores_variant(q, k, w, t, variant, (q8, k8, qs, ks))))
    if args.host_path:
        from dsagen.kernels.lightning_indexer.scores_host import run as host_run

        out = torch.empty((1, t, t), device=dev)
        scores += [("dsagen fp8 out=", lambda: dsagen.indexer_scores(q8, k8, w, out=out, **fp8)),
                   ("dsagen fp8 host run, out", lambda: host_run(q8, k8, w, 1, None, None, None, out, None,
                                                                  q_scale=qs, k_scale=ks)),
                   ("dsagen fp8 host run, new out", lambda: host_run(q8, k8, w, 1, None, None, None,
                                                                      torch.empty((1, t, t), device=dev), None,
                                                                      q_scale=qs, k_scale=ks))]
    rec["scores_ms"] = _group(scores, args.rounds)
    torch.cuda.empty_cache()

    def fwd_topk(qq, kk, **kw):
        return lambda: dsagen.indexer_forward_topk(qq, kk, w, topk, return_softmax=True, return_lse=True, **kw)

    combined = [("forward_topk bf16", fwd_topk(q, k)), ("forward_topk fp8", fwd_topk(q8, k8, **fp8)),
                ("lightning_indexer", lambda: dsagen.lightning_indexer(q, k, w, topk, causal=True))]
    base_cfg = forward_topk_config_for(H, D, "bfloat16", "sm_90a")
    variants = [(f"slab {mib} MiB", dataclasses.replace(base_cfg, slab_bytes=mib * 2 ** 20)) for mib in args.slab_mib]
    variants += [(f"slab {r} rows", dataclasses.replace(base_cfg, slab_max_rows=r)) for r in args.slab_rows]
    if args.topk_finish_pass:
        variants.append(("finishing kernel", forward_topk_config_for(H, D, "bfloat16", "sm_90a", finish_in_topk=False)))
    if variants:
        variants.insert(0, ("host loop, default config", base_cfg))   # the variants' baseline: no public op
    for label, cfg in variants:
        combined.append((f"forward_topk bf16 {label}", lambda cfg=cfg: host_op(
            q, k, w, topk, ratio=1, q_causal_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None, width=t,
            return_softmax=True, return_lse=True, topk_indices_global=True, config=cfg)))
    if dsa is not None:
        def pipeline():
            s = dsa.indexer_forward_wrapper(q, k4, w, ratio=1)["scores"]
            return dsa.indexer_top_k_wrapper(s.view(t, t), lens, top_k=topk, return_val=True)["indices"]
        combined.append(("cudnn pipeline", pipeline))
    rec["combined_ms"] = _group(combined, args.rounds)
    rec["forward_topk_scratch_mib"] = round(scratch_bytes(H, t, t) / 2 ** 20, 1)
    if dsa is not None and t <= 8192:           # selection agreement with cuDNN's pipeline (fraction of ids shared)
        ours = dsagen.indexer_forward_topk(q, k, w, topk, return_softmax=False).indices[0].long()
        s = dsa.indexer_forward_wrapper(q, k4, w, ratio=1)["scores"]
        theirs = dsa.indexer_top_k_wrapper(s.view(t, t), lens, top_k=topk, return_val=False)["indices"].long()
        row = torch.arange(t, device=dev)[:, None] * (t + 1)
        a, b = (ours + row)[ours >= 0], (theirs + row)[theirs >= 0]
        rec["ids_shared_with_cudnn"] = round(torch.isin(a, b).float().mean().item(), 6)
    torch.cuda.empty_cache()
    return rec


def recompute_shape(t: int, args, dsa, gen) -> dict:
    """dense_indexer_score_recompute (out + denom) beside cuDNN's dense_indexer_score_recompute_wrapper."""
    import dsagen

    dev = torch.device("cuda")
    q = torch.randn((1, t, H, D), device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn((1, t, D), device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn((1, t, H), device=dev, generator=gen, dtype=torch.bfloat16)
    runs = [("dsagen dense recompute", lambda: dsagen.dense_indexer_score_recompute(q, k, w))]
    if dsa is not None:
        k4 = k.unsqueeze(2)
        runs.append(("cudnn dense recompute", lambda: dsa.dense_indexer_score_recompute_wrapper(q, k4, w, ratio=1)))
    rec = {"T": t, "recompute_ms": _group(runs, args.rounds)}
    torch.cuda.empty_cache()
    return rec


def report(rec: dict) -> None:
    t = rec["T"]
    flops = 2.0 * H * D * t * (t + 1) / 2
    if "recompute_ms" in rec:
        r = rec["recompute_ms"]
        for name, ms in r.items():
            print(f"T {t:<6} {name:<28} {ms:9.3f} ms  {flops / (ms * 1e9):7.1f} TFLOP/s")
        if "cudnn dense recompute" in r:
            print(f"ratio: dense recompute vs cuDNN {r['cudnn dense recompute'] / r['dsagen dense recompute']:.2f}x")
        return
    print(f"\n## T = {t} (H {H}, D {D}, causal, topk {rec['topk']}); forward_topk scratch "
          f"{rec['forward_topk_scratch_mib']} MiB" + (f"; ids shared with cuDNN {rec['ids_shared_with_cudnn']}"
                                                      if "ids_shared_with_cudnn" in rec else ""))
    for group in ("scores_ms", "combined_ms"):
        for name, ms in rec[group].items():
            print(f"{name:<34} {ms:9.3f} ms  {flops / (ms * 1e9):7.1f} TFLOP/s")
    s, c = rec["scores_ms"], rec["combined_ms"]
    ratios = []
    for ours, theirs in (("dsagen bf16", "cudnn bf16"), ("dsagen bf16 +lse", "cudnn bf16 +lse"),
                         ("dsagen fp8", "cudnn fp8"), ("dsagen fp8 +lse", "cudnn fp8 +lse")):
        if theirs in s:
            ratios.append(f"{ours} vs cuDNN {s[theirs] / s[ours]:.2f}x")
    ratios.append(f"fp8 vs bf16 (dsagen) {s['dsagen bf16'] / s['dsagen fp8']:.2f}x")
    if "cudnn pipeline" in c:
        ratios.append(f"forward_topk vs cuDNN pipeline {c['cudnn pipeline'] / c['forward_topk bf16']:.2f}x")
    ratios.append(f"forward_topk / lightning_indexer {c['forward_topk bf16'] / c['lightning_indexer']:.3f}")
    print("ratios: " + "; ".join(ratios))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 8192, 32768])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--slab-mib", type=int, nargs="*", default=[])
    ap.add_argument("--slab-rows", type=int, nargs="*", default=[],
                    help="extra forward_topk contenders with these slab row caps")
    ap.add_argument("--scores-variant", nargs="*", default=[],
                    help="also time indexer_scores (+lse) with another config: chunkN (work-item candidates), "
                         "launchN (query rows per launch), stagesN (K ring of 2N slots), consumersN (consumer "
                         "warpgroups; the FP8 form's default is 4); fp8-X: the FP8 form (fp8-consumers3)")
    ap.add_argument("--host-path", action="store_true",
                    help="also time FP8 indexer_scores with out=, and its host run (no validation or dispatch) into "
                         "the same or a new output: what the public op's host path adds")
    ap.add_argument("--topk-finish-pass", action="store_true",
                    help="also time forward_topk (bf16, host loop) with the separate finishing kernel")
    ap.add_argument("--recompute-T", type=int, nargs="*", default=[],
                    help="also time dense_indexer_score_recompute beside cuDNN's at these T")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dsa = None if args.no_cudnn else cudnn_dsa()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}"
          + ("  cuDNN frontend DSA (SM90 kernels)" if dsa is not None else ""))
    gen = torch.Generator(device="cuda").manual_seed(0)
    recs = []
    shapes = [(t, one_shape) for t in args.T] + [(t, recompute_shape) for t in args.recompute_T]
    for t, fn in shapes:
        rec = fn(t, args, dsa, gen)
        report(rec)
        recs.append(rec)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
