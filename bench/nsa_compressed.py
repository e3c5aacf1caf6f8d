"""NSA forward with the compressed branch (g_cmp: the compressed attention selects the blocks): dsagen's fused
kernels against FLA's Triton `parallel_nsa` (GPU).

    PYTHONPATH=.peer/fla python bench/nsa_compressed.py [--T 8192 32768 65536] [--rounds 7] [--group 16]
                                                        [--backward]

Shape: B 1, HQ = 4 x group query heads over H 4 KV heads, D = Dv = 128, blocks of 64 tokens, 16 selected blocks,
bf16, gates g_cmp and g_slc (uniform in [0, 1)), no block_indices (the compressed branch's top-k chooses them), no
sliding window. Both contenders run the same four steps: mean-pool k / v, the compressed attention (o_cmp, lse),
the blocks' importance and top-k, the selected branch on the chosen blocks; then the gated sum.
  dsagen: dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=16, impl="fused");
          also its compressed part alone (dsagen.kernels.nsa.host.compressed_forward: pooling, attention,
          importance, selection) as `dsagen-cmp`.
  fla:    fla.ops.nsa.parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=16, block_size=64,
          scale=1/sqrt(D)) from the fla-core 0.6.0 wheel in .peer/fla (optional: without it dsagen runs alone).
FLOPs (nominal, per token): the selected branch 4 HQ D 16 x 64, the compressed attention 4 HQ D (t / 64) summed over
t (its causal count), the importance pass 2 HQ D (t / 64); the printed TFLOP/s are these over the time.
Checks on the first T: the two outputs (max abs difference and the share of (token, head) rows that differ by more
than 0.05). They select by different rules (FLA forces block 0 and the token's last two blocks, dsagen's reference
only the own block), so the rows whose selections differ are reported, not asserted; dsagen's selection is tested
against its FP64 oracle in tests/gpu/test_nsa_compressed.py.
--backward: forward + backward through autograd (gradients of q, k, v and both gates; FLOPs counted 3.5x the
forward's, nominal).
Time: CUDA events, contenders interleaved round by round (common.paired_time_ms), median of --rounds.
"""

from __future__ import annotations

import argparse
import math

import torch
from common import print_paired

import dsagen
from dsagen.kernels.nsa.host import compressed_forward

H, D, BLOCK, S = 4, 128, 64, 16


def flops(t: int, hq: int) -> float:
    cmp_keys = sum((i + 1) // BLOCK for i in range(t))
    return 4 * hq * D * S * BLOCK * t + 4 * hq * D * cmp_keys + 2 * hq * D * cmp_keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--group", type=int, default=16, help="query heads per KV head (FLA needs >= 16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backward", action="store_true",
                    help="also time forward + backward through autograd (q, k, v, g_cmp, g_slc)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 1
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:                       # noqa: BLE001 - the peer is optional
        print(f"# FLA parallel_nsa not importable ({type(e).__name__}: {e}); dsagen rows only")
        parallel_nsa = None
    hq = H * args.group
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    for i, t in enumerate(args.T):
        q = torch.randn((1, t, hq, D), generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, t, H, D), generator=gen, device="cuda", dtype=torch.bfloat16)
        v = torch.randn((1, t, H, D), generator=gen, device="cuda", dtype=torch.bfloat16)
        g_cmp = torch.rand((1, t, hq), generator=gen, device="cuda")
        g_slc = torch.rand((1, t, hq), generator=gen, device="cuda")
        fns = [("dsagen", lambda: dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc,
                                                                 block_counts=S, block_size=BLOCK))]
        if parallel_nsa is not None:
            fns.append(("fla", lambda: parallel_nsa(q, k, v, g_cmp=g_cmp.bfloat16(), g_slc=g_slc.bfloat16(),
                                                    block_counts=S, block_size=BLOCK, scale=1 / math.sqrt(D))))
        if i == 0 and parallel_nsa is not None:
            a, b = fns[0][1]().float(), fns[1][1]().float()
            err = (a - b).abs()
            rows = (err.amax(-1) > 0.05).float().mean().item()
            print(f"T {t}: max |dsagen - fla| {err.max().item():.4f} (max |fla| {b.abs().max().item():.3f}); "
                  f"rows differing > 0.05: {rows:.4%}", flush=True)
        print_paired(f"T {t} G {args.group} forward", fns, flops(t, hq), args.rounds)
        scale = 1 / math.sqrt(D)
        print_paired(f"T {t} compressed part", [("dsagen-cmp", lambda: compressed_forward(q, k, v, S, None, scale,
                                                                                          BLOCK))],
                     flops(t, hq) - 4 * hq * D * S * BLOCK * t, args.rounds)
        if args.backward:
            do = torch.randn((1, t, hq, D), generator=gen, device="cuda", dtype=torch.bfloat16)

            def step(fn, gate_dtype):
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                gates = [x.detach().to(gate_dtype).requires_grad_() for x in (g_cmp, g_slc)]
                out = fn(*leaves, *gates)
                return torch.autograd.grad(out, leaves + gates, do)

            steps = [("dsagen", lambda: step(lambda q_, k_, v_, gc, gs: dsagen.native_sparse_attention(
                q_, k_, v_, g_cmp=gc, g_slc=gs, block_counts=S, block_size=BLOCK), torch.float32))]
            if parallel_nsa is not None:
                steps.append(("fla", lambda: step(lambda q_, k_, v_, gc, gs: parallel_nsa(
                    q_, k_, v_, g_cmp=gc, g_slc=gs, block_counts=S, block_size=BLOCK, scale=1 / math.sqrt(D)),
                    torch.bfloat16)))
            print_paired(f"T {t} G {args.group} forward + backward", steps, 3.5 * flops(t, hq), args.rounds)
        q = k = v = None                         # free before the next length
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
