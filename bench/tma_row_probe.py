"""Can Hopper TMA gather KV rows? Per-row TMA boxes into a 128B-swizzled tile: which layout lands, and how fast.

    python bench/tma_row_probe.py [--ctas N] [--reps R] [--json FILE]

Why: a 2-CTA cluster could share the sparse forward's KV gather with TMA multicast, but SM90 TMA has no row
gather (Blackwell's gather4 does). The stand-in is one box of 64 columns x 1 row per (row, 128-byte column
block), 9 per row at D_qk 576, each written at the row's 128-byte line of an 8 KiB column block of a K-major
SW128 tile (the layout the wgmma reads). Two open questions, answered here on the GPU:
1. Layout: is the 128B swizzle applied from the shared-memory address (line r of a block gets row r's phase,
   chunk c lands at c ^ (r % 8): the wgmma image), or relative to the box (a 1-row box is never permuted)?
   Ids -1 and >= n_kv are out of bounds: their rows must come back zero.
2. Rate: every CTA gathers `reps` 64-row tiles (73.7 KB each, two in flight) from a 4096-row pool that stays in
   L2; GB/s over all CTAs and per SM. For reference, the fused forward at the headline shape consumes ~43 GB/s
   per SM (144 KB per 3.4 us pair); a cluster pair would issue half of it per CTA.
Kernel: RuntimeProbeSpec(feature="tma_rows") (dsagen/templates/testing/runtime_probe.py.j2); test-only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsagen.runtime import get_kernel
from dsagen.spec.families.indices import RuntimeProbeSpec

BN, D = 64, 576


def expected_images(kv: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(address-swizzled, unswizzled) shared-memory images (n_ctas, BN * D) of every CTA's tile of rows ids."""
    n_kv = kv.shape[0]
    ok = (ids >= 0) & (ids < n_kv)
    rows = torch.where(ok.unsqueeze(-1), kv[ids.clamp(0, n_kv - 1).long()], torch.zeros((), dtype=kv.dtype,
                                                                                          device=kv.device))
    # rows (n, BN, D) -> chunks (n, r, kb, c, 8): column kb * 64 + c * 8 + e
    chunks = rows.view(ids.shape[0], BN, D // 64, 8, 8)
    r = torch.arange(BN, device=kv.device).view(BN, 1, 1)
    c = torch.arange(8, device=kv.device).view(1, 1, 8)
    kb = torch.arange(D // 64, device=kv.device).view(1, D // 64, 1)
    images = []
    for swizzled in (True, False):
        pos = kb * (BN * 64) + r * 64 + ((c ^ (r % 8)) if swizzled else c) * 8          # element offsets
        img = torch.empty((ids.shape[0], BN * D), dtype=kv.dtype, device=kv.device)
        idx = (pos.unsqueeze(-1) + torch.arange(8, device=kv.device)).reshape(-1)
        img[:, idx] = chunks.reshape(ids.shape[0], -1)
        images.append(img)
    return images[0], images[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, default=0, help="CTAs (default: one per SM)")
    ap.add_argument("--reps", type=int, default=512, help="tiles per CTA in the timed launch")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_ctas = args.ctas or torch.cuda.get_device_properties(dev).multi_processor_count
    n_kv = 4096
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((n_kv, D), generator=gen).bfloat16().to(dev)
    ids = torch.randint(0, n_kv, (n_ctas, BN), generator=gen, dtype=torch.int32)
    ids[0, 3], ids[0, 40], ids[1, 7] = -1, n_kv + 5, 2**31 - 1                   # out of bounds: zero rows
    ids = ids.to(dev)
    k = get_kernel(RuntimeProbeSpec(arch="sm_90a", feature="tma_rows"), dev)
    out = torch.full((n_ctas, BN * D), float("nan"), dtype=torch.bfloat16, device=dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "ctas": n_ctas, "n_kv": n_kv}
    try:
        k.launch(kv, ids, out, 1, n_ctas)
        torch.cuda.synchronize()
    except Exception as e:                                                          # a fault ends the probe
        res["layout"] = f"launch failed: {e}"
        print(res)
        return
    sw, plain = expected_images(kv, ids)
    res["mismatch_vs_swizzled"] = int((out != sw).sum())
    res["mismatch_vs_unswizzled"] = int((out != plain).sum())
    res["layout"] = ("address-swizzled (the wgmma SW128 image)" if res["mismatch_vs_swizzled"] == 0 else
                     "unswizzled (box-relative)" if res["mismatch_vs_unswizzled"] == 0 else "neither")
    for reps in (args.reps // 4, args.reps):
        k.launch(kv, ids, out, reps, n_ctas)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            k.launch(kv, ids, out, reps, n_ctas)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ms = sorted(times)[2]
        nbytes = n_ctas * reps * BN * D * 2
        res[f"reps{reps}_ms"] = ms
        res[f"reps{reps}_GBps"] = nbytes / ms / 1e6
        res[f"reps{reps}_GBps_per_sm"] = nbytes / ms / 1e6 / n_ctas
        res[f"reps{reps}_us_per_tile"] = ms * 1e3 / reps
    for key, v in res.items():
        print(f"{key:28} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
