"""The Python part of each fused op's host path, measured without a GPU (CPU tensors, stand-in kernels).

    DSAGEN_CACHE_PATH=<a built cache> python bench/host_path_cpu.py [--calls N] [--json FILE]

bench/overhead.py times a tiny call of every fused op on the GPU's host, driver launch included. This script times
the same calls (the tiny shapes of bench/overhead.py, plus the batched sparse_attention layout) on any machine: the
ops run on CPU tensors with every kernel replaced by a stand-in whose launcher is the real generated one (built from
the cached kernel's manifest record: grid, alignment checks, the parameter packs, the tensor-map writes) minus the
driver call, and with the device queries (SM count, arch) answered as an H200's. What it measures is therefore the
Python and torch-CPU work of a call: checks or the fast path's signature, launch plans, views, CPU allocations, the
launcher. It does not include the driver's launch (4-6 us per launch on the H200's host, `bench/overhead.py`'s raw
cuLaunchKernel row) nor the CUDA caching allocator's part of each allocation. Use it to compare two versions of the
host code on one machine; the GPU host's figures come from bench/overhead.py.

The cache needs the kernels of the tiny calls (`dsagen build --preset deepseek-v3.2` has them); nothing is compiled
(DSAGEN_DISABLE_JIT is set). Each figure: median of 7 rounds of N calls, us per call, after 50 warm-up calls (the
first passes the full path, so ops with a fast path are timed on it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import threading
import timeit

os.environ["DSAGEN_DISABLE_JIT"] = "1"

import torch  # noqa: E402

import dsagen  # noqa: E402
from dsagen.jit.resolver import resolve  # noqa: E402
from dsagen.ops import _fused  # noqa: E402
from dsagen.runtime import kernel as runtime_kernel  # noqa: E402
from dsagen.runtime import tensormap  # noqa: E402


class _Driver:
    """The driver calls a generated launcher makes, answered without a GPU."""

    class CUresult:
        CUDA_SUCCESS = 0

    @staticmethod
    def cuLaunchKernel(*args):
        return (0,)

    cuLaunchKernelEx = cuLaunchKernel


class _StandInEncoder(tensormap.TensorMapEncoder):
    """A tensor-map param's encoder whose encoding (a driver call) is 128 zero bytes; its cache and the launcher's
    write path are the real ones."""

    def __init__(self, name: str, recipe: dict):
        self.name, self.dtype = name, tensormap._TORCH_DTYPES[recipe["dtype"]]
        self.box = [int(b) for b in recipe["box"]]
        self.rank, self.cache, self._written = len(self.box), {}, None

    def _encode(self, t: torch.Tensor, key: tuple) -> bytes:
        if t.dtype != self.dtype or t.dim() != self.rank:
            raise ValueError(f"tensormap param {self.name}: expected a {self.rank}-D {self.dtype} tensor")
        return self.cache.setdefault(key, bytes(128))


class StandInKernel(runtime_kernel.LoadedKernel):
    """The cached kernel of `spec` with its generated launcher and no cubin loaded."""

    def __init__(self, spec):
        entry = resolve(spec)
        self.name, self.record, self.device_index = spec.name(), entry.manifest["kernel"], 0
        self.params, self.function = self.record["params"], 0
        launch = self.record["launch"]
        self.block = tuple(int(b) for b in launch["block"])
        self.cluster = tuple(int(c) for c in launch.get("cluster", (1, 1, 1)))
        self.smem, self._lock = int(launch.get("smem", 0)), threading.Lock()
        self._build_launcher()


_kernels: dict = {}


def _get_kernel(spec, device=None):
    k = _kernels.get(spec)
    if k is None:
        k = _kernels[spec] = StandInKernel(spec)
    return k


_impls: dict = {}


def _fused_impl(op: str, device) -> object:
    fn = _impls.get(op)
    if fn is None:
        mod, name = _fused.FUSED[op].split(":")
        fn = _impls[op] = getattr(importlib.import_module(mod), name)
    return fn


def stand_in() -> None:
    """Every dsagen module's kernel loader, device queries and fused-op lookup answered for CPU tensors as on an
    H200 (132 SMs, sm_90a, tensors taken for CUDA ones), the launchers' driver calls and tensor-map encodings by
    stand-ins."""
    runtime_kernel.cu = lambda: _Driver
    runtime_kernel.current_stream_handle = lambda index: 0
    runtime_kernel.TensorMapEncoder = _StandInEncoder
    for m in pkgutil.walk_packages(dsagen.__path__, "dsagen."):
        try:
            importlib.import_module(m.name)
        except Exception:                    # noqa: BLE001 - a module this machine cannot import is not timed
            pass
    from dsagen.kernels.lightning_indexer import host as li_host
    from torch._subclasses.fake_tensor import FakeTensor

    real_eager = li_host.eager

    def eager(t: torch.Tensor) -> bool:      # the hosts' "real tensor outside tracing" test, without the CUDA one
        return not torch.compiler.is_compiling() and not isinstance(t, FakeTensor)

    answers = {"get_kernel": _get_kernel, "device_sm_count": lambda index: 132, "device_index": lambda d=None: 0,
               "device_arch": lambda d=None: "sm_90a", "fused_impl": _fused_impl}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dsagen."):
            continue
        for attr, value in answers.items():
            if hasattr(mod, attr):
                setattr(mod, attr, value)
        if getattr(mod, "eager", None) is real_eager:
            mod.eager = eager
    sys.modules["dsagen.ops.sparse_attention"]._on_cuda = lambda t: True
    torch.cuda.is_current_stream_capturing = lambda: False


def calls() -> dict:
    """The timed calls: bench/overhead.py's tiny shapes on CPU tensors."""
    g = torch.Generator().manual_seed(0)
    one = torch.ones(1)
    ids = torch.randint(-1, 100, (1, 4, 8), dtype=torch.int32, generator=g)
    aq, akv = torch.randn((1, 128, 576), generator=g).bfloat16(), torch.randn((128, 576), generator=g).bfloat16()
    aids, asink = torch.randperm(128, generator=g)[:64].view(1, 64).int(), torch.randn(128, generator=g)
    baq, bakv, baids = aq[None], akv[None], aids[None]
    iq = torch.randn((1, 128, 64, 128), generator=g).bfloat16()
    ik, iw = torch.randn((1, 128, 128), generator=g).bfloat16(), torch.randn((1, 128, 64), generator=g).bfloat16()
    iq8, ik8 = iq.to(torch.float8_e4m3fn), ik.to(torch.float8_e4m3fn)
    iqs, iks, iout = torch.ones((1, 128, 64)), torch.ones((1, 128)), torch.empty((1, 128, 128))
    return {
        "torch.add(out=) on 1 element (CPU)": lambda: torch.add(one, 1, out=one),
        "torch.empty((4, 8), int32) (CPU)": lambda: torch.empty((4, 8), dtype=torch.int32),
        "dsagen.local_to_global": lambda: dsagen.local_to_global(ids, 100),
        "dsagen.compactify": lambda: dsagen.compactify(ids[0]),
        "dsagen.sparse_attention, flat (1 row, H128, top-k 64)":
            lambda: dsagen.sparse_attention(aq, akv, aids, attn_sink=asink),
        "dsagen.sparse_attention, batched [1, 1, 128, 576]":
            lambda: dsagen.sparse_attention(baq, bakv, baids, attn_sink=asink),
        "dsagen.lightning_indexer(causal=True)": lambda: dsagen.lightning_indexer(iq, ik, iw, 64, causal=True),
        "dsagen.indexer_scores (allocates out)": lambda: dsagen.indexer_scores(iq, ik, iw),
        "dsagen.indexer_scores(out=)": lambda: dsagen.indexer_scores(iq, ik, iw, out=iout),
        "dsagen.indexer_scores(precision='fp8', out=)":
            lambda: dsagen.indexer_scores(iq8, ik8, iw, precision="fp8", q_scale=iqs, k_scale=iks, out=iout),
        "dsagen.indexer_forward_topk (4 outputs)": lambda: dsagen.indexer_forward_topk(iq, ik, iw, 64),
    }


def per_call_us(fn, n: int, rounds: int = 7) -> float:
    for _ in range(50):
        fn()
    return sorted(timeit.repeat(fn, number=n, repeat=rounds))[rounds // 2] / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    stand_in()
    results = {}
    for name, fn in calls().items():
        results[name] = round(per_call_us(fn, args.calls), 2)
        print(f"{results[name]:8.2f}  {name}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "python": sys.version.split()[0], "us_per_call": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
