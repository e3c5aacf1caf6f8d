"""Cross-compile one rendered kernel module to a cubin and check its ABI (needs the [gen] extra; no GPU).

`compile_module(spec, source, workdir)` writes the source to `workdir/kernel.py` (the DSL needs a real
file), imports it, compiles its `host` entry with fake arguments for `--gpu-arch <arch>`, and returns
the cubin plus the manifest's `kernel` record. It raises AbiError when the module's declared PARAMS or
LAUNCH disagree with the PTX or the cubin.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..spec import KernelSpec
from . import abi

COMPILE_OPTIONS = "--keep-ptx --keep-cubin"  # plus --gpu-arch and --dump-dir; part of the cache key


@dataclass
class CompiledKernel:
    """What a compile produced: the cubin, the PTX, and the manifest's `kernel` record."""

    cubin: bytes
    ptx: str
    record: dict
    compile_seconds: float


def _fake_args(args: list[dict]):
    import cutlass
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    dtypes = {"int32": cutlass.Int32, "int64": cutlass.Int64, "float32": cutlass.Float32,
              "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "uint8": cutlass.Uint8,
              "int8": cutlass.Int8, "uint32": cutlass.Uint32}
    scalars = {"i32": cutlass.Int32, "i64": cutlass.Int64, "f32": cutlass.Float32}
    out = []
    for a in args:
        if a["kind"] == "ptr":
            out.append(make_ptr(dtypes[a["dtype"]], 0, AddressSpace.gmem, assumed_align=a["align"]))
        elif a["kind"] in scalars:
            out.append(scalars[a["kind"]](0))
        else:
            raise abi.AbiError(f"host argument {a['name']}: kind {a['kind']!r} cannot be faked; "
                               f"host arguments are ptr/i32/i64/f32 (build tensormaps inside host)")
    return out


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the DSL resolves source through the module
    spec.loader.exec_module(mod)
    return mod


def _dynamic_smem_from_ir(ir: str) -> int | None:
    """The dynamic smem bytes the host code passes to the launch (field 2 of the launch-config struct),
    or None when it is not a constant."""
    consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i64\) : i64", ir))
    lines = ir.splitlines()
    for j, line in enumerate(lines):
        m = re.search(r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
                      r"!llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>", line)
        if m:
            for k in range(j + 1, min(j + 4, len(lines))):
                s = re.search(rf"llvm\.store (%\w+), {re.escape(m.group(1))} : i64", lines[k])
                if s and s.group(1) in consts:
                    return int(consts[s.group(1)])
    return None


def check_declaration(mod, symbol: str, ptx: str, cubin: bytes, arch_sm: int, ir: str | None) -> dict:
    """Compare the module's PARAMS/LAUNCH with the compiled PTX and cubin; return the kernel record."""
    params, launch = mod.PARAMS, mod.LAUNCH
    problems = abi.param_reasons(params)
    entries = [e for e in abi.ptx_entries(ptx) if e.symbol.startswith(symbol)]
    if len(entries) != 1:
        raise abi.AbiError(f"expected one PTX entry named {symbol}_*, found {[e.symbol for e in entries]}")
    entry = entries[0]
    if len(entry.params) != len(params):
        problems.append(f"PTX entry has {len(entry.params)} params, PARAMS declares {len(params)}: "
                        f"{entry.params}")
    else:
        for decl, p in zip(entry.params, params):
            if not abi.ptx_param_matches(decl, p):
                problems.append(f"param {p['name']} declared {p['kind']}"
                                f"{'/align ' + str(p.get('align')) if p['kind'] == 'ptr' else ''} "
                                f"but PTX has `{decl}`")
    if entry.reqntid is not None and tuple(entry.reqntid) != tuple(launch["block"]):
        problems.append(f"LAUNCH block {launch['block']} != PTX .reqntid {list(entry.reqntid)}")
    kernels = abi.cubin_kernels(cubin)
    if entry.symbol not in kernels:
        raise abi.AbiError(f"cubin has no kernel {entry.symbol}; it has {sorted(kernels)}")
    ck = kernels[entry.symbol]
    if abi.cubin_sm(cubin) != arch_sm:
        problems.append(f"cubin is for sm_{abi.cubin_sm(cubin)}, expected sm_{arch_sm}")
    if len(ck.params) != len(params):
        problems.append(f"cubin has {len(ck.params)} params, PARAMS declares {len(params)}")
    else:
        for (off, size), p in zip(ck.params, params):
            if size != abi.PARAM_SIZES.get(p["kind"]):
                problems.append(f"param {p['name']}: cubin size {size} != {abi.PARAM_SIZES.get(p['kind'])} "
                                f"for kind {p['kind']}")
    smem_ir = _dynamic_smem_from_ir(ir) if ir else None
    if smem_ir is not None and smem_ir != int(launch.get("smem", 0)):
        problems.append(f"LAUNCH smem {launch.get('smem')} != {smem_ir} bytes passed by the host code")
    if problems:
        raise abi.AbiError(f"{symbol}: declaration does not match the compiled kernel:\n  - "
                           + "\n  - ".join(problems))
    record_params = []
    for (off, size), p in zip(ck.params, params):
        rp = dict(p)
        rp.update(offset=off, size=size)
        record_params.append(rp)
    cluster = [int(x) for x in launch.get("cluster", [1, 1, 1])]
    return {
        "symbol": entry.symbol,
        "params": record_params,
        "launch": {"grid": [str(g) for g in launch["grid"]], "block": [int(b) for b in launch["block"]],
                   "cluster": cluster, "smem": int(launch.get("smem", 0))},
        "regcount": ck.regcount,
        "static_smem": ck.static_smem,
    }


def compile_module(spec: KernelSpec, source: str, workdir: Path) -> CompiledKernel:
    """Compile `source` (the rendered module of `spec`) inside `workdir`; see the module docstring."""
    import cutlass.cute as cute  # the [gen] extra

    from ..spec import get_arch

    workdir = Path(workdir)
    dump = workdir / "dump"
    dump.mkdir(parents=True, exist_ok=True)  # the DSL silently skips --keep-* dumps into a missing dir
    path = workdir / "kernel.py"
    path.write_text(source)
    modname = f"_dsagen_kernel_{os.getpid()}_{abs(hash(str(workdir)))}"
    mod = _load_module(path, modname)
    try:
        for attr in ("SYMBOL", "PARAMS", "LAUNCH", "host"):
            if not hasattr(mod, attr):
                raise abi.AbiError(f"{spec.name()}: the rendered module defines no {attr} "
                                   f"(template {spec.template})")
        host_args = getattr(mod, "HOST_ARGS", None) or mod.PARAMS
        arch = get_arch(spec.arch)
        opts = f"--gpu-arch {arch.name} {COMPILE_OPTIONS} --dump-dir {dump}"
        t0 = time.perf_counter()
        compiled = cute.compile(mod.host, *_fake_args(host_args), options=opts)
        seconds = time.perf_counter() - t0
        cubin = compiled.__cubin__
        if not isinstance(cubin, (bytes, bytearray)):
            raise RuntimeError(f"{spec.name()}: the DSL returned no cubin bytes ({type(cubin).__name__})")
        ptx = compiled.__ptx__
        try:
            ir = str(compiled.ir_module)
        except Exception:  # noqa: BLE001 -- the lowered IR is only a cross-check
            ir = None
        sm = arch.capability[0] * 10 + arch.capability[1]
        record = check_declaration(mod, mod.SYMBOL, ptx, bytes(cubin), sm, ir)
        return CompiledKernel(bytes(cubin), ptx, record, seconds)
    finally:
        sys.modules.pop(modname, None)
