"""Every environment variable dsagen reads, in one typed registry, read lazily (at use, not import).

| variable             | type        | default                              | meaning                                  |
|----------------------|-------------|--------------------------------------|------------------------------------------|
| DSAGEN_CACHE_DIR     | path        | ${XDG_CACHE_HOME:-~/.cache}/dsagen    | the writable cache root                  |
| DSAGEN_CACHE_PATH    | path list   | (none)                               | read-only cache roots, ':'-separated, searched first |
| DSAGEN_CACHE         | rw, ro, off | rw                                   | rw: read and write; ro: never write; off: no disk cache (compile in memory) |
| DSAGEN_DISABLE_JIT   | bool        | 0                                    | a cache miss raises instead of compiling |
| DSAGEN_ARCH          | arch name   | (from the device)                    | default target of `dsagen build`         |
| DSAGEN_VERIFY        | bool        | 1                                    | check artifact sha256s when an entry is loaded |
| DSAGEN_LOCK_TIMEOUT  | seconds     | 600                                  | how long to wait for another process compiling the same key |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_mode(name: str, raw: str) -> str:
    v = raw.strip().lower()
    if v not in ("rw", "ro", "off"):
        raise ValueError(f"{name}={raw!r}: expected rw, ro or off")
    return v


def _parse_paths(name: str, raw: str) -> list[Path]:
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsagen"


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, parser and default (a value or a zero-argument factory)."""

    name: str
    parse: Callable[[str, str], T]
    default: Callable[[], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default()
        return self.parse(self.name, raw)


CACHE_DIR = EnvVar("DSAGEN_CACHE_DIR", lambda n, r: Path(r).expanduser(), _default_cache_dir,
                   "writable cache root")
CACHE_PATH = EnvVar("DSAGEN_CACHE_PATH", _parse_paths, list, "read-only cache roots, searched first")
CACHE_MODE = EnvVar("DSAGEN_CACHE", _parse_mode, lambda: "rw", "rw | ro | off")
DISABLE_JIT = EnvVar("DSAGEN_DISABLE_JIT", _parse_bool, lambda: False, "a cache miss raises")
ARCH = EnvVar("DSAGEN_ARCH", lambda n, r: r.strip(), lambda: None, "default build target")
VERIFY = EnvVar("DSAGEN_VERIFY", _parse_bool, lambda: True, "sha256-check artifacts on load")
LOCK_TIMEOUT = EnvVar("DSAGEN_LOCK_TIMEOUT", lambda n, r: _parse_float(n, r), lambda: 600.0,
                      "seconds to wait for a compile lock")

ALL: tuple[EnvVar, ...] = (CACHE_DIR, CACHE_PATH, CACHE_MODE, DISABLE_JIT, ARCH, VERIFY, LOCK_TIMEOUT)
