"""Every environment variable dsagen reads, in one typed registry, read lazily (at use, not import).

| variable             | type        | default                              | meaning                                  |
|----------------------|-------------|--------------------------------------|------------------------------------------|
| DSAGEN_CACHE_DIR     | path        | ${XDG_CACHE_HOME:-~/.cache}/dsagen    | the writable cache root                  |
| DSAGEN_CACHE_PATH    | path list   | (none)                               | read-only cache roots, ':'-separated, searched first |
| DSAGEN_CACHE         | rw, ro, off | rw                                   | rw: read and write; ro: never write; off: no disk cache (compile in memory) |
| DSAGEN_DISABLE_JIT   | bool        | 0                                    | a cache miss raises instead of compiling |
| DSAGEN_ARCH          | arch names  | sm_90a                               | default target(s) of `dsagen build`, comma-separated |
| DSAGEN_VERIFY        | bool        | 1                                    | check artifact sha256s when an entry is loaded |
| DSAGEN_LOCK_TIMEOUT  | seconds     | 600                                  | how long to wait for another process compiling the same key (finite, >= 0) |
| DSAGEN_DEBUG         | bool        | 0                                    | the `dsagen` command prints the traceback of an error, not one line |
| DSAGEN_WHEEL_CACHES  | bool        | 1                                    | use the caches of installed kernel wheels (read-only layers) |
| DSAGEN_LOG_LEVEL     | level       | (unset)                              | log level of the `dsagen` logger, with a stderr handler (read once, at import) |

A value a parser cannot use raises dsagen.errors.ConfigError (a ValueError) naming the variable.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

from .errors import ConfigError
from .log import parse_level

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_mode(name: str, raw: str) -> str:
    v = raw.strip().lower()
    if v not in ("rw", "ro", "off"):
        raise ConfigError(f"{name}={raw!r}: expected rw, ro or off")
    return v


def _parse_paths(name: str, raw: str) -> list[Path]:
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def _parse_seconds(name: str, raw: str) -> float:
    """A finite, non-negative number of seconds (0: do not wait)."""
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number of seconds") from None
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"{name}={raw!r}: expected a finite number of seconds >= 0")
    return v


def _parse_arches(name: str, raw: str) -> str | None:
    """A comma-separated list of known arch names (None when blank)."""
    from .spec.arch import ARCHES

    names = [a.strip() for a in raw.split(",") if a.strip()]
    bad = [a for a in names if a not in ARCHES]
    if bad:
        raise ConfigError(f"{name}={raw!r}: unknown arch {', '.join(map(repr, bad))}; "
                          f"known: {', '.join(sorted(ARCHES))}")
    return ",".join(names) or None


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
        """The parsed value, or the default when the variable is unset; ConfigError naming the variable
        when its value cannot be used."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default()
        return self.parse(self.name, raw)


CACHE_DIR = EnvVar("DSAGEN_CACHE_DIR", lambda n, r: Path(r).expanduser(), _default_cache_dir,
                   "writable cache root")
CACHE_PATH = EnvVar("DSAGEN_CACHE_PATH", _parse_paths, list, "read-only cache roots, searched first")
CACHE_MODE = EnvVar("DSAGEN_CACHE", _parse_mode, lambda: "rw", "rw | ro | off")
DISABLE_JIT = EnvVar("DSAGEN_DISABLE_JIT", _parse_bool, lambda: False, "a cache miss raises")
ARCH = EnvVar("DSAGEN_ARCH", _parse_arches, lambda: None, "default build target(s), comma-separated")
VERIFY = EnvVar("DSAGEN_VERIFY", _parse_bool, lambda: True, "sha256-check artifacts on load")
LOCK_TIMEOUT = EnvVar("DSAGEN_LOCK_TIMEOUT", _parse_seconds, lambda: 600.0,
                      "seconds to wait for a compile lock (finite, >= 0)")
DEBUG = EnvVar("DSAGEN_DEBUG", _parse_bool, lambda: False, "dsagen command: print tracebacks of errors")
WHEEL_CACHES = EnvVar("DSAGEN_WHEEL_CACHES", _parse_bool, lambda: True,
                      "read the caches of installed kernel wheels")
LOG_LEVEL = EnvVar("DSAGEN_LOG_LEVEL", lambda n, r: parse_level(r) if r.strip() else None, lambda: None,
                   "log level of the dsagen logger (stderr)")

ALL: tuple[EnvVar, ...] = (CACHE_DIR, CACHE_PATH, CACHE_MODE, DISABLE_JIT, ARCH, VERIFY, LOCK_TIMEOUT, DEBUG,
                           WHEEL_CACHES, LOG_LEVEL)
