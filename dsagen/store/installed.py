"""Caches shipped as Python packages: kernel wheels (`dsagen pack --wheel`) found with no environment variable.

A kernel wheel installs a package `<pkg>/` holding the cache tree `<pkg>/cache/v1/...` and declares the entry
point `<pkg> = <pkg>` in the group `dsagen.caches`. `installed_caches()` reads that group from the installed
distributions' metadata and locates each named package's `cache/` folder with `importlib.util.find_spec` on
its top-level name, which imports nothing: no code of an installed wheel runs. The store adds every folder
found as a read-only layer after the DSAGEN_CACHE_PATH roots (DSAGEN_WHEEL_CACHES=0 turns this off); its
entries pass the same `load_entry` checks as any other layer's.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..log import get_logger

GROUP = "dsagen.caches"
CACHE_FOLDER = "cache"

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


__all__ = ["GROUP", "CACHE_FOLDER", "InstalledCache", "installed_caches", "forget"]
