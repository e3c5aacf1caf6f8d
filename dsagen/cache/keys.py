"""Cache keys. A key is the sha256 of the canonical JSON of everything that determines a kernel's bytes:
schema version, op, spec, arch, compile options, the rendered source, every hand-written helper module
it imports, the generator version and the toolchain (every nvidia-cutlass-dsl* distribution).

The *identity* hashes what determines the rendered source without rendering it: schema, op, spec,
arch, compile options, the template files (and those they extend or include), the helper modules and
the generator version; no toolchain. A process without CuTe-DSL (a deployment running a shipped
cache) computes it cheaply, without jinja2, and finds its kernels by identity.
Sequence lengths, batch sizes and pointers are never key material (specs cannot hold them).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..gen.build import COMPILE_OPTIONS
from ..gen.render import helper_modules, template_helper_modules, template_sources
from ..gen.toolchain import GENERATOR_VERSION
from ..spec import KernelSpec

SCHEMA_VERSION = 1


def _check_json_safe(v: Any, path: str = "key material") -> None:
    """Fail closed: only None, bool, int, str, lists and str-keyed dicts may be hashed (floats and
    unknown types could hash differently across processes or versions)."""
    if v is None or isinstance(v, (bool, int, str)):
        return
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise TypeError(f"{path}: non-finite float {v!r} cannot be key material")
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_json_safe(x, f"{path}[{i}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict key {k!r} is not a str")
            _check_json_safe(x, f"{path}.{k}")
        return
    raise TypeError(f"{path}: value of type {type(v).__name__} cannot be key material")


def canonical_json(v: Any) -> str:
    """Compact, key-sorted JSON of `v` after checking every value is hashable key material."""
    _check_json_safe(v)
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_hex(data: bytes | str) -> str:
    """Hex sha256 of bytes, or of a str encoded as UTF-8."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _common_material(spec: KernelSpec) -> dict[str, Any]:
    return {"schema": SCHEMA_VERSION, "op": spec.op, "spec": spec.canonical(), "arch": spec.arch,
            "compile_options": COMPILE_OPTIONS, "generator": GENERATOR_VERSION}


def key_material(spec: KernelSpec, source: str, toolchain: dict[str, str]) -> dict[str, Any]:
    """Everything the key hashes, as a dict (stored in the manifest so a miss can be explained)."""
    return dict(_common_material(spec), source_sha256=sha256_hex(source), helpers=helper_modules(source),
                toolchain=dict(sorted(toolchain.items())))


def identity_material(spec: KernelSpec) -> dict[str, Any]:
    """What the identity hashes (stored in the manifest)."""
    return dict(_common_material(spec), templates=template_sources(spec), helpers=template_helper_modules(spec))


def identity_of(spec: KernelSpec) -> str:
    """The toolchain-independent identity of `spec`'s kernel (no rendering, no DSL)."""
    return sha256_hex(canonical_json(identity_material(spec)))


def key_of(material: dict[str, Any]) -> str:
    """The cache key of a key material."""
    return sha256_hex(canonical_json(material))


def explain_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Field-by-field differences between two key materials (for 'why did this miss')."""
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k)!r} != {b.get(k)!r}")
    return out
