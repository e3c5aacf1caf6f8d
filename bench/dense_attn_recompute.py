"""Dense attention score recompute (cuDNN frontend DSA §8): dsagen's fused sm_90a kernel (attn_score_recompute
dense_host, the kernel of DenseAttnScoreRecomputeSpec) beside cuDNN frontend's SM90 dense_attn_score_recompute_wrapper
in one process on the same tensors (GPU).

    python bench/dense_attn_recompute.py [--T 2048 4096 16384] [--shapes 128x576 64x512] [--rounds 7] [--no-cudnn]
                                         [--one-row]

B = 1, S_k = T, ratio 1 (causal), bf16, lse the true per-head dense LSE (FP32, computed in blocks). Both write the
whole [T, T] FP32 output (-inf past the causal limit) and the row denominators, into buffers allocated once.
TFLOP/s over the causal pairs: 2 H D T (T + 1) / 2. Timing: bench/common.paired_time_ms (the contenders
interleaved, 7 rounds, median; every call from an idle GPU). Before timing, the two outputs are compared: the same
-inf pattern and the largest difference of the finite entries relative to their largest magnitude (and of denom).
--one-row: at 64 heads also the one-row kernel (DenseAttnScoreRecomputeConfig(row_pairs=False); the default there
takes two query rows per item), as a contender after dsagen's default and cuDNN, its output compared with the
default's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dsa_bench_start, print_paired  # noqa: E402

from dsagen.kernels.attn_score_recompute import dense_host  # noqa: E402
from dsagen.kernels.attn_score_recompute.spec import DenseAttnScoreRecomputeConfig  # noqa: E402


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(1, T, H) FP32 logsumexp over s <= t of scale * q[0, t, h] . k[0, s], in blocks of rows."""
    t, h = q.shape[1], q.shape[2]
    out = torch.empty(1, t, h, dtype=torch.float32, device=q.device)
    kf = k[0].float()
    cols = torch.arange(t, device=q.device)
    step = max(1, (1 << 27) // (h * t))
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        sc = torch.einsum("thd,sd->ths", q[0, r0:r1].float(), kf) * scale
        sc.masked_fill_(cols[None, None, :] > torch.arange(r0, r1, device=q.device)[:, None, None], -math.inf)
        out[0, r0:r1] = torch.logsumexp(sc, dim=-1)
    return out


def compare(out: torch.Tensor, den: torch.Tensor, ref_out: torch.Tensor, ref_den: torch.Tensor) -> str:
    """Whether out has ref_out's -inf pattern, and the largest differences of the finite entries and of the
    denominators, each relative to the reference's largest magnitude."""
    same = torch.equal(torch.isneginf(out), torch.isneginf(ref_out))
    fin = ~torch.isneginf(ref_out)
    rel = ((out[fin] - ref_out[fin]).abs().max() / ref_out[fin].abs().max().clamp(min=1e-30)).item()
    drel = ((den - ref_den).abs().max() / ref_den.abs().max().clamp(min=1e-30)).item()
    return f"-inf pattern equal {same}, out rel diff {rel:.2e}, denom rel diff {drel:.2e}"


def one(t: int, h: int, d: int, args, dsa) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t + h + d)
    q = (torch.randn((1, t, h, d), device="cuda", generator=gen) * 0.5).bfloat16()
    k = (torch.randn((1, t, d), device="cuda", generator=gen) * 0.5).bfloat16()
    scale = d ** -0.5
    lse = dense_lse(q, k, scale)
    out, den = torch.empty((1, t, t), device="cuda"), torch.empty((1, t), device="cuda")
    fns = [("dsagen", lambda: dense_host.dense_attn_score_recompute(q, k, lse, scale, out=out, denom=den))]
    if dsa is not None:
        out_c, den_c = torch.empty((1, t, t), device="cuda"), torch.empty((1, t), device="cuda")
        k4 = k.unsqueeze(2)
        fns.append(("cudnn", lambda: dsa.dense_attn_score_recompute_wrapper(q, k4, lse, scale, ratio=1, out=out_c,
                                                                           denom_out=den_c)))
        for _, f in fns:
            f()
        torch.cuda.synchronize()
        print(f"T {t} H {h} D {d}: {compare(out, den, out_c, den_c)}", flush=True)
    if args.one_row and h == 64:
        out_p, den_p = torch.empty((1, t, t), device="cuda"), torch.empty((1, t), device="cuda")
        one_row = DenseAttnScoreRecomputeConfig(row_pairs=False)
        fns.append(("dsagen one row", lambda: dense_host.dense_attn_score_recompute(q, k, lse, scale, out=out_p,
                                                                                   denom=den_p, config=one_row)))
        fns[0][1]()
        fns[-1][1]()
        torch.cuda.synchronize()
        print(f"T {t} H {h} D {d}: one row {compare(out_p, den_p, out, den)}", flush=True)
    ms = print_paired(f"T {t} H {h} D {d}", fns, 2 * h * d * t * (t + 1) / 2, args.rounds)
    if len(fns) == 3:
        print(f"T {t} H {h} D {d}: one row vs cudnn {ms[1] / ms[2]:.2f}x, default vs one row {ms[2] / ms[0]:.2f}x",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    ap.add_argument("--shapes", nargs="+", default=["128x576", "64x512"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--one-row", action="store_true", help="at 64 heads also time the one-row kernel")
    args = ap.parse_args()
    dsa = dsa_bench_start(args.no_cudnn)
    for shape in args.shapes:
        h, d = map(int, shape.split("x"))
        for t in args.T:
            one(t, h, d, args, dsa)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
