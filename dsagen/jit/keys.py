"""Cache keys (the compiler layer's side: what a key and an identity hash; the hashing is dsagen.store.hashing). A key is the sha256 of the canonical JSON of everything that determines a kernel's bytes:
schema version, op, spec, arch, compile options, the rendered source, every hand-written helper module
it imports, the generator version and the toolchain (every nvidia-cutlass-dsl* distribution).

The *identity* hashes what determines the rendered source without rendering it: schema, op, spec,
arch, compile options, the template files (and those they extend or include), the helper modules and
the generator version; no toolchain. A process without CuTe-DSL (a deployment running a shipped
cache) computes it cheaply, without jinja2, and finds its kernels by identity.
Sequence lengths, batch sizes and pointers are never key material (specs cannot hold them).
"""

from __future__ import annotations

from typing import Any

from ..spec import KernelSpec
from ..store.hashing import canonical_json, key_of, sha256_hex
from .build import COMPILE_OPTIONS
from .render import helper_modules, template_helper_modules, template_sources
from .toolchain import GENERATOR_VERSION

SCHEMA_VERSION = 1


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


def explain_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Field-by-field differences between two key materials (for 'why did this miss')."""
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k)!r} != {b.get(k)!r}")
    return out
