"""A kernel loaded from a cubin and a manifest record, with a generated straight-line launcher.

    k = LoadedKernel(name, record, cubin, arch, device_index)
    k.launch(idx, length, out, out_length, n_rows, k_width, ld_idx, 1)   # PARAMS order

Arguments: a torch tensor for every `ptr` param (its data_ptr, alignment checked) and every `tensormap`
param (encoded from the recipe, cached), a Python int or float for scalars. The launch goes to torch's
current stream on the kernel's device (or `stream=`), with the recorded block, cluster and dynamic
shared memory and the grid computed from the record's expressions. A grid with a zero dimension
launches nothing (there is no work). No allocation, no host synchronization: CUDA-graph capturable.
"""

from __future__ import annotations

import ctypes
import struct
import threading

import torch

from ..errors import DsagenError
from .device import current_stream_handle
from .driver import CudaDriverError, check, cu, require_driver
from ..kernel_record import compile_expr
from .tensormap import TensorMapEncoder

_FORMATS = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f"}
_MAX_GRID = (2**31 - 1, 65535, 65535)


class KernelArchMismatch(DsagenError, RuntimeError):
    """A cubin built for one arch was asked to run on a device of another."""


class LoadedKernel:
    """One kernel function loaded on one device. Thread-safe; see the module docstring for `launch`."""

    def __init__(self, name: str, record: dict, cubin: bytes, arch: str, device_index: int,
                 device_arch: str):
        if arch != device_arch:
            raise KernelArchMismatch(
                f"kernel {name} was built for {arch}, but cuda:{device_index} needs {device_arch} "
                f"(arch-specific cubins are not forward compatible); build it with --arch {device_arch}")
        require_driver()  # before the load: an old driver's own error does not name the driver as the cause
        self.name, self.record, self.device_index = name, record, device_index
        self.params = record["params"]
        d = cu()
        with torch.cuda.device(device_index):
            torch.zeros(1, device=f"cuda:{device_index}")  # torch's primary context is current
            self._library = check(d.cuLibraryLoadData(cubin, None, None, 0, None, None, 0),
                                  f"cuLibraryLoadData({name})")
            kern = check(d.cuLibraryGetKernel(self._library, record["symbol"].encode()),
                         f"cuLibraryGetKernel({record['symbol']})")
            self.function = check(d.cuKernelGetFunction(kern), f"cuKernelGetFunction({name})")
        self._check_param_layout()
        launch = record["launch"]
        self.block = tuple(int(b) for b in launch["block"])
        self.cluster = tuple(int(c) for c in launch.get("cluster", (1, 1, 1)))
        self.smem = int(launch.get("smem", 0))
        self._set_attributes()
        self._lock = threading.Lock()
        self._build_launcher()

    # ---- load-time checks ---------------------------------------------------------------------------
    def _check_param_layout(self) -> None:
        d = cu()
        for i, p in enumerate(self.params):
            off, size = check(d.cuFuncGetParamInfo(self.function, i), f"cuFuncGetParamInfo({self.name}, {i})")
            if (off, size) != (p["offset"], p["size"]):
                raise RuntimeError(f"kernel {self.name}: param {i} ({p['name']}) is at offset {off}, size "
                                   f"{size} in the cubin, but the manifest says offset {p['offset']}, size "
                                   f"{p['size']}: the manifest does not belong to this cubin")
        extra = d.cuFuncGetParamInfo(self.function, len(self.params))
        if int(extra[0]) == 0:
            raise RuntimeError(f"kernel {self.name}: the cubin has more params than the manifest's "
                               f"{len(self.params)}")

    def _set_attributes(self) -> None:
        d = cu()
        A = d.CUfunction_attribute
        static = check(d.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.function),
                       "cuFuncGetAttribute(SHARED_SIZE_BYTES)")
        optin = check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.device_index),
            "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
        if static + self.smem > optin:
            raise RuntimeError(f"kernel {self.name} needs {static} + {self.smem} bytes of shared memory; "
                               f"cuda:{self.device_index} allows {optin}")
        if self.smem > 48 * 1024:
            check(d.cuFuncSetAttribute(self.function, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       self.smem), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        if self.cluster[0] * self.cluster[1] * self.cluster[2] > 8:
            check(d.cuFuncSetAttribute(self.function, A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")

    # ---- the generated launcher ----------------------------------------------------------------------
    def _build_launcher(self) -> None:
        d = cu()
        names = [p["name"] for p in self.params]
        scalars = {p["name"] for p in self.params if p["kind"] in ("i32", "i64", "f32")}
        end = max((p["offset"] + p["size"] for p in self.params), default=0)
        self._buf = (ctypes.c_uint8 * (end + 64))()
        base = (ctypes.addressof(self._buf) + 63) // 64 * 64
        self._base = base - ctypes.addressof(self._buf)
        self._kparams = (ctypes.c_void_p * max(len(self.params), 1))(
            *[base + p["offset"] for p in self.params])
        # the pointers and scalars go in by one struct pack per run of them between tensormaps, so a pack never
        # touches a descriptor's bytes and an encoder may skip writing the descriptor it wrote last
        segments, values, lines, maps, ns = [], [], [], [], {}
        fmt, seg_values, start, pos = None, [], 0, 0
        for i, p in enumerate(self.params):
            n, kind = p["name"], p["kind"]
            if kind == "tensormap":
                if fmt is not None:
                    segments.append((start, struct.Struct("".join(fmt)), seg_values))
                fmt, seg_values = None, []
                ns[f"_enc{i}"] = TensorMapEncoder(n, p["encode"])
                maps.append(f"        _enc{i}.write({n}, {base + p['offset']})")
                pos = p["offset"] + p["size"]
                continue
            if fmt is None:
                fmt, start, pos = ["<"], p["offset"], p["offset"]
            if p["offset"] > pos:
                fmt.append(f"{p['offset'] - pos}x")
            if kind == "ptr":
                fmt.append("Q")
                lines.append(f"    _a{i} = {n}.data_ptr()")
                if p.get("align", 1) > 1:
                    lines.append(f"    if _a{i} % {p['align']}: _misaligned({n!r}, _a{i}, {p['align']})")
                seg_values.append(f"_a{i}")
            else:
                fmt.append(_FORMATS[kind])
                seg_values.append(n)
            pos = p["offset"] + p["size"]
        if fmt is not None:
            segments.append((start, struct.Struct("".join(fmt)), seg_values))
        packs = []
        for j, (start, st, vals) in enumerate(segments):
            ns[f"_pack{j}"] = st.pack_into
            packs.append(f"            _pack{j}(_buf, {self._base + start}, {', '.join(vals)})")
            values += vals
        grid = [compile_expr(g, scalars) for g in self.record["launch"]["grid"]]
        bx, by, bz = self.block
        src = [f"def launch({', '.join(names + ['stream=None'])}):"]
        src += [f"    _gx = {grid[0]}", f"    _gy = {grid[1]}", f"    _gz = {grid[2]}",
                "    if _gx <= 0 or _gy <= 0 or _gz <= 0:", "        return",
                f"    if _gx > {_MAX_GRID[0]} or _gy > {_MAX_GRID[1]} or _gz > {_MAX_GRID[2]}:",
                "        _grid_too_large(_gx, _gy, _gz)"]
        src += ["    with _lock:"]
        src += ["    " + line for line in lines]
        if packs:
            src += ["        try:", *packs,
                    "        except _struct_error as e:", f"            _bad_scalar(e, ({', '.join(values)},))"]
        src += maps
        src += [f"        _s = _stream({self.device_index}) if stream is None else stream"]
        if self.cluster == (1, 1, 1):
            src += [f"        _r = _launch(_f, _gx, _gy, _gz, {bx}, {by}, {bz}, {self.smem}, _s, _kp, 0)"]
        else:
            cfg = d.CUlaunchConfig()
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
            cfg.sharedMemBytes = self.smem
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = self.cluster
            cfg.attrs, cfg.numAttrs = [attr], 1
            ns["_cfg"], ns["_CUstream"] = cfg, d.CUstream
            src += ["        _cfg.gridDimX, _cfg.gridDimY, _cfg.gridDimZ = _gx, _gy, _gz",
                    "        _cfg.hStream = _CUstream(_s)",
                    "        _r = _launch_ex(_cfg, _f, _kp, 0)"]
        src += ["    if _r[0] != _SUCCESS:", "        _failed(_r)"]
        ns.update(_lock=self._lock, _buf=self._buf, _struct_error=struct.error, _stream=current_stream_handle,
                  _f=self.function, _kp=ctypes.addressof(self._kparams), _launch=d.cuLaunchKernel,
                  _launch_ex=d.cuLaunchKernelEx,
                  _SUCCESS=d.CUresult.CUDA_SUCCESS, _failed=self._failed, _misaligned=self._misaligned,
                  _grid_too_large=self._grid_too_large, _bad_scalar=self._bad_scalar,
                  ceil_div=None, min=min, max=max)
        self.launch_source = "\n".join(src)
        exec(compile(self.launch_source, f"<dsagen launcher {self.name}>", "exec"), ns)
        self.launch = ns["launch"]

    def _failed(self, r) -> None:
        check(r, f"launch of {self.name}")

    def _misaligned(self, name: str, addr: int, align: int) -> None:
        raise ValueError(f"kernel {self.name}: {name} must be {align}-byte aligned, got address {addr:#x}")

    def _grid_too_large(self, gx: int, gy: int, gz: int) -> None:
        raise ValueError(f"kernel {self.name}: grid ({gx}, {gy}, {gz}) exceeds the limits {_MAX_GRID}")

    def _bad_scalar(self, err: Exception, values: tuple) -> None:
        raise ValueError(f"kernel {self.name}: a scalar argument does not fit its param type "
                         f"({err}); values {values}")

    def __repr__(self) -> str:
        return f"LoadedKernel({self.name}, cuda:{self.device_index}, grid={self.record['launch']['grid']}, " \
               f"block={list(self.block)}, cluster={list(self.cluster)}, smem={self.smem})"


__all__ = ["LoadedKernel", "KernelArchMismatch", "CudaDriverError"]
