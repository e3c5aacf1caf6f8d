"""Minimal kernels that reproduce, correct by construction, the synchronisation patterns of the fused kernels that a
compute-sanitizer tool reports on (notes/kernels/sparse_attention.md, "Sanitizers"). They are built on a CPU machine
with CuTe-DSL (no dsagen spec: the module source is here) and run on the GPU machine without it:

    python tests/gpu/sanitizer_probes.py DIR          # CPU, with CuTe-DSL: DIR/<probe>.cubin + DIR/<probe>.json
    SANITIZER_PROBES=DIR pytest -m gpu tests/gpu/test_sanitize.py -k probe     # GPU (scripts/sanitize.sh)

Probe "handoff" (split_halves' max exchange): warpgroup A (threads 0..127) and B (128..255) run ITERS rounds of
    A: X[t] = f(round); bar.arrive 1;              B: bar.sync 1; x = X[t]; Y[t] = g(x); bar.arrive 2;
       bar.sync 2; y = Y[t]; bar.arrive 3;            bar.sync 3; bar.arrive 4
       bar.sync 4
(bars 3 / 4 stand for the P-tile hand-over of the real kernel). Each value is read only after the barrier that its
writer arrived on after writing it (arrive has release, sync acquire semantics for the CTA), and no barrier
generation can mix rounds: round r + 1's writes follow a sync that needs the reader's arrive after its round-r read
(X: B's arrive 2 of round r precedes A's sync 2, after which A writes X of round r + 1 only after bar.sync 4 of
round r; Y: B writes Y of round r + 1 after bar.sync 1 of round r + 1, which needs A's arrive 1 of round r + 1,
after A's read of round r). out[t] = the sum of what A read, checked exactly on the host.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ITERS = 8
PROBES = ("handoff",)

HANDOFF_SOURCE = '''
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

SYMBOL = "dsagen_probe_handoff"
THREADS = 256
ITERS = %d


@cute.struct
class Smem:
    x: cute.struct.MemRange[Float32, 128]
    y: cute.struct.MemRange[Float32, 128]


PARAMS = [{"name": "out", "kind": "ptr", "dtype": "float32", "align": 4}]
LAUNCH = {"grid": [1, 1, 1], "block": [THREADS, 1, 1], "cluster": [1, 1, 1], "smem": Smem.size_in_bytes()}


@cute.kernel
def kernel(p_out: cute.Pointer):
    tidx, _, _ = cute.arch.thread_idx()
    st = cutlass.memory.SmemAllocator().allocate(Smem)
    sx = st.x.get_tensor(cute.make_layout(128))
    sy = st.y.get_tensor(cute.make_layout(128))
    if tidx < 128:
        acc = Float32(0.0)
        for r in cutlass.range(ITERS, unroll=1):
            sx[tidx] = Float32(tidx + 1000 * r)
            cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)
            cute.arch.barrier(barrier_id=2, number_of_threads=256)
            acc = acc + sy[tidx]
            cute.arch.barrier_arrive(barrier_id=3, number_of_threads=256)
            cute.arch.barrier(barrier_id=4, number_of_threads=256)
        (p_out + tidx).store(acc)
    else:
        t = tidx - 128
        for r in cutlass.range(ITERS, unroll=1):
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            sy[t] = sx[t] * Float32(2.0) + Float32(1.0)
            cute.arch.barrier_arrive(barrier_id=2, number_of_threads=256)
            cute.arch.barrier(barrier_id=3, number_of_threads=256)
            cute.arch.barrier_arrive(barrier_id=4, number_of_threads=256)


@cute.jit
def host(p_out: cute.Pointer):
    kernel(p_out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), smem=Smem.size_in_bytes())


kernel.set_name_prefix(SYMBOL, remove_cutlass_symbol=True, keep_mangled_name=False)
''' % ITERS


def handoff_expected() -> list[float]:
    """out[t] of probe "handoff": sum over rounds of 2 (t + 1000 r) + 1."""
    return [float(sum(2 * (t + 1000 * r) + 1 for r in range(ITERS))) for t in range(128)]


def build(outdir: str) -> None:
    """Compile every probe (CPU, CuTe-DSL) into outdir/<probe>.cubin and outdir/<probe>.json (the kernel record)."""
    import tempfile

    from dsagen.jit.build import compile_module
    from dsagen.spec import RuntimeProbeSpec

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    carrier = RuntimeProbeSpec(arch="sm_90a", feature="cluster")   # arch and messages only; the source is ours
    for name, source in (("handoff", HANDOFF_SOURCE),):
        with tempfile.TemporaryDirectory() as tmp:
            ck = compile_module(carrier, source, Path(tmp))
        (out / f"{name}.cubin").write_bytes(ck.cubin)
        (out / f"{name}.json").write_text(json.dumps(ck.record, indent=1))
        print(f"{name}: {len(ck.cubin)} bytes, {ck.record['regcount']} registers")


def load(name: str, device_index: int = 0):
    """The probe `name` as a dsagen LoadedKernel, from $SANITIZER_PROBES (None when unset or not built)."""
    d = os.environ.get("SANITIZER_PROBES")
    if not d or not (Path(d) / f"{name}.cubin").exists():
        return None
    from dsagen.runtime.kernel import LoadedKernel

    record = json.loads((Path(d) / f"{name}.json").read_text())
    return LoadedKernel(f"probe_{name}", record, (Path(d) / f"{name}.cubin").read_bytes(), "sm_90a", device_index,
                        "sm_90a")


# ---- racecheck verdict -------------------------------------------------------------------------------------------
#: Shared-memory window (bytes, as racecheck prints addresses: after the 1 KiB the driver reserves) of split_halves'
#: sMax[:, 1], the pair max consumer B hands to consumer A over bar.arrive / bar.sync BAR_MAX_B. The fields before it
#: have fixed sizes at every H / D (Smem of sparse_mla/fwd_sm90.py: 8 + 3 mbarriers, valid[2 * 64], sMax[:, 0] = 64
#: floats): 0x400 + 64 + 24 + 128 + 256 = 0x5d8 (test_sanitize.py::test_split_halves_smem_prefix checks the field list).
SPLIT_HALVES_PAIR_MAX = (0x5D8, 0x6D8)
#: the probe's Y[128] (after X[128])
PROBE_HANDOFF_Y = (0x600, 0x800)
#: (kernel-name part, hazard kind, writer threads, reader threads, smem window): the one pattern racecheck misreports
#: (notes/kernels/sparse_attention.md, "Sanitizers"), in the kernel and in the probe that reproduces it
EXPLAINED = [("dsagen_sparse_attention_fwd", "RAW", (256, 384), (128, 256), SPLIT_HALVES_PAIR_MAX),
             ("dsagen_probe_handoff", "RAW", (128, 256), (0, 128), PROBE_HANDOFF_Y)]


def racecheck_verdict(log_text: str) -> tuple[dict, list[str]]:
    """Classify the hazards of a `--racecheck-report hazard --show-backtrace no` log: counts per explained pattern
    and the lines of every other hazard (each must be fixed or explained)."""
    import re

    head = re.compile(r"(RAW|WAR|WAW) hazard detected at __shared__ (0x[0-9a-f]+) in block")
    acc = re.compile(r"(Read|Write) Thread \((\d+),\d+,\d+\) at (\S+)")
    counts = {name: 0 for name, *_ in EXPLAINED}
    other: list[str] = []
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        m = head.search(line)
        if not m:
            continue
        # a cluster's CTA of rank r prints its shared::cluster address, r * 0x1000000 + the CTA's own offset
        kind, addr = m.group(1), int(m.group(2), 16) & 0xFFFFFF
        who = {}
        for nxt in lines[i + 1:i + 3]:
            a = acc.search(nxt)
            if a:
                who[a.group(1)] = (int(a.group(2)), a.group(3))
        for name, k, wr, rd, (lo, hi) in EXPLAINED:
            if (k == kind and "Write" in who and "Read" in who and name in who["Write"][1]
                    and wr[0] <= who["Write"][0] < wr[1] and rd[0] <= who["Read"][0] < rd[1] and lo <= addr < hi):
                counts[name] += 1
                break
        else:
            other.append(" | ".join(x.strip() for x in lines[i:i + 3]))
    return counts, other


def check_racecheck(path: str) -> int:
    """Print the verdict of a racecheck log; exit status 1 on any unexplained hazard or a truncated report."""
    text = Path(path).read_text(errors="replace")
    counts, other = racecheck_verdict(text)
    for name, n in counts.items():
        print(f"explained ({name}): {n} hazards")
    print(f"unexplained: {len(other)} hazards")
    for line in other[:20]:
        print("  " + line)
    truncated = "were not printed" in text
    if truncated:
        print("the report was truncated (raise --print-limit): hazards beyond it were not classified")
    return 1 if other or truncated else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "check-racecheck":
        sys.exit(check_racecheck(sys.argv[2]))
    build(sys.argv[1] if len(sys.argv) > 1 else ".dsagen-cache-san/probes")
