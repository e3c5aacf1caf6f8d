"""Cold JIT: time for a fresh process to render, cross-compile and commit one kernel into an empty
cache, then for another fresh process to find it (warm hit). CPU only (needs CuTe-DSL, no GPU).

    python bench/cold_jit.py [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import report

PROBE = r"""
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from dsagen.jit import resolve
from dsagen.spec import KernelSpec
spec = KernelSpec.from_canonical({"op": sys.argv[1], "fields": {"arch": "sm_90a"}})
e = resolve(spec)
t2 = time.perf_counter()
print(f"{(t1 - t0) * 1e3:.1f} {(t2 - t1) * 1e3:.1f} {e.manifest.get('compile_seconds', 0) * 1e3:.1f}")
"""


def run(op: str, cache: str, jit: bool) -> tuple[float, float, float]:
    env = dict(os.environ, DSAGEN_CACHE_DIR=cache, DSAGEN_DISABLE_JIT="0" if jit else "1")
    env.pop("DSAGEN_CACHE_PATH", None)
    r = subprocess.run([sys.executable, "-c", PROBE, op], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr)
    return tuple(map(float, r.stdout.split()[-3:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = {}
    for op in ("compactify", "local_to_global"):
        cold, warm = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(run(op, cache, jit=True))
                warm.append(run(op, cache, jit=False))
        results[op] = {
            "cold: import dsagen + render + compile + commit, ms": statistics.median(c[1] for c in cold),
            "cold: of which cute.compile, ms": statistics.median(c[2] for c in cold),
            "warm: import dsagen + cache hit (DSAGEN_DISABLE_JIT=1), ms": statistics.median(w[1] for w in warm),
        }
    meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    report(meta, {f"{op:16s} {name}": v for op, rows in results.items() for name, v in rows.items()}, args.json,
           fmt="8.1f")


if __name__ == "__main__":
    main()
