"""The on-disk kernel cache: content-addressed entries in layers.

Layout of a root: `<root>/v1/<arch>/<op>/<key[:2]>/<key>/{manifest.json, kernel.py, kernel.cubin, kernel.ptx}`
plus `<root>/locks/`, `<root>/tmp/` and `<root>/quarantine/`.

Layers: the read-only roots of DSAGEN_CACHE_PATH are searched first, in order, then the writable root
DSAGEN_CACHE_DIR. Only the writable root is ever written.

Protocol: an entry is visible only once complete. Readers need no lock: an entry counts when its
manifest parses, names its own key and arch, and every artifact has the recorded size and sha256.
Writers take a per-key file lock, re-check, stage every file under tmp/, fsync, write manifest.json
last, and rename the staged folder into place. An entry that fails the check is moved to quarantine/
(writable root) or skipped with a warning (read-only roots).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .. import env
from .keys import sha256_hex

LAYOUT = "v1"
MANIFEST = "manifest.json"


class CacheLockTimeout(TimeoutError):
    """Another process held a kernel's compile lock for longer than DSAGEN_LOCK_TIMEOUT."""


class CacheCorruption(RuntimeError):
    """An entry whose files do not match its manifest."""


@dataclass
class Entry:
    """A complete cache entry: its folder (None for an in-memory build), manifest and artifact bytes."""

    path: Path | None
    manifest: dict
    layer: "Layer | None"
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.manifest["key"]

    def read(self, name: str) -> bytes:
        """The bytes of artifact `name` (e.g. "kernel.cubin")."""
        if name in self.blobs:
            return self.blobs[name]
        if self.path is None:
            raise FileNotFoundError(name)
        return (self.path / name).read_bytes()

    def where(self) -> str:
        return str(self.path) if self.path else "<in memory>"


@dataclass(frozen=True)
class Layer:
    """One cache root and whether dsagen may write to it."""

    root: Path
    writable: bool

    def entry_dir(self, arch: str, op: str, key: str) -> Path:
        return self.root / LAYOUT / arch / op / key[:2] / key

    def entry_dirs(self, arch: str | None = None, op: str | None = None) -> Iterator[Path]:
        base = self.root / LAYOUT
        for a in sorted(base.iterdir()) if base.is_dir() else ():
            if arch and a.name != arch:
                continue
            for o in sorted(a.iterdir()):
                if op and o.name != op:
                    continue
                for shard in sorted(o.iterdir()):
                    yield from sorted(p for p in shard.iterdir() if p.is_dir())


def entry_identities(manifest: dict) -> set[str]:
    """Every identity an entry answers to: the one it was built under plus any recorded `aliases`."""
    ids = set(manifest.get("aliases", []))
    if manifest.get("identity"):
        ids.add(manifest["identity"])
    return ids


def check_entry(path: Path, verify_hashes: bool = True) -> dict:
    """The manifest of the entry at `path` after checking it is complete; CacheCorruption otherwise."""
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CacheCorruption(f"{path}: no {MANIFEST}") from None
    except (OSError, ValueError) as e:
        raise CacheCorruption(f"{path}: unreadable {MANIFEST}: {e}") from None
    if manifest.get("key") != path.name:
        raise CacheCorruption(f"{path}: manifest key {manifest.get('key')!r} does not match the folder")
    if manifest.get("arch") != path.parents[2].name:
        raise CacheCorruption(f"{path}: manifest arch {manifest.get('arch')!r} does not match the folder")
    for name, art in manifest.get("artifacts", {}).items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CacheCorruption(f"{path}: artifact {name} is missing") from None
        if size != art["size"]:
            raise CacheCorruption(f"{path}: {name} has {size} bytes, manifest says {art['size']}")
        if verify_hashes and sha256_hex(f.read_bytes()) != art["sha256"]:
            raise CacheCorruption(f"{path}: {name} sha256 does not match the manifest")
    return manifest


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CacheStore:
    """The layered cache. `CacheStore.from_env()` builds it from the DSAGEN_CACHE* variables."""

    def __init__(self, writable_root: Path | None, readonly_roots: list[Path] = (), mode: str = "rw",
                 verify_hashes: bool = True):
        if mode not in ("rw", "ro", "off"):
            raise ValueError(f"mode={mode!r}: expected rw, ro or off")
        self.mode = mode
        self.verify_hashes = verify_hashes
        layers = [] if mode == "off" else [Layer(Path(r), False) for r in readonly_roots]
        self.writable: Layer | None = None
        if mode != "off" and writable_root is not None:
            self.writable = Layer(Path(writable_root), mode == "rw")
            layers.append(self.writable)
        self.layers: list[Layer] = layers

    @classmethod
    def from_env(cls) -> "CacheStore":
        return cls(env.CACHE_DIR.get(), env.CACHE_PATH.get(), env.CACHE_MODE.get(), env.VERIFY.get())

    # ---- reading ----------------------------------------------------------------------------------
    def _load(self, layer: Layer, path: Path) -> Entry | None:
        if not (path / MANIFEST).exists():
            return None  # absent, or a commit still in flight elsewhere: not visible
        try:
            return Entry(path, check_entry(path, self.verify_hashes), layer)
        except CacheCorruption as e:
            if layer.writable:
                self.quarantine(path, str(e))
            else:
                warnings.warn(f"dsagen: skipping corrupt entry in read-only cache layer: {e}", stacklevel=3)
            return None

    def lookup(self, arch: str, op: str, key: str) -> Entry | None:
        """The complete entry with this exact key, searching read-only layers first."""
        for layer in self.layers:
            e = self._load(layer, layer.entry_dir(arch, op, key))
            if e is not None:
                return e
        return None

    def lookup_identity(self, arch: str, op: str, identity: str,
                        toolchain: dict | None = None) -> Entry | None:
        """A complete entry with this identity (and, when given, built by exactly this toolchain),
        searching read-only layers first and taking the newest within a layer."""
        for layer in self.layers:
            found = []
            for path in layer.entry_dirs(arch, op):
                try:
                    m = json.loads((path / MANIFEST).read_text())
                except (OSError, ValueError):
                    continue
                if identity in entry_identities(m) and (toolchain is None or m.get("toolchain") == toolchain):
                    found.append((m.get("created", ""), path))
            for _, path in sorted(found, reverse=True):
                e = self._load(layer, path)
                if e is not None:
                    return e
        return None

    def entries(self) -> Iterator[tuple[Layer, Path]]:
        """(layer, entry folder) for every entry folder in every layer (complete or not)."""
        for layer in self.layers:
            for path in layer.entry_dirs():
                yield layer, path

    # ---- writing ----------------------------------------------------------------------------------
    def _require_writable(self) -> Layer:
        if self.writable is None or not self.writable.writable:
            raise PermissionError(f"the cache is not writable (DSAGEN_CACHE={self.mode})")
        return self.writable

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None):
        """A per-key inter-process lock in the writable root (filelock)."""
        import filelock  # imported here: only writers need it, and it is slow to import

        layer = self._require_writable()
        locks = layer.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(locks / f"{key}.lock"),
                                 timeout=env.LOCK_TIMEOUT.get() if timeout is None else timeout)
        try:
            lock.acquire()
        except filelock.Timeout as e:
            raise CacheLockTimeout(f"timed out waiting for {e.lock_file}") from None
        try:
            yield
        finally:
            lock.release()

    def commit(self, arch: str, op: str, key: str, files: dict[str, bytes], manifest: dict) -> Entry:
        """Atomically publish an entry: stage files in tmp/, fsync, manifest last, rename into place.

        `manifest` gets `key`, `arch` and `artifacts` (size + sha256 of each file) filled in here.
        Call under `lock(key)`.
        """
        layer = self._require_writable()
        manifest = dict(manifest, key=key, arch=arch,
                        artifacts={n: {"size": len(b), "sha256": sha256_hex(b)} for n, b in sorted(files.items())})
        tmp = layer.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        stage = tmp / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        try:
            for name, data in files.items():
                _write_file(stage / name, data)
            _write_manifest(stage / MANIFEST, manifest)
            _fsync_dir(stage)
            final = layer.entry_dir(arch, op, key)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # incomplete or corrupt leftovers; a complete one was found by the re-check
                self.quarantine(final, "replaced by a fresh build")
            os.replace(stage, final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        return Entry(final, manifest, layer)

    def add_identity(self, entry: Entry, identity: str) -> Entry:
        """Record one more identity for an existing entry of the writable root (call under `lock(key)`).

        A template edit that leaves a spec's rendered source unchanged keeps the cache key but changes
        the identity (computed from the template files); the entry then answers to both. The manifest
        is replaced atomically, so readers see the old or the new one, never a partial file."""
        layer = self._require_writable()
        if entry.layer is not layer or entry.path is None:
            raise ValueError(f"{entry.path}: only entries of the writable root can be given a new identity")
        if identity in entry_identities(entry.manifest):
            return entry
        manifest = dict(entry.manifest, aliases=sorted(set(entry.manifest.get("aliases", [])) | {identity}))
        tmp = entry.path / f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            _write_manifest(tmp, manifest)
            os.replace(tmp, entry.path / MANIFEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(entry.path)
        return Entry(entry.path, manifest, layer, entry.blobs)

    def quarantine(self, path: Path, reason: str) -> Path | None:
        """Move a bad entry of the writable root out of the way (kept for inspection)."""
        layer = self.writable
        if layer is None or not layer.writable:
            return None
        q = layer.root / "quarantine"
        q.mkdir(parents=True, exist_ok=True)
        dest = q / f"{path.name}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            return None  # someone else moved it first
        (dest / "QUARANTINE_REASON").write_text(reason + "\n")
        warnings.warn(f"dsagen: quarantined cache entry {path.name}: {reason}", stacklevel=3)
        return dest

    def prune(self, *, everything: bool = False, keep_toolchain: dict | None = None,
              keep_generator: str | None = None) -> list[str]:
        """Clean the writable root: staging leftovers, quarantine, and entries that are incomplete or
        built by another toolchain/generator (all entries with everything=True). Returns what was removed."""
        layer = self._require_writable()
        removed = []
        for sub in ("tmp", "quarantine"):
            d = layer.root / sub
            for p in sorted(d.iterdir()) if d.is_dir() else ():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
        for path in list(layer.entry_dirs()):
            stale = everything
            try:
                m = check_entry(path, self.verify_hashes)
                if keep_toolchain is not None and m.get("key_material", {}).get("toolchain") != keep_toolchain:
                    stale = True
                if keep_generator is not None and m.get("key_material", {}).get("generator") != keep_generator:
                    stale = True
            except CacheCorruption:
                stale = True
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
        return removed


def _write_manifest(path: Path, manifest: dict) -> None:
    _write_file(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
