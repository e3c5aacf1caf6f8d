"""Helpers shared by the GPU benchmarks in this folder (imported as `common`: the folder is on sys.path both
for `python bench/<name>.py` and for `dsagen bench <name>`)."""

from __future__ import annotations

import json
import random
import statistics
from typing import Callable

import torch


def cudnn_namespace(name: str, wrapper: str | None = None, rows: str = "dsagen rows only"):
    """cuDNN frontend's `name` namespace (cudnn.DSA, cudnn.NSA: same-process peers), or None with a note printed when
    it cannot be imported (the peer is optional: the benchmark then times without it; `rows` says what remains).
    wrapper: one of its wrappers to touch now, which imports that op's module (and CuTe-DSL) before any timing."""
    try:
        import cudnn
        namespace = getattr(cudnn, name)
        if wrapper is not None:
            getattr(namespace, wrapper)
    except Exception as e:                       # noqa: BLE001 - the peer is optional
        print(f"# cuDNN frontend {name} not importable ({type(e).__name__}: {e}); {rows}")
        return None
    return namespace


def cudnn_dsa():
    """cuDNN frontend's DSA module (the same-process peer of the DSA benchmarks), or None with a note printed when it
    cannot be imported (the peer is optional: the benchmark then times dsagen alone)."""
    return cudnn_namespace("DSA")


def dsa_bench_start(no_cudnn: bool):
    """The start of a DSA benchmark beside cuDNN: exits without a CUDA GPU, prints the GPU and torch version, and
    returns cuDNN frontend's DSA module (cudnn_dsa) or None with --no-cudnn (`no_cudnn`) or where it is missing."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dsa = None if no_cudnn else cudnn_dsa()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    return dsa


def print_paired(label: str, fns: list[tuple[str, Callable[[], object]]], flops: float, rounds: int) -> list[float]:
    """Time the (name, fn) contenders interleaved (paired_time_ms) and print one line: `label: name ms (TFLOP/s)
    ...`, and with a second contender (the peer) the first's speedup over it. Returns the milliseconds."""
    ms = paired_time_ms([f for _, f in fns], rounds=rounds)
    line = "  ".join(f"{n} {m:.3f} ms ({flops / (m * 1e9):.0f} TFLOP/s)" for (n, _), m in zip(fns, ms))
    ratio = f"  {fns[0][0]} vs {fns[1][0]} {ms[1] / ms[0]:.2f}x" if len(ms) > 1 else ""
    print(f"{label}: {line}{ratio}", flush=True)
    return ms


def cuda_time_ms(fn: Callable[[], object], calls: int = 1, rounds: int = 5, queued: bool = False) -> float:
    """Milliseconds per call of `fn` on the current CUDA stream: one warm-up call, then `rounds` rounds of
    `calls` back-to-back calls between two CUDA events; the median over rounds of each round's mean.

    queued=True puts a ~20 ms spin kernel on the stream ahead of each round's first event, so the round starts on a
    busy GPU with every launch already queued (the op's GPU time as inside a model step); without it each round
    starts from an idle GPU right after a synchronize (an isolated call: host launch latency and the GPU's
    clock ramp-up count)."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(40_000_000)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call)


def paired_time_ms(fns: list[Callable[[], object]], calls: int = 1, rounds: int = 7) -> list[float]:
    """Milliseconds per call of each of `fns` on the current CUDA stream, interleaved: one warm-up call of each,
    then `rounds` rounds in which every fn in turn runs `calls` back-to-back calls between two CUDA events; per fn
    the median over rounds. Interleaving puts slow drifts of the GPU clock on every fn alike, so ratios between
    them are tighter than from separate cuda_time_ms runs. The order is shuffled every round (a fixed seed), so
    that each fn follows different ones: under the power cap (an H200 runs these kernels at 1.3-1.9 GHz, SW power
    cap) the fn that follows a lighter one starts at a higher clock, by 4% for the sparse MLA backward (16.48
    against 15.80 ms for the same kernel, 2026-12-01), which a fixed or rotated order puts on one fn every round."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    per_call: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for i in order:
            fn = fns[i]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_call[i].append(start.elapsed_time(end) / calls)
    return [statistics.median(t) for t in per_call]


def op_and_variants_ms(runs: list[tuple[str, Callable[[], torch.Tensor]]], calls: int, reference=None,
                       exact: bool = True) -> list[tuple[str, float, str]]:
    """Time an op beside other configs of it. `runs`: (name, fn) pairs, the op's first. Every other run's output is
    checked against the op's first: bitwise (`exact`; an AssertionError names the run) or, with exact=False, its
    largest difference relative to the op's largest value is printed. Then all runs are timed interleaved
    (paired_time_ms, `calls` calls per round, 7 rounds). `reference`: None, or a fn timed alone (cuda_time_ms, 3
    rounds) for the op's speedup. Returns (name, ms per call, "ref ms  speedup" for the op's row, else "-  -")."""
    want = runs[0][1]()
    for name, fn in runs[1:]:
        got = fn()
        if exact:
            assert torch.equal(got, want), name
        else:
            err = (got - want).abs().max().item() / want.abs().max().item()
            print(f"# {name}: max |out - op's| / max |op's| = {err:.1e}")
    times = paired_time_ms([fn for _, fn in runs], calls=calls, rounds=7)
    out = []
    for i, ((name, _), ms) in enumerate(zip(runs, times)):
        ref = "-        -"
        if i == 0 and reference is not None:
            rms = cuda_time_ms(reference, rounds=3)
            ref = f"{rms:8.2f} {rms / ms:6.1f}"
        out.append((name, ms, ref))
    return out


def report(meta: dict, rows: dict[str, float], json_path: str | None, fmt: str = "8.2f") -> None:
    """Print `meta`, then one `name  value` line per entry of `rows` (names padded to the longest); write
    {"meta": meta, "results": rows} to `json_path` when given."""
    width = max((len(n) for n in rows), default=0)
    print(meta)
    for name, v in rows.items():
        print(f"  {name:<{width}}  {v:{fmt}}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


def distinct_ids(s_q: int, topk: int, n_kv: int, gen: torch.Generator) -> torch.Tensor:
    """(s_q, topk) int32 top-k ids, distinct within each row when n_kv is a power of two (>= topk): row r walks
    start_r + j * stride_r mod n_kv with an odd stride, a cycle through all n_kv ids. `gen`: a CPU generator."""
    start = torch.randint(0, n_kv, (s_q, 1), generator=gen, dtype=torch.int64)
    stride = torch.randint(0, n_kv // 2, (s_q, 1), generator=gen, dtype=torch.int64) * 2 + 1  # odd: a cycle
    return ((start + torch.arange(topk).view(1, -1) * stride) % n_kv).to(torch.int32)


def graphed(fn, reps: int):
    """fn run `reps` times inside a CUDA graph; returns a callable that replays it (one call = reps calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph.replay
