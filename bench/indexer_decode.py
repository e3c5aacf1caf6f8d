"""The decode-time indexer over a paged key cache: dsagen.indexer_decode_topk (impl="fused") on the FP8 and BF16 caches
against the memory floor of reading the visible keys (GPU).

    python bench/indexer_decode.py [--batch 1,32,128] [--next-n 1,2] [--cache-tokens 65536] [--topk 2048]
                                   [--reps N] [--hbm-tbps 4.8] [--json FILE]

Shapes: H 64, D 128 (DeepSeek-V3.2's indexer), pages of 64 tokens, each sequence `cache-tokens` long in its own
randomly placed pages (B x cache-tokens / 64 pages in the pool), weights FP32, top_k ids per query. Each contender is
a replayed CUDA graph of `reps` calls (the serving loop: no host time), timed with common.paired_time_ms (the order
shuffled every round). No peer runs here: DeepGEMM's fp8_paged_mqa_logits is built by its own JIT, which needs
CUTLASS headers and a network install on the GPU machine. Instead each row states the floor: the bytes of the
visible keys (FP8: D + 4 bytes a token, BF16: 2 D) read once at --hbm-tbps, and the FP8 tensor cores' FLOPs
(2 H D a query and key; next_n queries share the keys' bytes).

Columns: ms per call, GB/s of key bytes read per call (each sequence's keys once), that floor's ms and the share of
it reached (floor / measured), TFLOP/s.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import graphed, paired_time_ms

import dsagen

H, D, PAGE = 64, 128, 64


def case_inputs(b: int, next_n: int, cache_tokens: int, fp8: bool, seed: int):
    """q [b, next_n, H, D], weights [b, next_n, H] FP32, the cache [pages, 64, 1, D + 4] uint8 (FP8) or [pages, 64,
    D] bf16, a page table [b, cache_tokens / 64] of distinct random pages, lengths [b] = cache_tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-cache_tokens // PAGE)
    pages = b * per_seq
    k = torch.randn((pages, PAGE, D), generator=gen, device="cuda")
    if fp8:
        cache = dsagen.quantize_index_k_fp8(k, impl="reference")
        q = (torch.randn((b, next_n, H, D), generator=gen, device="cuda") * 2).to(torch.float8_e4m3fn)
    else:
        cache = k.bfloat16()
        q = torch.randn((b, next_n, H, D), generator=gen, device="cuda").bfloat16()
    w = torch.randn((b, next_n, H), generator=gen, device="cuda")
    table = torch.randperm(pages, generator=gen, device="cuda").view(b, per_seq).int()
    lens = torch.full((b,), cache_tokens, dtype=torch.int32, device="cuda")
    return q, w, cache, table, lens


def run_case(b: int, next_n: int, cache_tokens: int, top_k: int, reps: int, hbm_tbps: float) -> dict:
    """One shape, FP8 and BF16 caches: ms per call, key GB/s, the floor and TFLOP/s of each."""
    fns, sizes = {}, {}
    for fp8 in (True, False):
        name = "fp8" if fp8 else "bf16"
        q, w, cache, table, lens = case_inputs(b, next_n, cache_tokens, fp8, seed=b * 10 + next_n)
        call = (lambda q=q, w=w, cache=cache, table=table, lens=lens:
                dsagen.indexer_decode_topk(q, w, cache, table, lens, top_k))
        call()
        fns[name] = graphed(call, reps)
        sizes[name] = b * cache_tokens * ((D + 4) if fp8 else 2 * D)
    times = dict(zip(fns, (t / reps for t in paired_time_ms(list(fns.values())))))
    row = {"B": b, "next_n": next_n, "cache_tokens": cache_tokens, "top_k": top_k}
    flops = 2.0 * b * next_n * H * D * cache_tokens
    for name, ms in times.items():
        floor_ms = sizes[name] / (hbm_tbps * 1e12) * 1e3
        row[f"{name}_ms"] = ms
        row[f"{name}_GBps"] = sizes[name] / (ms * 1e-3) / 1e9
        row[f"{name}_floor_ms"] = floor_ms
        row[f"{name}_of_floor"] = floor_ms / ms
        row[f"{name}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128", help="comma list of batch sizes")
    ap.add_argument("--next-n", default="1,2", help="comma list of query tokens per sequence")
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="the memory floor's bandwidth (H200: 4.8 TB/s)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for next_n in (int(x) for x in args.next_n.split(",")):
            row = run_case(b, next_n, args.cache_tokens, args.topk, args.reps, args.hbm_tbps)
            rows.append(row)
            print(f"B {b:4d} next_n {next_n}  " + "  ".join(
                f"{k} {row[f'{k}_ms']:.4f} ms ({row[f'{k}_GBps']:.0f} GB/s, floor {row[f'{k}_floor_ms']:.4f} ms = "
                f"{row[f'{k}_of_floor']:.2f} of it, {row[f'{k}_TFLOPs']:.0f} TFLOP/s)" for k in ("fp8", "bf16")),
                flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "H": H, "D": D}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
