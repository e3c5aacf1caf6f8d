"""Sparse MLA decode over a paged cache: dsagen.sparse_attention_decode on the FP8 and BF16 caches, with and without
the split over the KV slots, optionally beside FlashMLA's SM90 sparse FP8 decode, in one run (GPU).

    python bench/sparse_attention_decode.py [--batch 1,32,128] [--s-q 1,2] [--cache-tokens 65536] [--topk 2048]
                                            [--reps N] [--graph] [--flashmla DIR]
                                            [--shared-dequant-other] [--json FILE]

Shapes: H 128, D 576 / 512, page blocks of 64 tokens, `cache-tokens` cached tokens, ids drawn without repeats per
row over the whole cache (page-encoded rows), a sink. Contenders, timed interleaved on the same inputs
(common.paired_time_ms, the order shuffled every round): `fp8` the public op on the FP8 cache (the split when
decode_host.split_plan picks one), `fp8 whole` the same kernel without the split (the flat entry with split=None),
`bf16` the public op on the BF16 cache of the same dequantized values, with --shared-dequant-other `fp8 other` the
FP8 kernel with the other SparseAttnFwdConfig.shared_dequant setting than the op's (the op's split), and with
--flashmla DIR FlashMLA's decode on the FP8 cache: DIR holds `flashmla_peer.py`, built from FlashMLA's source with nvcc for sm_90a (not part of dsagen),
whose `sparse_decode_fp8(q, cache, indices, sink, scale) -> (out, lse)` takes q [B, s_q, H, 576] bf16, the cache
[blocks, 64, 1, 656] uint8 and indices [B, s_q, topk] int32 as dsagen's op does. --graph times each contender as a
replayed CUDA graph of `reps` calls (the serving loop: no host time); otherwise eager calls, host path included.

FLOPs = 2 B s_q H topk (576 + 512). Columns: ms per call and TFLOP/s of each contender, the split's speedup over the
whole-row kernel, dsagen FP8 against FlashMLA (above 1: dsagen is faster), and the max abs differences of out and
lse between the FP8 contenders and against the BF16 run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from common import graphed, paired_time_ms

import dsagen
import dsagen.kernels.sparse_mla.host as fused_sa
from dsagen.kernels.sparse_mla.decode_host import split_plan
from dsagen.kernels.sparse_mla.spec import config_for

H, D_QK, D_V, PAGE = 128, 576, 512, 64


def case_inputs(b: int, s_q: int, cache_tokens: int, topk: int, seed: int):
    """q [b, s_q, H, 576] bf16, the FP8 cache [blocks, 64, 1, 656] uint8 and its dequantized BF16 cache, indices
    [b, s_q, topk] int32 without repeats per row, a sink [H]."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-cache_tokens // PAGE)
    kv = (torch.randn((blocks, PAGE, D_QK), generator=gen) * 0.5).bfloat16().cuda()
    fp8 = dsagen.quantize_kv_fp8(kv, impl="reference").unsqueeze(2)
    bf16 = dsagen.dequantize_kv_fp8(fp8, impl="reference")
    q = torch.randn((b, s_q, H, D_QK), generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(blocks * PAGE, generator=gen)[:topk] for _ in range(b * s_q)])
    ids = ids.to(torch.int32).view(b, s_q, topk).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    return q, fp8, bf16, ids, sink


def run_case(b, s_q, cache_tokens, topk, reps, graph, flashmla, seed, shared=False):
    q, fp8, bf16, ids, sink = case_inputs(b, s_q, cache_tokens, topk, seed)
    scale = D_QK ** -0.5
    rows = fp8.view(-1, 656)
    fns = {
        "fp8": lambda: dsagen.sparse_attention_decode(q, fp8, ids, attn_sink=sink, softmax_scale=scale),
        "fp8_whole": lambda: fused_sa._launch(q.view(-1, H, D_QK), rows, ids.view(b * s_q, topk), sink, None, scale,
                                              D_V)[:2],
        "bf16": lambda: dsagen.sparse_attention_decode(q, bf16, ids, attn_sink=sink, softmax_scale=scale),
    }
    if shared:     # the other shared_dequant setting than the op's, whole rows and with the op's split
        op_config = config_for(H, D_QK, "bfloat16", None, "sm_90a", None, True)
        other = dataclasses.replace(op_config, shared_dequant=not op_config.shared_dequant)
        split = split_plan(b * s_q, H, topk, torch.cuda.get_device_properties(0).multi_processor_count)
        fns["fp8_other"] = lambda: fused_sa._launch(q.view(-1, H, D_QK), rows, ids.view(b * s_q, topk), sink, None,
                                                    scale, D_V, config=other, split=split)[:2]
    if flashmla is not None:
        fns["flashmla"] = lambda: flashmla.sparse_decode_fp8(q, fp8, ids, sink, scale)
    outs = {k: fn() for k, fn in fns.items()}
    calls = reps
    timed = list(fns.values())
    if graph:
        timed, calls = [graphed(fn, reps) for fn in timed], 1
    times = dict(zip(fns, (t / reps if graph else t for t in paired_time_ms(timed, calls=calls))))
    flops = 2.0 * b * s_q * H * topk * (D_QK + D_V)
    split = split_plan(b * s_q, H, topk, torch.cuda.get_device_properties(0).multi_processor_count)
    row = {"B": b, "s_q": s_q, "cache_tokens": cache_tokens, "topk": topk, "split": split, "graph": graph}
    for k, ms in times.items():
        row[f"{k}_ms"] = ms
        row[f"{k}_tflops"] = flops / ms / 1e9
    row["split_speedup"] = times["fp8_whole"] / times["fp8"]
    base_out, base_lse = outs["fp8"]
    for k in ("fp8_whole", "fp8_other", "bf16", "flashmla"):
        if k in outs:
            o, lse = outs[k]
            row[f"{k}_max_abs_diff_out"] = (o.float().view_as(base_out) - base_out.float()).abs().max().item()
            fin = torch.isfinite(base_lse)
            row[f"{k}_max_abs_diff_lse"] = (lse.view_as(base_lse)[fin] - base_lse[fin]).abs().max().item()
    if "flashmla" in times:
        row["vs_flashmla"] = times["flashmla"] / times["fp8"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128", help="comma list of batch sizes")
    ap.add_argument("--s-q", default="1,2", help="comma list of query tokens per sequence")
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="time replayed CUDA graphs of reps calls (no host time)")
    ap.add_argument("--flashmla", metavar="DIR",
                    help="a folder with flashmla_peer.py (FlashMLA built with nvcc for sm_90a)")
    ap.add_argument("--shared-dequant-other", action="store_true",
                    help="also time `fp8_other`: the FP8 kernel with the other shared_dequant setting than the op's "
                         "(SparseAttnFwdConfig.shared_dequant: a cluster of two sharing the dequantization), with "
                         "the op's split")
    ap.add_argument("--json")
    args = ap.parse_args()
    flashmla = None
    if args.flashmla:
        sys.path.insert(0, args.flashmla)
        import flashmla_peer as flashmla
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for s_q in (int(x) for x in args.s_q.split(",")):
            row = run_case(b, s_q, args.cache_tokens, args.topk, args.reps, args.graph, flashmla, seed=b * 10 + s_q,
                           shared=args.shared_dequant_other)
            rows.append(row)
            cols = [f"{k}={row[k]:.4f}" for k in row if k.endswith("_ms")]
            extra = f" vs FlashMLA {row['vs_flashmla']:.2f}x" if "vs_flashmla" in row else ""
            print(f"B {b:4d} s_q {s_q}  split {row['split']}  " + "  ".join(cols)
                  + f"  split x{row['split_speedup']:.2f}{extra}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "H": H}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
