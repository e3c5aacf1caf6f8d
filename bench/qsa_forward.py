"""QSA indexed forward (and backward): dsagen's fused kernels against the plain-PyTorch reference (GPU; no Hopper
peer exists).

    python bench/qsa_forward.py [--T 32768 131072] [--width 2048 512] [--heads 12/1 24/2]
                                [--indices random local] [--ref-max-T 8192] [--rounds 7] [--seed 0] [--backward]
                                [--json FILE]

Shape: packed tokens T, Hq / Hkv query / KV heads, D = Dv = 256, bf16 (FlashInfer QSA's). Ids int32 [T, W] drawn on
the GPU: per query its own four-token block cut at the query (the partial causal tail, then -1 in the block's
remaining slots), then W / 4 - 1 four-token blocks among its earlier ones (uniformly, with possible repeats: the
kernel's work does not depend on them being distinct), in one of two modes:
  random: every query draws its own blocks.
  local:  the 16 queries of an aligned 16-token group share the blocks drawn for the group's first query (their
          selections overlap, as an indexer's selections of neighbouring queries do), so the gathered rows of
          neighbouring CTAs hit in L2.
Queries with fewer earlier blocks than W / 4 - 1 repeat blocks. FLOPs = 4 * Hq * 256 * W per query (QK^T and PV
over every slot). The issue's bound: 60% of the 780 TFLOP/s tensor floor is 468 TFLOP/s.
Contenders (interleaved, common.print_paired): dsagen.qsa_indexed_forward(impl="fused"), and up to --ref-max-T the
reference (dsagen.qsa_indexed_forward(impl="reference"), FP32 accumulation in chunks of rows). Checks: at the first
T (and T <= --ref-max-T) the fused out_fp32 / lse against the reference (max abs difference), and two fused calls
bitwise equal.

--backward times, instead, the fused forward alone and forward + backward through autograd (q, k, v requiring
gradients, the loss the sum of out_fp32 times a fixed random tensor, so dq / dk / dv all run), interleaved; the
backward's figure is their difference, counting 10 * Hq * 256 * W FLOPs a query (S recomputed, dP, dQ, dK, dV: 2.5x
the forward's). No reference contender there.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import paired_time_ms, print_paired

import dsagen

D = 256


def make_ids(t: int, w: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    """int32 [t, w] ids on the GPU, as the module docstring describes."""
    dev = "cuda"
    pos = torch.arange(t, device=dev)
    own = pos // 4
    n_blk = w // 4 - 1
    src = pos if mode == "random" else (pos // 16) * 16                 # whose draw a query takes
    u = torch.rand((t, n_blk), generator=gen, device=dev)
    u = u if mode == "random" else u[src]
    blocks = (u * (src // 4)[:, None].clamp(min=1)).long()              # earlier blocks of the drawing query
    blocks = torch.minimum(blocks, (own - 1).clamp(min=0)[:, None])      # ... never past the query's own
    ids = (blocks[:, :, None] * 4 + torch.arange(4, device=dev)).reshape(t, n_blk * 4)
    ids = torch.where((own[:, None] > 0), ids, torch.full_like(ids, -1))  # the first block has no earlier ones
    tail = own[:, None] * 4 + torch.arange(4, device=dev)
    tail = torch.where(tail <= pos[:, None], tail, torch.full_like(tail, -1))
    return torch.cat([tail, ids], dim=1).int().contiguous()


def time_backward(q, k, v, ids, label: str, rounds: int, gen: torch.Generator) -> dict:
    """Forward alone and forward + backward of the fused op, interleaved; prints and returns ms and TFLOP/s."""
    t, hq, d = q.shape
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn((t, hq, v.shape[2]), generator=gen, device="cuda")

    def fwd():
        with torch.no_grad():
            dsagen.qsa_indexed_forward(qg, kg, vg, ids)

    def fwd_bwd():
        out = dsagen.qsa_indexed_forward(qg, kg, vg, ids)[1]
        torch.autograd.grad((out * dout).sum(), (qg, kg, vg))

    ms_f, ms_fb = paired_time_ms([fwd, fwd_bwd], rounds=rounds)
    w = ids.shape[1]
    flops_f = 4.0 * hq * d * w * t
    ms_b = ms_fb - ms_f
    print(f"{label}: forward {ms_f:.3f} ms ({flops_f / (ms_f * 1e9):.0f} TFLOP/s)  forward + backward {ms_fb:.3f} ms"
          f"  backward {ms_b:.3f} ms ({2.5 * flops_f / (ms_b * 1e9):.0f} TFLOP/s)", flush=True)
    return {"label": label, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "bwd_ms": ms_b,
            "bwd_tflops": 2.5 * flops_f / (ms_b * 1e9)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--width", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--heads", nargs="+", default=["12/1", "24/2"])
    ap.add_argument("--indices", nargs="+", default=["random", "local"], choices=["random", "local"])
    ap.add_argument("--ref-max-T", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backward", action="store_true", help="time forward + backward (see the module docstring)")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  dsagen {dsagen.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    checked = False
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for t in args.T:
            q = (torch.randn((t, hq, D), generator=gen, device="cuda") * 0.5).bfloat16()
            k = (torch.randn((t, hkv, D), generator=gen, device="cuda") * 0.5).bfloat16()
            v = torch.randn((t, hkv, D), generator=gen, device="cuda").bfloat16()
            for w in args.width:
                for mode in args.indices:
                    ids = make_ids(t, w, mode, gen)
                    if args.backward:
                        rows.append(time_backward(q, k, v, ids, f"{heads} T {t} W {w} {mode}", args.rounds, gen))
                        continue
                    fused = lambda: dsagen.qsa_indexed_forward(q, k, v, ids)           # noqa: E731
                    fns = [("dsagen", fused)]
                    if t <= args.ref_max_T:
                        fns.append(("reference", lambda: dsagen.qsa_indexed_forward(q, k, v, ids, impl="reference")))
                    check = {}
                    if not checked and t <= args.ref_max_T:
                        a, b = fused(), fused()
                        r = fns[1][1]()
                        check = {"bitwise_repeat": all(torch.equal(x, y) for x, y in zip(a, b)),
                                 "out_fp32_max_abs": float((a[1] - r[1]).abs().max()),
                                 "lse_max_abs": float((a[2] - r[2]).nan_to_num(posinf=0, neginf=0).abs().max())}
                        print(f"# check {heads} T {t} W {w} {mode}: {check}", flush=True)
                        checked = True
                    flops = 4.0 * hq * D * w * t
                    ms = print_paired(f"{heads} T {t} W {w} {mode}", fns, flops, args.rounds)
                    rows.append({"heads": heads, "T": t, "W": w, "indices": mode, "ms": ms,
                                 "tflops": [flops / (m * 1e9) for m in ms], **check})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
