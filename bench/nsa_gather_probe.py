"""How fast the NSA selected branch's K / V bytes can be read at all, with no attention math (GPU, Triton).

    python bench/nsa_gather_probe.py [--T 8192 32768 65536]

NSA's selected branch at the paper's shape (H 4 KV heads, D 128, blocks of 64 tokens, 16 selected blocks per token
and KV head) reads, in a token-outer kernel (FLA's `parallel_nsa`: one program per token x KV head), 16 x 64 rows of
K and of V per (token, head): 2 MB a token. This probe runs exactly those loads (one Triton program per token x
head, each adding up its 16 K and V tiles in FP32 and storing one float) for two index patterns: `random` (every
token draws its blocks uniformly among its causal ones, as FLA's tests do) and `hot16` (every token reads blocks
0..15, so every load after the first hits L2). The best of 4 pipeline depths x 2 warp counts is printed with the
bytes it moved per second. A design that loads each (token, head, block) separately cannot be faster than the
`random` row on random indices; only reuse of blocks between tokens (overlapping selections, per-query-block
indices) moves below it.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

H, S, BLOCK, D = 4, 16, 64, 128


@triton.jit
def _gather_sum(K, V, I, O, H: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                NS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for i in tl.range(0, S, num_stages=NS):
        b = tl.load(I + (t * H + h) * S + i).to(tl.int64)
        p = (b * BLOCK + r)[:, None] * (H * D) + h * D + d[None, :]
        acc += tl.load(K + p).to(tl.float32) + tl.load(V + p).to(tl.float32)
    tl.store(O + t * H + h, tl.sum(acc))


def best_ms(k, v, ids, out, t: int) -> float:
    """The fastest of the probe's launch configurations, ms per launch (5 back-to-back launches each)."""
    best = float("inf")
    for stages in (1, 2, 3, 4):
        for warps in (4, 8):
            def run():
                _gather_sum[(t, H)](k, v, ids, out, H, S, BLOCK, D, stages, num_warps=warps)
            run()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                run()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) / 5)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for t in args.T:
        k = torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty(t * H, device="cuda")
        causal_blocks = (torch.arange(t, device="cuda") // BLOCK + 1).view(t, 1, 1)
        random = (torch.rand(t, H, S, device="cuda") * causal_blocks).long().clamp(max=t // BLOCK - 1)
        hot = torch.arange(S, device="cuda", dtype=torch.int32).expand(t, H, S)
        for name, ids in (("random", random.int().contiguous()), ("hot16", hot.contiguous())):
            ms = best_ms(k, v, ids, out, t)
            moved = t * H * S * BLOCK * D * 2 * 2               # K and V tiles, bf16
            print(f"T {t:<6} {name:<7} {ms:8.3f} ms  {moved / ms / 1e9:6.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
