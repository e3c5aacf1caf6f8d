"""What of the runtime can be checked without a GPU: its imports, the launch-expression language,
and the generated launcher (driven with a stand-in driver)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from dsagen.kernel_record import LaunchExprError, compile_expr

ROOT = Path(__file__).resolve().parent.parent


def test_runtime_imports_only_torch_cuda_and_stdlib():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("cutlass", "jinja2", "filelock"):
                    raise ImportError(f"{name} is blocked in this test")
        sys.meta_path.insert(0, Block())
        import dsagen, dsagen.runtime, dsagen.runtime.kernel, dsagen.runtime.tensormap
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "jinja2", "filelock"))
        assert not bad, bad
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr


def test_import_dsagen_is_lazy():
    code = "import sys, dsagen; print(sorted(m for m in sys.modules if m.startswith(('cutlass', 'cuda', 'jinja2'))))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("expr,env,value", [
    ("ceil_div(n, 8)", {"n": 17}, 3), ("ceil_div(n, 8)", {"n": 16}, 2), ("ceil_div(n, 8)", {"n": 0}, 0),
    ("max(a, 1) * 2 + b % 3 - -1", {"a": 0, "b": 7}, 4), ("min(a, b) // 2", {"a": 9, "b": 11}, 4), (5, {}, 5),
])
def test_launch_expressions(expr, env, value):
    assert eval(compile_expr(expr, set(env)), {"min": min, "max": max}, dict(env)) == value


@pytest.mark.parametrize("expr,match", [("n.__class__", "Attribute"), ("open(n)", "Call"), ("m + 1", "unknown name"),
                                        ("n / 2", "BinOp"), ("n +", "launch expression")])
def test_launch_expressions_reject_everything_else(expr, match):
    with pytest.raises(LaunchExprError, match=match):
        compile_expr(expr, {"n"})


def _stub_kernel(monkeypatch, record):
    """A LoadedKernel whose launcher is generated for `record` and whose driver calls are recorded."""
    import dsagen.runtime.kernel as K
    from cuda.bindings import driver as real

    calls = []

    class Driver:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuLaunchKernel(self, *a):
            calls.append(a)
            return (real.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(K, "cu", lambda: Driver())
    monkeypatch.setattr(K, "current_stream_handle", lambda index: 1234)
    k = K.LoadedKernel.__new__(K.LoadedKernel)
    k.name, k.record, k.device_index, k.params = "stub", record, 0, record["params"]
    k.block, k.cluster, k.smem, k.function, k._lock = (128, 1, 1), (1, 1, 1), 0, 0, threading.Lock()
    k._build_launcher()
    return k, calls


RECORD = {"symbol": "s", "params": [
    {"name": "x", "kind": "ptr", "dtype": "int32", "align": 16, "offset": 0, "size": 8},
    {"name": "n", "kind": "i32", "offset": 8, "size": 4},
    {"name": "ld", "kind": "i64", "offset": 16, "size": 8},
    {"name": "alpha", "kind": "f32", "offset": 24, "size": 4}],
    "launch": {"grid": ["ceil_div(n, 128)", "1", "1"], "block": [128, 1, 1], "cluster": [1, 1, 1], "smem": 0}}


def test_launcher_packs_params_at_their_offsets(monkeypatch):
    import ctypes
    import struct

    k, calls = _stub_kernel(monkeypatch, RECORD)
    x = torch.zeros(64, dtype=torch.int32)
    k.launch(x, 300, -5, 0.5)
    (f, gx, gy, gz, bx, by, bz, smem, stream, kp, extra), = calls
    assert (gx, gy, gz, bx, stream) == (3, 1, 1, 128, 1234)
    ptrs = (ctypes.c_void_p * 4).from_address(kp)
    assert struct.unpack("<Q", ctypes.string_at(ptrs[0], 8))[0] == x.data_ptr()
    assert struct.unpack("<i", ctypes.string_at(ptrs[1], 4))[0] == 300
    assert struct.unpack("<q", ctypes.string_at(ptrs[2], 8))[0] == -5
    assert struct.unpack("<f", ctypes.string_at(ptrs[3], 4))[0] == 0.5
    assert ptrs[2] - ptrs[0] == 16                      # the cubin's offsets, not a packed guess


def test_launcher_checks(monkeypatch):
    k, calls = _stub_kernel(monkeypatch, RECORD)
    x = torch.zeros(64, dtype=torch.int32)
    k.launch(x, 0, 1, 1.0)                              # zero blocks: nothing launched
    assert calls == []
    with pytest.raises(ValueError, match="16-byte aligned"):
        k.launch(x[1:], 5, 1, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        k.launch(x, 5, 2**70, 1.0)
    tall = dict(RECORD, launch=dict(RECORD["launch"], grid=["1", "n", "1"]))
    k2, _ = _stub_kernel(monkeypatch, tall)
    with pytest.raises(ValueError, match="exceeds"):
        k2.launch(x, 70000, 1, 1.0)


MAP_RECORD = {"symbol": "s", "params": [
    {"name": "n", "kind": "i32", "offset": 0, "size": 4},
    {"name": "m", "kind": "tensormap", "offset": 64, "size": 128,
     "encode": {"dtype": "float32", "box": [8, 8], "swizzle": "NONE"}},
    {"name": "x", "kind": "ptr", "dtype": "float32", "align": 4, "offset": 192, "size": 8}],
    "launch": {"grid": ["1", "1", "1"], "block": [128, 1, 1], "cluster": [1, 1, 1], "smem": 0}}


def test_launcher_writes_descriptors_apart_from_the_pack(monkeypatch):
    """A tensormap param's 128 bytes are the encoding of the launch's own view, also when the encoder skips
    rewriting the view it wrote last: the pointer / scalar packs never touch the descriptor's bytes."""
    import ctypes
    import struct

    import dsagen.runtime.tensormap as T

    encoded = []

    def fake_encode(self, t, key):
        encoded.append(key)
        return struct.pack("<Q", t.data_ptr()) + bytes(120)

    monkeypatch.setattr(T.TensorMapEncoder, "_encode", fake_encode)
    k, calls = _stub_kernel(monkeypatch, MAP_RECORD)
    a, b, x = torch.zeros(16, 8), torch.zeros(16, 8), torch.zeros(4)

    def launched():
        kp = calls[-1][9]
        ptrs = (ctypes.c_void_p * 3).from_address(kp)
        return (struct.unpack("<i", ctypes.string_at(ptrs[0], 4))[0],
                struct.unpack("<Q", ctypes.string_at(ptrs[1], 8))[0],
                struct.unpack("<Q", ctypes.string_at(ptrs[2], 8))[0])

    for t, n in ((a, 1), (a, 2), (b, 3), (a, 4), (a[:8], 5)):
        k.launch(n, t, x)
        assert launched() == (n, t.data_ptr(), x.data_ptr())
    assert len(encoded) == 4                            # the repeated view of `a` is not written again
    assert encoded[-1][1:] == ((8, 8), (8, 1))          # another view of the same pointer is


def test_device_sm_count_reads_each_device_once(monkeypatch):
    """dsagen.runtime.device_sm_count (the persistent grids of the indexer and sparse attention) reads a
    device's SM count from torch once and serves it from a cache after that, per device index."""
    from types import SimpleNamespace

    from dsagen.runtime import device_sm_count

    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=100 + index)

    device_sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    try:
        assert [device_sm_count(0), device_sm_count(1), device_sm_count(0), device_sm_count(1)] == [100, 101, 100, 101]
        assert calls == [0, 1]
    finally:
        device_sm_count.cache_clear()
