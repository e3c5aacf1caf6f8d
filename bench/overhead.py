"""Host overhead per call on a cache hit, and time to first launch in a fresh process (GPU).

    python bench/overhead.py [--calls N] [--json FILE] [--sparse-breakdown [--profile FILE]]

Compares, in one process: a near-empty torch op, the raw cuLaunchKernel of a prepacked kernel, the
generated launcher (LoadedKernel.launch), and the public ops dsagen.local_to_global / compactify
(validation + output allocation + launch), dsagen.sparse_attention and the indexer ops (lightning_indexer,
indexer_scores bf16 / fp8, indexer_forward_topk) on a tiny call. Each figure: host enqueue microseconds per call, the median
of 5 rounds of N calls; the warm-up calls pass the full path once, so the ops with a fast path (dsagen.ops._fast_path)
are timed on it. Then spawns fresh processes that import dsagen and make the first fused call
(cache hit) and reports the time to first launch. Writes the numbers as JSON with --json.

--sparse-breakdown instead splits the host time of that tiny dsagen.sparse_attention call into its parts (the public
op, the flat fused entry without the public validation, the launch helper, the launch-plan lookup, the 3 output
allocations, the kernel launch alone), each measured alone in the same process; --profile FILE also writes the
cProfile statistics of N calls of the public op (sorted by own time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from common import report


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(res)


FIRST_LAUNCH = r"""
import time, sys
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
import dsagen
ids = torch.tensor([[[1, -1, 3]]], dtype=torch.int32, device="cuda")
out = dsagen.local_to_global(ids, 4, impl="fused"); torch.cuda.synchronize()
t2 = time.perf_counter()
assert out.tolist() == [[[1, -1, 3]]]
print(f"{(t1 - t0) * 1e3:.1f} {(t2 - t1) * 1e3:.1f}")
"""


def sparse_breakdown(calls: int, json_path: str | None, profile: str | None) -> None:
    """The host time of a tiny dsagen.sparse_attention call, part by part (us per call, see the module doc)."""
    import dsagen
    import dsagen.kernels.sparse_mla.host as fsa

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((1, 128, 576), generator=gen).bfloat16().to(dev)
    kv = torch.randn((128, 576), generator=gen).bfloat16().to(dev)
    ids = torch.randperm(128, generator=gen)[:64].view(1, 64).int().to(dev)
    sink = torch.randn(128, generator=gen).to(dev)
    scale = 576 ** -0.5
    spec, kernel, n_ctas = fsa._launch_plan(128, 576, q.dtype, q.device, 1, True)
    out = torch.empty((1, 128, 512), dtype=q.dtype, device=dev)
    lse = torch.empty((1, 128), dtype=torch.float32, device=dev)
    mx = torch.empty((1, 128), dtype=torch.float32, device=dev)
    rows = {
        "dsagen.sparse_attention (public op: validation + flat entry)":
            lambda: dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused"),
        "fused_sa.sparse_attention (flat entry: supported_reason + _launch)":
            lambda: fsa.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=None, softmax_scale=scale, d_v=512),
        "fused_sa._launch (plan lookup, layout checks, 3 allocations, launch)":
            lambda: fsa._launch(q, kv, ids, sink, None, scale, 512),
        "fused_sa._launch_plan (the cached lookup)":
            lambda: fsa._launch_plan(128, 576, q.dtype, q.device, 1, True),
        "3 x torch.empty (out, lse, max_logits)": lambda: (
            torch.empty((1, 128, 512), dtype=q.dtype, device=dev), torch.empty((1, 128), dtype=torch.float32, device=dev),
            torch.empty((1, 128), dtype=torch.float32, device=dev)),
        "kernel.launch (the generated launcher alone)": lambda: kernel.launch(
            q, kv, ids, ids, sink, out, lse, mx, 1, 128, 64, q.stride(0), kv.stride(0), ids.stride(0), scale, 0, 1,
            n_ctas),
    }
    results = {name: round(per_call_us(fn, calls), 2) for name, fn in rows.items()}
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")
        pr.disable()
        torch.cuda.synchronize()
        with open(profile, "w") as f:
            pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(40)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": sys.version.split()[0], "calls": calls}
    report(meta, results, json_path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json")
    ap.add_argument("--sparse-breakdown", action="store_true",
                    help="split the tiny sparse_attention call's host time into its parts (and nothing else)")
    ap.add_argument("--profile", metavar="FILE", help="with --sparse-breakdown: cProfile statistics into FILE")
    args = ap.parse_args()
    if args.sparse_breakdown:
        sparse_breakdown(args.calls, args.json, args.profile)
        return
    import dsagen
    from dsagen.jit import get_kernel
    from dsagen.spec import LocalToGlobalSpec
    from cuda.bindings import driver as cu

    dev = torch.device("cuda")
    a, b, c = (torch.ones(1, device=dev) for _ in range(3))
    ids = torch.randint(-1, 100, (1, 4, 8), dtype=torch.int32, device=dev)
    out = torch.empty_like(ids)
    ids2d = ids.view(4, 8)
    k = get_kernel(LocalToGlobalSpec(arch="sm_90a"), dev)
    k.launch(ids, out, 32, 1, 100)
    stream = torch.cuda.current_stream().cuda_stream
    kp = k._kparams
    import ctypes
    kp_addr = ctypes.addressof(kp)
    dsagen.local_to_global(ids, 100, impl="fused")
    dsagen.compactify(ids2d, impl="fused")
    # a tiny sparse-attention call (1 query row, H128, D576, top-k 64 of 128 rows): its GPU time is a few us, so the
    # host path (validation, the torch custom op, 3 output allocations, the launch) is what the loop measures
    gen = torch.Generator().manual_seed(0)
    aq = torch.randn((1, 128, 576), generator=gen).bfloat16().to(dev)
    akv = torch.randn((128, 576), generator=gen).bfloat16().to(dev)
    aids = torch.randperm(128, generator=gen)[:64].view(1, 64).int().to(dev)
    asink = torch.randn(128, generator=gen).to(dev)
    dsagen.sparse_attention(aq, akv, aids, attn_sink=asink, impl="fused")
    baq, bakv, baids = aq[None], akv[None], aids[None]                  # the batched layout, B = T = 1
    dsagen.sparse_attention(baq, bakv, baids, attn_sink=asink, impl="fused")
    # tiny indexer calls: 1 x 128 tokens, H 64, D 128, bf16 (FP8 for one row), top-k 64
    iq = torch.randn((1, 128, 64, 128), generator=gen).bfloat16().to(dev)
    ik = torch.randn((1, 128, 128), generator=gen).bfloat16().to(dev)
    iw = torch.randn((1, 128, 64), generator=gen).bfloat16().to(dev)
    iq8, ik8 = iq.to(torch.float8_e4m3fn), ik.to(torch.float8_e4m3fn)
    iqs, iks = torch.ones((1, 128, 64), device=dev), torch.ones((1, 128), device=dev)
    iout = torch.empty((1, 128, 128), device=dev)
    cu_stream = cu.CUstream(stream)
    libcuda = ctypes.CDLL("libcuda.so.1")
    raw = libcuda.cuLaunchKernel
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    f_int = int(k.function)
    rows = {
        "torch.add(out=) on 1 element (near-empty torch op)": lambda: torch.add(a, b, out=c),
        "torch.empty((4, 8), int32) (allocation only)": lambda: torch.empty((4, 8), dtype=torch.int32, device=dev),
        "raw cuLaunchKernel, prepacked, CUstream object": lambda: cu.cuLaunchKernel(
            k.function, 1, 1, 1, 256, 1, 1, 0, cu_stream, kp_addr, 0),
        "raw ctypes libcuda.cuLaunchKernel, prepacked": lambda: raw(f_int, 1, 1, 1, 256, 1, 1, 0, stream, kp_addr, None),
        "raw cuLaunchKernel, params prepacked (cuda.bindings)":
            lambda: cu.cuLaunchKernel(k.function, 1, 1, 1, 256, 1, 1, 0, stream, kp_addr, 0),
        "LoadedKernel.launch (generated launcher: pack + stream + launch)": lambda: k.launch(ids, out, 32, 1, 100),
        "dsagen.local_to_global(impl='fused') (validate + alloc + launch)":
            lambda: dsagen.local_to_global(ids, 100, impl="fused"),
        "dsagen.compactify(impl='fused') (validate + 2 allocs + launch)":
            lambda: dsagen.compactify(ids2d, impl="fused"),
        "dsagen.sparse_attention(impl='fused'), 1 row x H128 x top-k 64 (fast path: 3 allocs + launch)":
            lambda: dsagen.sparse_attention(aq, akv, aids, attn_sink=asink, impl="fused"),
        "dsagen.sparse_attention, batched [1, 1, 128, 576] (local_to_global + forward launches)":
            lambda: dsagen.sparse_attention(baq, bakv, baids, attn_sink=asink, impl="fused"),
        "dsagen.lightning_indexer(causal=True), 128 tokens x H64 x top-k 64 (score + top-k launches)":
            lambda: dsagen.lightning_indexer(iq, ik, iw, 64, causal=True),
        "dsagen.indexer_scores, 128 tokens x H64 (allocates out)": lambda: dsagen.indexer_scores(iq, ik, iw),
        "dsagen.indexer_scores(out=)": lambda: dsagen.indexer_scores(iq, ik, iw, out=iout),
        "dsagen.indexer_scores(precision='fp8', out=)":
            lambda: dsagen.indexer_scores(iq8, ik8, iw, precision="fp8", q_scale=iqs, k_scale=iks, out=iout),
        "dsagen.indexer_forward_topk, top-k 64 (score and top-k launches; 4 outputs)":
            lambda: dsagen.indexer_forward_topk(iq, ik, iw, 64),
    }
    results = {name: round(per_call_us(fn, args.calls), 2) for name, fn in rows.items()}
    # CUDA-graph replay: 100 op calls captured once; replay cost per captured call
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            dsagen.local_to_global(ids, 100, impl="fused")
    results["CUDA-graph replay, per captured local_to_global call"] = round(
        per_call_us(g.replay, max(args.calls // 100, 10)) / 100, 2)
    firsts = []
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", FIRST_LAUNCH], capture_output=True, text=True, env=dict(os.environ))
        if r.returncode != 0:
            raise SystemExit(f"first-launch subprocess failed:\n{r.stdout}\n{r.stderr}")
        torch_ms, dsagen_ms = map(float, r.stdout.split())
        firsts.append((torch_ms, dsagen_ms))
    results["fresh process: torch CUDA init, ms (median of 3)"] = statistics.median(f[0] for f in firsts)
    results["fresh process: import dsagen + first fused call (warm cache hit), ms (median of 3)"] = \
        statistics.median(f[1] for f in firsts)
    import cuda.bindings
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda_bindings": getattr(cuda.bindings, "__version__", "?"), "python": sys.version.split()[0],
            "calls": args.calls}
    report(meta, results, args.json)


if __name__ == "__main__":
    main()
