"""Canonical JSON and sha256: how the store names and checks what it holds (no compiler, no templates).

A cache key is `key_of(key_material)`; the key material itself (what goes into it) is the compiler
layer's business (dsagen.jit.keys).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


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


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range (it reads as {v})")
    return v


def loads_strict(raw: bytes | str) -> Any:
    """Parse strict JSON: Python's json also accepts NaN, Infinity and -Infinity, and reads a number like
    1e999 as infinity; none of those can be written back as JSON, so each is a ValueError here."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)


def sha256_hex(data: bytes | str) -> str:
    """Hex sha256 of bytes, or of a str encoded as UTF-8."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def key_of(material: dict[str, Any]) -> str:
    """The cache key of a key material: the sha256 of its canonical JSON."""
    return sha256_hex(canonical_json(material))
