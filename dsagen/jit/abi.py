"""The kernel parameter ABI: what each declared param kind looks like in PTX and in the cubin, and
readers for both. Pure Python; used at build time (to check a template's declaration against what
was compiled) and by `dsagen verify`.

Param kinds of the flat ABI (design.md):
  ptr        a global pointer (8 bytes); `align` is the assumed alignment the kernel was compiled with
  i32 / i64 / f32   scalars (4 / 8 / 4 bytes)
  tensormap  a 128-byte CUtensorMap passed by value (align 64), encoded by the runtime from `encode`
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from ..errors import DsagenError

PARAM_SIZES = {"ptr": 8, "i32": 4, "i64": 8, "f32": 4, "tensormap": 128}
PARAM_ALIGN = {"ptr": 8, "i32": 4, "i64": 8, "f32": 4, "tensormap": 64}
PTR_DTYPES = ("int32", "int64", "float32", "float16", "bfloat16", "uint8", "int8", "uint32")


class AbiError(DsagenError, ValueError):
    """A kernel's declared params do not match what the compiler produced."""


def param_reasons(params: list[dict]) -> list[str]:
    """Every problem with a PARAMS declaration itself (before comparing it with a compiled kernel)."""
    out, seen = [], set()
    for i, p in enumerate(params):
        name, kind = p.get("name"), p.get("kind")
        if not isinstance(name, str) or not name.isidentifier():
            out.append(f"param {i}: name {name!r} is not an identifier")
        elif name in seen:
            out.append(f"param {i}: duplicate name {name!r}")
        seen.add(name)
        if kind not in PARAM_SIZES:
            out.append(f"param {name}: kind {kind!r} is not one of {sorted(PARAM_SIZES)}")
        if kind == "ptr":
            if p.get("dtype") not in PTR_DTYPES:
                out.append(f"param {name}: ptr dtype {p.get('dtype')!r} is not one of {PTR_DTYPES}")
            if p.get("align") not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                out.append(f"param {name}: align {p.get('align')!r} must be a power of two <= 256")
        if kind == "tensormap" and not isinstance(p.get("encode"), dict):
            out.append(f"param {name}: a tensormap param needs an `encode` recipe")
    return out


# ---------------------------------------------------------------------------------------------- PTX
@dataclass(frozen=True)
class PtxEntry:
    """One `.entry` of a PTX module: its symbol, its param declarations and `.reqntid`."""

    symbol: str
    params: list[str]
    reqntid: tuple[int, int, int] | None


def ptx_entries(ptx: str) -> list[PtxEntry]:
    """Every kernel entry in `ptx`."""
    out = []
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        params = [" ".join(p.split()) for p in m.group(2).split(",") if p.strip()]
        tail = ptx[m.end():m.end() + 600]
        rq = re.search(r"\.reqntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", tail.split("{", 1)[0])
        out.append(PtxEntry(m.group(1), params, tuple(int(x) for x in rq.groups()) if rq else None))
    return out


def ptx_param_matches(decl: str, p: dict) -> bool:
    """Whether one PTX param declaration is what the declared flat-ABI param `p` compiles to."""
    kind = p["kind"]
    if kind == "ptr":
        m = re.match(r"\.param \.u64 (?:\.ptr )?(?:\.global )?(?:\.align (\d+) )?\w+$", decl)
        return bool(m) and (m.group(1) is None or int(m.group(1)) == p["align"])
    if kind == "i32":
        return bool(re.match(r"\.param \.[us]32 \w+$", decl))
    if kind == "i64":
        return bool(re.match(r"\.param \.[us]64 \w+$", decl))
    if kind == "f32":
        return bool(re.match(r"\.param \.f32 \w+$", decl))
    if kind == "tensormap":
        return bool(re.match(r"\.param \.align 64 \.b8 \w+\[128\]$", decl))
    return False


# -------------------------------------------------------------------------------------------- cubin
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_REQNTID = 0x10
_EIATTR_REGCOUNT = 0x2F
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


@dataclass(frozen=True)
class CubinKernel:
    """The driver-relevant facts of one kernel in a cubin."""

    symbol: str
    params: list[tuple[int, int]]  # (offset, size) per param, in ordinal order
    reqntid: tuple[int, ...] | None
    regcount: int | None
    static_smem: int


def _sections(data: bytes) -> list[dict]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, info, _al, _es = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        secs.append({"name_off": name, "type": typ, "offset": off, "size": size, "link": link})
    strtab = secs[shstrndx]
    for s in secs:
        o = strtab["offset"] + s["name_off"]
        s["name"] = data[o:data.index(b"\0", o)].decode()
    return secs


def _nvinfo(buf: bytes):
    """(attribute, value) records of an .nv.info section. NVAL records carry a 2-byte (ignored) value
    field; BVAL and HVAL a 2-byte value; SVAL a 2-byte length then that many bytes."""
    i = 0
    while i + 4 <= len(buf):
        fmt, attr = buf[i], buf[i + 1]
        if fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            (v,) = struct.unpack_from("<H", buf, i + 2)
            yield attr, v
            i += 4
        elif fmt == _EIFMT_SVAL:
            (n,) = struct.unpack_from("<H", buf, i + 2)
            yield attr, bytes(buf[i + 4:i + 4 + n])
            i += 4 + n
        else:
            raise AbiError(f"unreadable .nv.info record (format byte {fmt:#x} at offset {i})")


def cubin_kernels(data: bytes) -> dict[str, CubinKernel]:
    """symbol -> CubinKernel for every kernel in an sm_xx cubin (an NVIDIA ELF)."""
    if data[:4] != b"\x7fELF":
        raise AbiError("not an ELF cubin")
    secs = _sections(data)
    info: dict[str, dict] = {}
    for s in secs:
        if s["name"].startswith(".nv.info."):
            k = info.setdefault(s["name"][len(".nv.info."):], {"params": [], "reqntid": None})
            for attr, val in _nvinfo(data[s["offset"]:s["offset"] + s["size"]]):
                if attr == _EIATTR_KPARAM_INFO:
                    _index, ordinal, offset, flags = struct.unpack_from("<IHHI", val)
                    k["params"].append((ordinal, offset, (flags >> 18) & 0x3FFF))
                elif attr == _EIATTR_REQNTID:
                    k["reqntid"] = struct.unpack_from(f"<{len(val) // 4}I", val)
    static = {s["name"][len(".nv.shared."):]: s["size"] for s in secs
              if s["name"].startswith(".nv.shared.") and not s["name"].startswith(".nv.shared.reserved")}
    regs: dict[str, int] = {}
    symtab = next((s for s in secs if s["name"] == ".symtab"), None)
    if symtab is not None:
        strtab = secs[symtab["link"]]
        names = []
        for i in range(symtab["size"] // 24):
            (st_name,) = struct.unpack_from("<I", data, symtab["offset"] + 24 * i)
            o = strtab["offset"] + st_name
            names.append(data[o:data.index(b"\0", o)].decode())
        for s in secs:
            if s["name"] == ".nv.info":
                for attr, val in _nvinfo(data[s["offset"]:s["offset"] + s["size"]]):
                    if attr == _EIATTR_REGCOUNT and isinstance(val, bytes):
                        sym, cnt = struct.unpack_from("<II", val)
                        regs[names[sym]] = cnt
    out = {}
    for sym, k in info.items():
        params = [(off, size) for _o, off, size in sorted(k["params"])]
        out[sym] = CubinKernel(sym, params, k["reqntid"], regs.get(sym), static.get(sym, 0))
    return out


def cubin_sm(data: bytes) -> int:
    """The SM version a cubin was built for (e.g. 90), from the ELF header flags."""
    (flags,) = struct.unpack_from("<I", data, 0x30)
    return (flags >> 8) & 0xFF
