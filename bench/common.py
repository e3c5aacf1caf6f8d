"""Helpers shared by the GPU benchmarks in this folder (imported as `common`: the folder is on sys.path both
for `python bench/<name>.py` and for `dsagen bench <name>`)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], calls: int = 1, rounds: int = 5) -> float:
    """Milliseconds per call of `fn` on the current CUDA stream: one warm-up call, then `rounds` rounds of
    `calls` back-to-back calls between two CUDA events; the median over rounds of each round's mean."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call)
