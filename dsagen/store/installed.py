"""Caches shipped as Python packages: kernel wheels (`dsagen pack --wheel`) found with no environment variable.

A kernel wheel installs a package `<pkg>/` holding the cache tree `<pkg>/cache/v1/...` and declares the entry
point `<pkg> = <pkg>` in the group `dsagen.caches`. `installed_caches()` reads that group from the installed
distributions' metadata and locates each named package's `cache/` folder with `importlib.util.find_spec` on
its top-level name, which imports nothing: no code of an installed wheel runs. The store adds every folder
found as a read-only layer after the DSAGEN_CACHE_PATH roots (DSAGEN_WHEEL_CACHES=0 turns this off); its
entries pass the same `load_entry` checks as any other layer's.

A wheel's `<pkg>/dsagen-kernels.json` (written by `dsagen pack --wheel`) records its format and the CUDA major its
cubins need; a wheel that records another format or CUDA major than this dsagen's (WHEEL_FORMAT, CUDA_MAJOR), or
whose record is unreadable, is skipped with a warning: its kernels would not load here. A wheel without the file
(written before it existed) is taken as it is.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..log import get_logger

GROUP = "dsagen.caches"
CACHE_FOLDER = "cache"
RECORD_FILE = "dsagen-kernels.json"   # beside cache/ in a kernel wheel's package
WHEEL_FORMAT = 1                      # the layout of a kernel wheel this dsagen writes and reads
# The CUDA major the cubins of this dsagen's toolchain need: the `gen` extra pins nvidia-cutlass-dsl[cu13], whose
# cubins load on a CUDA 13 driver. A fixed rule rather than a guess from the installed packages, which may hold
# both the cu12 and the cu13 DSL libraries.
CUDA_MAJOR = 13
_MAX_RECORD_BYTES = 1 << 20

_log = get_logger("store")
_memo: dict[tuple[str, ...], tuple["InstalledCache", ...]] = {}
_memo_lock = threading.Lock()
_warned: set[str] = set()


@dataclass(frozen=True)
class InstalledCache:
    """The cache folder of one installed kernel wheel: its root and the distribution ("name version")."""

    root: Path
    dist: str


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=4)


def _package_dir(module: str) -> Path | None:
    """The folder of package `module` (dotted names allowed) without importing anything: find_spec of the
    top-level name, then the remaining parts as sub-folders."""
    top, *rest = module.split(".")
    if not top.isidentifier() or not all(p.isidentifier() for p in rest):
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for loc in locations:
        p = Path(loc).joinpath(*rest)
        if p.is_dir():
            return p
    return None


def record_problem(path: Path) -> str | None:
    """Why this dsagen cannot serve the kernel wheel whose record (`dsagen-kernels.json`) is `path`: a format or
    CUDA major other than WHEEL_FORMAT and CUDA_MAJOR, or a record that is not a readable JSON object. None when
    it can, or when there is no record (a wheel written before records existed)."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_RECORD_BYTES:
            raise ValueError("not a regular file of at most 1 MiB")
        record = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        return f"its {RECORD_FILE} is unreadable ({str(e)[:200]})"
    if not isinstance(record, dict):
        return f"its {RECORD_FILE} is not a JSON object"
    if record.get("format") != WHEEL_FORMAT:
        return (f"it is a kernel wheel of format {record.get('format')!r}, this dsagen reads format {WHEEL_FORMAT} "
                f"(rebuild it with this dsagen: dsagen pack --wheel)")
    if record.get("cuda_major") != CUDA_MAJOR:
        return (f"its kernels need CUDA {record.get('cuda_major')!r}, this dsagen's toolchain builds for CUDA "
                f"{CUDA_MAJOR} (rebuild it with this dsagen: dsagen pack --wheel)")
    return None


def _discover() -> tuple[InstalledCache, ...]:
    found: dict[Path, InstalledCache] = {}
    for ep in sorted(md.entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        dist = ep.dist
        label = f"{dist.metadata['Name']} {dist.version}" if dist is not None else ep.name
        module = ep.value.split(":", 1)[0].strip()
        pkg = _package_dir(module)
        root = pkg / CACHE_FOLDER if pkg is not None else None
        if root is None or not root.is_dir():
            _warn_once(f"{label}/{module}", f"dsagen: the installed kernel wheel {label} names the package "
                                            f"{module!r} in its {GROUP} entry point, but "
                                            f"{'that package is not installed' if pkg is None else f'{root} is not a folder'}"
                                            f"; it provides no kernels")
            continue
        problem = record_problem(pkg / RECORD_FILE)
        if problem is not None:
            _warn_once(f"{label}/{module}/record", f"dsagen: skipping the installed kernel wheel {label}: {problem}")
            continue
        root = root.resolve()
        if root not in found:
            found[root] = InstalledCache(root, label)
            _log.debug("kernel wheel %s: cache layer %s", label, root)
    return tuple(found.values())


def installed_caches() -> tuple[InstalledCache, ...]:
    """The cache folders of every installed kernel wheel, sorted by entry-point name; memoized per sys.path."""
    key = tuple(sys.path)
    with _memo_lock:
        hit = _memo.get(key)
        if hit is None:
            hit = _memo[key] = _discover()
    return hit


def forget() -> None:
    """Drop the memo (after installing or removing a wheel in a running process; tests)."""
    with _memo_lock:
        _memo.clear()


__all__ = ["GROUP", "CACHE_FOLDER", "RECORD_FILE", "WHEEL_FORMAT", "CUDA_MAJOR", "record_problem", "InstalledCache", "installed_caches", "forget"]
