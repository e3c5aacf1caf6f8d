"""Energy per call of the fused sparse MLA forward (and of FlashMLA's SM90 sparse prefill on the same inputs), read
from the GPU's energy counter (NVML).

    python bench/energy.py [--cases 0] [--seconds 2] [--rounds 3] [--flashmla DIR] [--json FILE]

Why: an H200 runs this kernel at its power cap (nvidia-smi: "SW power cap", 1.3-1.9 GHz at ~690 W), so a call's
time follows its energy: a change that saves bytes or instructions gains time through the clock even where it is
not on the critical path. This script measures the energy per call and the clock it ran at.

Method: per variant, back-to-back calls for `--seconds` (long enough for the power controller to settle and for
the counter's ~10-100 ms update period to matter little), the NVML total-energy counter (mJ) and CUDA events read
around them; the SM clock sampled every 5 ms by a thread. Variants run interleaved, their order rotating each
round (as common.paired_time_ms), `--rounds` rounds; per variant the median over rounds of J per call, W, ms per
call and MHz. An idle segment (sleep) of the same length gives the board's idle power.

Variants:
  default    the op's kernel (dsagen.sparse_attention, impl="fused")
  flashmla   FlashMLA's SM90 sparse prefill (with --flashmla DIR; built from its source, not part of dsagen)
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from sparse_attention import case_inputs, load_flashmla

import dsagen

CASES = [("prefill", 4096, 128, 576, 32768, 2048), ("prefill", 4096, 64, 512, 32768, 2048),
         ("prefill", 4096, 128, 576, 4096, 2048),     # 2: a KV pool of 4.7 MB (stays in L2: no KV DRAM traffic)
         ("prefill", 4096, 128, 576, 131072, 2048)]


class Nvml:
    """The few NVML calls this probe needs, through NVIDIA's maintained bindings (nvidia-ml-py, the `bench` extra:
    pip install -e '.[bench]'; libnvidia-ml ships with the driver). The device is torch's current one, found by its
    PCI bus id when there are several."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise SystemExit("bench/energy.py reads NVML through nvidia-ml-py: pip install -e '.[bench]'") from None
        self.nvml = pynvml
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 1:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        else:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            bus_id = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)

    def energy_mj(self) -> int:
        """The board's energy counter (mJ since the driver loaded)."""
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def sm_mhz(self) -> int:
        """The SM clock now (MHz)."""
        return self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)


class ClockSampler:
    """Samples the SM clock every `period` seconds on a thread while active (mean of the samples)."""

    def __init__(self, nvml: Nvml, period: float = 0.005) -> None:
        self.nvml, self.period, self.samples, self._stop = nvml, period, [], threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.nvml.sm_mhz())
            time.sleep(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")


def segment(nvml: Nvml, fn, calls: int) -> dict:
    """`calls` back-to-back calls of `fn` (fn None: an idle sleep of `calls` ms): J per call, W, ms per call, MHz."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ClockSampler(nvml) as clock:
        e0, t0 = nvml.energy_mj(), time.perf_counter()
        start.record()
        if fn is None:
            time.sleep(calls / 1000)
        else:
            for _ in range(calls):
                fn()
        end.record()
        end.synchronize()
        e1, t1 = nvml.energy_mj(), time.perf_counter()
    joules, wall = (e1 - e0) / 1000, t1 - t0
    n = calls if fn is not None else 1
    return {"j_per_call": joules / n, "watts": joules / wall, "ms_per_call": start.elapsed_time(end) / n,
            "mhz": clock.mean()}


def measure(nvml: Nvml, fns: dict, seconds: float, rounds: int) -> dict:
    """Interleaved rotating rounds of `segment` per fn (sized to ~`seconds` each); medians per fn."""
    calls = {}
    for name, fn in fns.items():
        if fn is None:
            calls[name] = int(seconds * 1000)
            continue
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        calls[name] = max(10, int(seconds / ((time.perf_counter() - t) / 5)))
        segment(nvml, fn, calls[name] // 4)                   # warm: the clock settles under the cap
    names = list(fns)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(rounds):
        for name in [names[(rnd + j) % len(names)] for j in range(len(names))]:
            got[name].append(segment(nvml, fns[name], calls[name]))
    return {n: {k: statistics.median(s[k] for s in got[n]) for k in got[n][0]} for n in names}


def variant_fns(q, kv, ids, sink, flashmla) -> dict:
    """One call of each variant on the given inputs: the op's kernel, and FlashMLA's when `flashmla` is given."""
    fns = {"default": lambda: dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")}
    if flashmla is not None:
        fns["flashmla"] = lambda: flashmla.sparse_prefill_fwd(q, kv, ids, q.shape[-1] ** -0.5, attn_sink=sink)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="0", help="comma list of indices into CASES (0: H128 / D576, 1: H64 / D512, 2 / 3: case 0 "
                    "with a 4096 / 131072-row KV pool)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flashmla", metavar="DIR", help="also the FlashMLA peer built in DIR")
    ap.add_argument("--json")
    args = ap.parse_args()
    flashmla = load_flashmla(args.flashmla) if args.flashmla else None
    nvml = Nvml()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "rounds": args.rounds}
    results = []
    print(meta)
    for idx in [int(i) for i in args.cases.split(",")]:
        name, s_q, h, d_qk, n_kv, topk = CASES[idx]
        q, kv, ids, sink = case_inputs(s_q, h, d_qk, n_kv, topk)
        flops = 2.0 * s_q * h * topk * (d_qk + 512)
        fns = {"idle": None, **variant_fns(q, kv, ids, sink, flashmla)}
        got = measure(nvml, fns, args.seconds, args.rounds)
        case = f"{name} S_q {s_q} H{h} D{d_qk} KV {n_kv} topk {topk}"
        print(f"\n# {case}\n{'variant':<10} {'J/call':>8} {'W':>6} {'ms':>7} {'MHz':>6} {'TFLOP/s':>8} "
              f"{'TFLOP/J':>8}")
        for v, r in got.items():
            tfl = flops / r["ms_per_call"] / 1e9 if v != "idle" else float("nan")
            per_j = flops / r["j_per_call"] / 1e12 if v != "idle" else float("nan")
            print(f"{v:<10} {r['j_per_call']:8.3f} {r['watts']:6.0f} {r['ms_per_call']:7.3f} {r['mhz']:6.0f} "
                  f"{tfl:8.1f} {per_j:8.2f}")
            results.append({"case": case, "variant": v, **r})
        del q, kv, ids
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
