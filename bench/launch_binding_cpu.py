"""The Python cost of calling cuLaunchKernel through cuda.bindings against ctypes, measured without a GPU.

    python bench/launch_binding_cpu.py [--calls N]

A launch's host time has two parts: the binding's argument conversion in Python, and the driver's own work inside
libcuda. This script isolates the first: it compiles a stub libcuda.so.1 (gcc; every entry point returns
CUDA_SUCCESS at once, cuDriverGetVersion reports 13.0) into a temporary folder, re-runs itself with that folder
first on LD_LIBRARY_PATH, and times a prepacked cuLaunchKernel (11 arguments, as dsagen's generated launchers pass
them) through cuda.bindings.driver and through ctypes (argtypes declared), interleaved. What it cannot show is the
driver's part (bench/overhead.py's raw cuLaunchKernel row on a GPU host, where both bindings pay it alike).
Each figure: median of 7 rounds of N calls, us per call.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import timeit

STUB = r"""
#include <string.h>
static int stub(void) { return 0; }
static int driver_version(int *v) { *v = 13000; return 0; }
int cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
  if (status) *status = 0;
  *pfn = strcmp(sym, "cuDriverGetVersion") ? (void *)stub : (void *)driver_version;
  return 0;
}
int cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, 0);
}
int cuDriverGetVersion(int *v) { return driver_version(v); }
int cuInit(unsigned flags) { return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) { return 0; }
"""


def measure(calls: int) -> None:
    import cuda.bindings.driver as cu

    lib = ctypes.CDLL("libcuda.so.1")
    assert cu.cuDriverGetVersion()[1] == 13000, "the stub driver was not the one loaded"
    func = cu.CUfunction(0x1000)
    params = (ctypes.c_void_p * 32)()
    kp = ctypes.addressof(params)
    raw = lib.cuLaunchKernel
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    raw.restype = ctypes.c_int
    f_int, stream = int(func), 0x2000
    rows = {
        "cuda.bindings.driver.cuLaunchKernel (CUfunction, int stream, int params)":
            lambda: cu.cuLaunchKernel(func, 1, 1, 1, 256, 1, 1, 0, stream, kp, 0),
        "ctypes libcuda.cuLaunchKernel (argtypes declared)":
            lambda: raw(f_int, 1, 1, 1, 256, 1, 1, 0, stream, kp, None),
    }
    times = {name: [] for name in rows}
    for _ in range(7):
        for name, fn in rows.items():
            times[name].append(timeit.timeit(fn, number=calls) / calls * 1e6)
    for name, ts in times.items():
        print(f"{sorted(ts)[3]:7.3f} us  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50000)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        measure(args.calls)
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "stub.c")
        with open(src, "w") as f:
            f.write(STUB)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", os.path.join(tmp, "libcuda.so.1"), src], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=tmp + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
        subprocess.run([sys.executable, __file__, "--inner", "--calls", str(args.calls)], env=env, check=True)


if __name__ == "__main__":
    main()
