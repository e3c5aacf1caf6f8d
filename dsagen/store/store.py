"""The on-disk kernel cache: content-addressed entries in layers.

Layout of a root: `<root>/v1/<arch>/<op>/<key[:2]>/<key>/{manifest.json, kernel.py, kernel.cubin, kernel.ptx}`
plus `<root>/CACHEDIR.TAG` (the marker that makes a folder a dsagen cache), `locks/`, `tmp/` and
`quarantine/`.

Layers: the read-only roots of DSAGEN_CACHE_PATH are searched first, in order, then the caches of installed
kernel wheels (read-only; see installed.py), then the writable root DSAGEN_CACHE_DIR. Only the writable root
is ever written, and only once it carries the marker (an empty or new folder gets one; a folder holding
anything else is refused, see `ensure_root`).

Protocol: an entry is visible only once complete. Readers need no lock: an entry counts when it
passes `load_entry` (schema, self-consistent key and identity, folder and request agree, artifacts
of the recorded size and sha256). Writers take a per-key file lock, re-check, stage every file under
tmp/, fsync, write manifest.json last, and rename the staged folder into place. An entry that fails
the check is moved to quarantine/ (writable root) or skipped with a warning (read-only roots).

Filesystem safety: the tree is walked with lstat, never through a symbolic link; every delete
removes a link as a link; files are opened with O_NOFOLLOW; the bytes that were hashed are the bytes
handed to the runtime. Folders are made without group/other write whatever the umask, and an entry
below a folder (or holding a file) that another user can write or owns is never served. Staging and
compile folders are locked (flock) for as long as they exist, so prune tells a live one from a dead
one's leftovers even across PID namespaces and hosts. The threat model is in notes/design.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .. import env
from ..errors import CacheRootError, DsagenError
from ..kernel_record import is_str_keyed_dict, kernel_record_problem, kernel_record_sha256
from ..log import get_logger
from .hashing import canonical_json, key_of, loads_strict, sha256_hex
from .installed import InstalledCache, installed_caches

LAYOUT = "v1"
MANIFEST = "manifest.json"
MARKER = "CACHEDIR.TAG"
# the CACHEDIR.TAG convention (https://bford.info/cachedir/): backup tools skip such folders
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# This file is a dsagen kernel cache marker (dsagen writes, prunes and deletes only in\n"
               "# folders that carry it). See https://bford.info/cachedir/ for the tag itself.\n")
_MARKER_SIGNATURE = MARKER_TEXT.split("\n")[0].encode()
_MARKER_DSAGEN = b"dsagen kernel cache marker"
BUILD_TMP_PREFIX = "dsagen-build-"      # compile folders in the system temp dir: dsagen-build-<pid>-<random>
#: the name a locked folder has until it is locked (see `make_locked_dir`); prune clears such leftovers by age
PENDING_PREFIX = ".dsagen-new-"
MAX_MANIFEST_BYTES = 1 << 20
MAX_ARTIFACTS = 16
REQUIRED_ARTIFACTS = ("kernel.cubin",)  # what the runtime reads

_HEX64 = re.compile(r"[0-9a-f]{64}")
_ARCH = re.compile(r"sm_[0-9]+[a-z]?")
_OP = re.compile(r"[a-z][a-z0-9_]*")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST = socket.gethostname().replace(".", "_") or "host"
#: the one sub-folder an entry of an installed kernel wheel may hold: pip byte-compiles kernel.py at install
PYCACHE = "__pycache__"
_log = get_logger("store")
#: seconds a process waits on another one's per-key compile lock before it logs that it is waiting
LOCK_WAIT_WARN_AFTER = 1.0


class CacheLockTimeout(DsagenError, TimeoutError):
    """Another process held a kernel's compile lock for longer than DSAGEN_LOCK_TIMEOUT."""


class CacheLockPathError(DsagenError, OSError):
    """Something other than a regular file (a folder, a FIFO, ...) sits at a key's lock path, so the
    key cannot be locked; `dsagen prune` removes it."""


class CacheCorruption(DsagenError, RuntimeError):
    """An entry that is not a valid cache entry: unreadable or malformed manifest, files that do not
    match it, a key or identity that does not re-derive, or a folder that disagrees with it."""


@dataclass
class Entry:
    """A complete cache entry: its folder (None for an in-memory build), manifest and artifact bytes.

    For an entry loaded from disk, `blobs` holds the bytes that were checked (size, and sha256 unless
    DSAGEN_VERIFY=0); `read` hands out exactly those bytes, never a second read of the file."""

    path: Path | None
    manifest: dict
    layer: "Layer | None"
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.manifest["key"]

    def read(self, name: str) -> bytes:
        """The bytes of artifact `name` (e.g. "kernel.cubin"), as checked when the entry was loaded."""
        if name in self.blobs:
            return self.blobs[name]
        if self.path is None or name not in self.manifest.get("artifacts", {}):
            raise FileNotFoundError(f"{self.where()}: no artifact {name!r}")
        data = self.blobs[name] = _read_artifact(self.path, name, self.manifest["artifacts"][name], True)
        return data

    def where(self) -> str:
        return str(self.path) if self.path else "<in memory>"


# ---- filesystem primitives that never follow a link --------------------------------------------------
def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_real_dir(path: Path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _subdirs(path: Path) -> Iterator[Path]:
    """The real sub-folders of `path` (no links), sorted by name; nothing when `path` is not a real folder."""
    if not _is_real_dir(path):
        return
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return
    for n in names:
        yield path / n


def try_remove(path: Path) -> str | None:
    """Remove `path` without ever following a link: a link or file is unlinked, a real folder is removed
    with shutil.rmtree (which on this platform does not follow links inside). None when nothing is left
    at `path` afterwards (or nothing was there), else why something is (the first error met)."""
    st = _lstat(path)
    if st is None:
        return None
    errors: list[str] = []
    if stat.S_ISDIR(st.st_mode):
        assert shutil.rmtree.avoids_symlink_attacks, "shutil.rmtree must not follow links on this platform"
        shutil.rmtree(path, onerror=lambda fn, p, exc: errors.append(f"{p}: {exc[1]}"))
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(str(e))
    _release_dir_lock(path)  # a folder of this process that is gone is no longer live
    if _lstat(path) is None:
        return None
    return errors[0] if errors else "it is still there"


def remove_path(path: Path) -> bool:
    """Remove `path` as `try_remove` does; True when something was there and nothing is now."""
    return _lstat(path) is not None and try_remove(path) is None


# ---- folders made safe whatever the umask ------------------------------------------------------------
def _my_uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def foreign_write(st: os.stat_result) -> str | None:
    """Why a user other than this one (or root, who can do anything anyway) can change what a folder or
    file holds, or None: a group or other write bit, or another owner. A link's own mode means nothing
    (and entries never hold links: `load_entry` refuses them), so a link is never reported here."""
    if stat.S_ISLNK(st.st_mode):
        return None
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.filemode(st.st_mode)})"
    me = _my_uid()
    if me is not None and st.st_uid not in (me, 0):
        return f"owned by another user (uid {st.st_uid})"
    return None


def _restrict(path: Path) -> None:
    """Clear the group and other write bits of this user's folder `path` (opened without following a
    link, so a link swapped in never has its target changed). Folders of other owners are left as they
    are: `foreign_write` reports them."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o022 and st.st_uid == _my_uid():
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    finally:
        os.close(fd)


def make_dir(path: Path) -> None:
    """`os.mkdir(path)` (FileExistsError when something is there), then the group and other write bits
    cleared: a umask of 000 or 002 must not let other users plant entries."""
    os.mkdir(path)
    _restrict(path)


def make_dirs(path: Path) -> None:
    """Make `path` and every missing folder above it, each as `make_dir` does; existing ones are kept."""
    missing = []
    p = path
    while _lstat(p) is None:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            make_dir(p)
    if not _is_real_dir(path):
        raise NotADirectoryError(errno.ENOTDIR, "not a real folder", str(path))


# ---- liveness locks: a folder in use is locked for as long as it exists ---------------------------------
# A staging or compile folder is locked with flock on the folder itself, through a descriptor this process
# keeps open; the kernel drops the lock when the process dies. prune tries the lock without waiting, so a
# folder of a live process is never deleted even when the pid and host in its name mean nothing here
# (another PID namespace or host sharing the volume).
_held: dict[str, int] = {}          # folder path -> the descriptor that holds its lock
_held_guard = threading.Lock()


def make_locked_dir(path: Path, mode: int = 0o777) -> Path:
    """Make the folder `path` (mode `mode` less the umask, never group/other writable) and lock it for
    as long as it exists (see `dir_lock_held`). It is made and locked under a pending name and only
    then renamed to `path`, so no one ever sees `path` unlocked. The lock is let go when `remove_path`
    removes the folder or `release_dir_lock` is called (after the folder was renamed into place)."""
    _release_gone_locks()
    pending = path.parent / f"{PENDING_PREFIX}{uuid.uuid4().hex}"
    os.mkdir(pending, mode)
    try:
        fd = os.open(pending, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except BaseException:
        remove_path(pending)
        raise
    try:
        _restrict(pending)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # a filesystem without flock on folders: liveness rests on the name alone
            _log.debug("cannot lock %s (%s); prune falls back to its owner's pid and host", pending, e)
        if _lstat(path) is not None:  # a rename would replace an empty folder there: behave as mkdir does
            raise FileExistsError(errno.EEXIST, "already exists", str(path))
        os.rename(pending, path)
    except BaseException:
        os.close(fd)
        remove_path(pending)
        raise
    with _held_guard:
        _held[str(path)] = fd
    return path


def release_dir_lock(path: Path) -> None:
    """Let go of this process's lock on the folder made at `path` (it was renamed away or removed)."""
    _release_dir_lock(path)


def _release_dir_lock(path: Path) -> None:
    with _held_guard:
        fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def _release_gone_locks() -> None:
    """Let go of the locks of folders that are no longer where they were made (removed, or renamed
    into place by a caller that did not release them)."""
    with _held_guard:
        items = list(_held.items())
    for p, fd in items:
        st = _lstat(Path(p))
        try:
            same = st is not None and os.path.samestat(st, os.fstat(fd))
        except OSError:
            same = False
        if not same:
            _release_dir_lock(Path(p))


def dir_lock_held(path: Path) -> bool | None:
    """Whether a live process holds the liveness lock of folder `path`: True (held: in use), False
    (free: its owner let go or died), None (cannot tell: not a real folder, or no flock here)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing lets go of the lock taken just now
    return False


@contextlib.contextmanager
def build_dir() -> Iterator[Path]:
    """A private compile folder `dsagen-build-<pid>-<random>` in the system temp folder, locked while it
    exists (see `make_locked_dir`) and removed on exit."""
    base = Path(tempfile.gettempdir())
    path = make_locked_dir(base / f"{BUILD_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}", 0o700)
    try:
        yield path
    finally:
        remove_path(path)


def _read_nofollow(path: Path, limit: int | None = None) -> bytes:
    """A regular file's bytes, refusing links (O_NOFOLLOW) and anything longer than `limit`."""
    # O_NONBLOCK: a FIFO planted where a file belongs opens at once (then fails the regular-file check)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if limit is not None and st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit + 1)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_manifest(path: Path, manifest: dict) -> None:
    _write_file(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def staging_name(prefix: str) -> str:
    """A staging folder name that records its owner: `<prefix>.<host>.<pid>.<random>`."""
    return f"{prefix}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _parse_pid(text: str) -> int | None:
    """A process id written by dsagen (ASCII digits, 1 .. 2**22), or None for anything else."""
    if not re.fullmatch(r"[0-9]{1,7}", text):
        return None
    pid = int(text)
    return pid if 0 < pid <= 1 << 22 else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _staging_gone(path: Path, max_age: float) -> bool:
    """Whether prune may remove the staging folder `path` of tmp/: its liveness lock is not held (a held
    lock is a live build or unpack, whatever the pid and host in its name say here) and, as a second
    check for folders made without the lock, its owner is gone by `_staging_owner_gone`."""
    return dir_lock_held(path) is not True and _staging_owner_gone(path, max_age)


def _staging_owner_gone(path: Path, max_age: float) -> bool:
    """Whether the owner named in a staging folder's name is gone: a process of this host (host, pid in
    the name) that no longer exists, or (another host, or no owner in the name) a folder that has not
    changed for `max_age` seconds. A live process of this host keeps its folder however old."""
    parts = path.name.rsplit(".", 3)
    st = _lstat(path)
    if st is None:
        return False
    age = time.time() - st.st_mtime
    pid = _parse_pid(parts[2]) if len(parts) == 4 else None
    if pid is not None and parts[1] == _HOST:
        return not _pid_alive(pid)
    return age > max_age


def _check_lock_path(path: Path) -> None:
    """CacheLockPathError when something other than a regular file sits at the lock path `path`."""
    st = _lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else f"of type {stat.filemode(st.st_mode)[0]!r}"
        raise CacheLockPathError(f"the lock path {path} is not a file ({kind}), so the kernel cannot be locked "
                                 f"for a build; `dsagen prune` removes it")


# ---- manifest schema and entry validity ---------------------------------------------------------------
def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise CacheCorruption(f"{path}: {what}")


def _non_finite(v: Any) -> str | None:
    """Where `v` (parsed JSON) holds a float that is NaN or infinite (which JSON cannot write), or None.
    Walked with a stack, not recursion: a deeply nested value must not overflow the interpreter's."""
    stack: list[tuple[str, Any]] = [("", v)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return where or "the value"
        if isinstance(x, dict):
            stack.extend((f"{where}.{k}", y) for k, y in x.items())
        elif isinstance(x, list):
            stack.extend((f"{where}[{i}]", y) for i, y in enumerate(x))
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


#: every manifest field and the check of its type (the kernel record and artifacts are checked in detail below)
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "key": (lambda v: isinstance(v, str), "a string"),
    "arch": (lambda v: isinstance(v, str), "a string"),
    "op": (lambda v: isinstance(v, str), "a string"),
    "identity": (lambda v: isinstance(v, str), "a string"),
    "name": (lambda v: isinstance(v, str), "a string"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "kernel_sha256": (lambda v: isinstance(v, str), "a string"),
    "schema": (_is_int, "an integer"),
    "compile_seconds": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "spec": (is_str_keyed_dict, "an object"),
    "key_material": (is_str_keyed_dict, "an object"),
    "identity_material": (is_str_keyed_dict, "an object"),
    "toolchain": (lambda v: is_str_keyed_dict(v) and all(isinstance(x, str) for x in v.values()),
                  "an object of version strings"),
    "artifacts": (is_str_keyed_dict, "an object"),
    "kernel": (is_str_keyed_dict, "an object"),
}


def validate_manifest(m: Any, path: Path) -> dict:
    """Check that `m` is a manifest of the expected schema (the type of every field, and no NaN or
    infinite number anywhere, which `dsagen list --json` could not print as JSON); CacheCorruption
    otherwise."""
    _need(isinstance(m, dict), path, f"{MANIFEST} is not a JSON object")
    for name, (ok, kind) in _FIELD_TYPES.items():
        _need(name in m and ok(m[name]), path, f"{MANIFEST} field {name!r} is missing or not {kind}")
    bad = _non_finite(m)
    _need(bad is None, path, f"{MANIFEST} holds a number that is NaN or infinite at {bad}")
    _need(bool(_HEX64.fullmatch(m["key"])), path, "manifest key is not 64 hex digits")
    _need(bool(_HEX64.fullmatch(m["identity"])), path, "manifest identity is not 64 hex digits")
    aliases = m.get("aliases", [])
    _need(isinstance(aliases, list) and all(isinstance(a, str) and _HEX64.fullmatch(a) for a in aliases),
          path, "manifest aliases are not a list of 64-hex identities")
    for name, art in m["artifacts"].items():
        _need(isinstance(name, str) and bool(_FILE.fullmatch(name)) and name != MANIFEST, path,
              f"artifact name {name!r} is not a plain file name")
        _need(is_str_keyed_dict(art) and isinstance(art.get("size"), int) and not isinstance(art["size"], bool)
              and art["size"] >= 0 and isinstance(art.get("sha256"), str) and bool(_HEX64.fullmatch(art["sha256"])),
              path, f"artifact {name!r} has no valid size and sha256")
    _need(len(m["artifacts"]) <= MAX_ARTIFACTS, path, f"more than {MAX_ARTIFACTS} artifacts")
    for name in REQUIRED_ARTIFACTS:
        _need(name in m["artifacts"], path, f"the manifest does not list {name}")
    _need(isinstance(m.get("kernel_sha256"), str) and m["kernel_sha256"] == kernel_record_sha256(m["kernel"]),
          path, "the kernel record does not match its kernel_sha256")
    problem = kernel_record_problem(m["kernel"])
    _need(problem is None, path, f"the manifest's kernel record is malformed: {problem}")
    return m


def _check_consistency(m: dict, path: Path) -> None:
    """Key and identity re-derive from their materials; the materials agree with the manifest."""
    km, im = m["key_material"], m["identity_material"]
    try:
        key = key_of(km)
        identity = sha256_hex(canonical_json(im))
    except (TypeError, ValueError, RecursionError) as e:
        raise CacheCorruption(f"{path}: key or identity material cannot be hashed: {str(e)[:200]}") from None
    _need(key == m["key"], path, "the key does not re-derive from its key material")
    _need(identity == m["identity"], path, "the identity does not re-derive from its identity material")
    for mat, what in ((km, "key"), (im, "identity")):
        for f in ("op", "arch", "spec"):
            _need(mat.get(f) == m[f], path, f"{what} material {f} {mat.get(f)!r} != manifest {f} {m[f]!r}")
    _need(km.get("toolchain") == m["toolchain"], path, "key material toolchain != manifest toolchain")
    _need(m["spec"].get("op") == m["op"], path, "the spec's op != the manifest op")
    src = m["artifacts"].get("kernel.py")
    _need(src is None or src["sha256"] == km.get("source_sha256"), path,
          "kernel.py's sha256 != the key material's source_sha256")


def validate_entry_manifest(m: Any, path: Path) -> dict:
    """Check a parsed manifest against the entry folder `path` (`v1/<arch>/<op>/<key[:2]>/<key>`, which
    need not exist: a pack member's folder): schema, folder agreement, key and identity re-derivation."""
    parts = entry_parts(path)
    _need(parts is not None, path, "not an entry folder (v1/<arch>/<op>/<key[:2]>/<key>)")
    validate_manifest(m, path)
    arch, op, key = parts
    _need(m["key"] == key, path, f"manifest key {m['key'][:12]}... does not match the folder")
    _need(m["arch"] == arch, path, f"manifest arch {m['arch']!r} does not match the folder")
    _need(m["op"] == op, path, f"manifest op {m['op']!r} does not match the folder")
    _check_consistency(m, path)
    return m


def entry_parts(path: Path) -> tuple[str, str, str] | None:
    """(arch, op, key) of an entry folder `.../v1/<arch>/<op>/<key[:2]>/<key>`, or None when the names
    do not have that shape."""
    key, shard, op, arch = path.name, path.parent.name, path.parents[1].name, path.parents[2].name
    if (_HEX64.fullmatch(key) and shard == key[:2] and _OP.fullmatch(op) and _ARCH.fullmatch(arch)
            and path.parents[3].name == LAYOUT):
        return arch, op, key
    return None


def _read_artifact(path: Path, name: str, art: dict, verify_hash: bool) -> bytes:
    try:
        data = _read_nofollow(path / name, limit=art["size"])
    except FileNotFoundError:
        raise CacheCorruption(f"{path}: artifact {name} is missing") from None
    except OSError as e:
        raise CacheCorruption(f"{path}: artifact {name} is not a readable regular file: {e}") from None
    _need(len(data) == art["size"], path, f"{name} has {len(data)}{'+' if len(data) > art['size'] else ''} bytes, "
          f"manifest says {art['size']}")
    _need(not verify_hash or sha256_hex(data) == art["sha256"], path, f"{name} sha256 does not match the manifest")
    return data


def load_entry(path: Path, verify_hashes: bool = True, expect: dict | None = None,
               read: tuple[str, ...] | None = None, bytecode_ok: bool = False) -> tuple[dict, dict[str, bytes]]:
    """(manifest, checked artifact bytes) of the entry folder `path`; CacheCorruption unless it is valid.

    Valid: a real folder (no link) named `v1/<arch>/<op>/<key[:2]>/<key>` holding only regular files;
    a manifest of the expected schema that lists every file the runtime reads; a key and an identity
    that re-derive from their materials; op, arch and key equal to the folder's (and to `expect`, a
    dict of manifest fields such as {"spec": ..., "op": ..., "arch": ...}); every artifact of the
    recorded size and (with verify_hashes) sha256. `read` names the artifacts whose bytes are returned
    (default: all that were hashed, or only kernel.cubin when hashes are not checked). `bytecode_ok` (the
    layer of an installed kernel wheel) lets the folder also hold a real `__pycache__` folder, which pip
    writes when it byte-compiles kernel.py; nothing in it is ever read."""
    parts = entry_parts(path)
    _need(parts is not None, path, "not an entry folder (v1/<arch>/<op>/<key[:2]>/<key>)")
    _need(_is_real_dir(path), path, "the entry is not a real folder (a link or a file)")
    try:
        with os.scandir(path) as it:
            odd = [e.name for e in it if not e.is_file(follow_symlinks=False)
                   and not (bytecode_ok and e.name == PYCACHE and e.is_dir(follow_symlinks=False))]
    except OSError as e:
        raise CacheCorruption(f"{path}: unreadable entry folder: {e}") from None
    _need(not odd, path, f"the entry holds links or sub-folders: {sorted(odd)}")
    try:
        raw = _read_nofollow(path / MANIFEST, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CacheCorruption(f"{path}: no {MANIFEST}") from None
    except OSError as e:
        raise CacheCorruption(f"{path}: unreadable {MANIFEST}: {e}") from None
    try:
        m = loads_strict(raw)
    except (ValueError, RecursionError) as e:
        raise CacheCorruption(f"{path}: {MANIFEST} is not JSON (or holds NaN or Infinity, or is nested too "
                              f"deeply): {str(e)[:200]}") from None
    validate_entry_manifest(m, path)
    for f, want in (expect or {}).items():
        _need(m.get(f) == want, path, f"manifest {f} {m.get(f)!r} is not the requested {want!r}")
    if read is not None:
        wanted = set(read)
    else:
        wanted = set(m["artifacts"]) if verify_hashes else set(REQUIRED_ARTIFACTS)
    blobs = {}
    for name, art in sorted(m["artifacts"].items()):
        try:
            size = os.lstat(path / name).st_size
        except FileNotFoundError:
            raise CacheCorruption(f"{path}: artifact {name} is missing") from None
        _need(size == art["size"], path, f"{name} has {size} bytes, manifest says {art['size']}")
        if verify_hashes or name in wanted:
            data = _read_artifact(path, name, art, verify_hashes)
            if name in wanted:
                blobs[name] = data
    return m, blobs


def check_entry(path: Path, verify_hashes: bool = True, bytecode_ok: bool = False) -> dict:
    """The manifest of the entry at `path` after checking it is a valid entry (see `load_entry`)."""
    return load_entry(path, verify_hashes, read=(), bytecode_ok=bytecode_ok)[0]


def entry_identities(manifest: dict) -> set[str]:
    """Every identity an entry answers to: the one it was built under plus any recorded `aliases`."""
    ids = set(a for a in manifest.get("aliases", []) if isinstance(a, str))
    if isinstance(manifest.get("identity"), str):
        ids.add(manifest["identity"])
    return ids


def candidate_order(manifest: dict, key: str, identity: str, prefer_toolchain: dict | None = None) -> tuple:
    """The sort key that picks among several valid entries answering to one identity in one layer: an
    exact match first (built by `prefer_toolchain`, the toolchain installed here, when given; then built
    under that identity rather than only listing it in `aliases`), then the smallest key.

    What an entry declares about itself (a newer toolchain, a later `created`) never moves it forward:
    an entry planted next to the real one could declare anything. The key only makes the choice
    deterministic (a sha256 can be ground for a small value, so it rewards nothing an entry claims;
    keeping other users' entries out is the folder permission check's job, see `path_problem`)."""
    exact_toolchain = prefer_toolchain is not None and manifest.get("toolchain") == prefer_toolchain
    return (not exact_toolchain, manifest.get("identity") != identity, key)


# ---- layers and the store -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One cache root and whether dsagen may write to it; `primary` for the DSAGEN_CACHE_DIR root (writable
    or, under DSAGEN_CACHE=ro, not), `wheel` the installed kernel wheel it comes from ("name version")."""

    root: Path
    writable: bool
    wheel: str | None = None
    primary: bool = False

    @property
    def origin(self) -> str:
        """Where the layer comes from: "DSAGEN_CACHE_DIR", "DSAGEN_CACHE_PATH" or "wheel <name> <version>"."""
        if self.wheel is not None:
            return f"wheel {self.wheel}"
        return env.CACHE_DIR.name if self.primary else env.CACHE_PATH.name

    @property
    def bytecode_ok(self) -> bool:
        """Whether entries may hold pip's `__pycache__` folder (the layer of an installed kernel wheel)."""
        return self.wheel is not None

    def entry_dir(self, arch: str, op: str, key: str) -> Path:
        return self.root / LAYOUT / arch / op / key[:2] / key

    def entry_dirs(self, arch: str | None = None, op: str | None = None) -> Iterator[Path]:
        """Every entry-shaped folder of this layer, walked without following links; stray files, links
        and badly named folders are skipped (see `strays`)."""
        for a in _subdirs(self.root / LAYOUT):
            if (arch and a.name != arch) or not _ARCH.fullmatch(a.name):
                continue
            for o in _subdirs(a):
                if (op and o.name != op) or not _OP.fullmatch(o.name):
                    continue
                for shard in _subdirs(o):
                    for p in _subdirs(shard):
                        if entry_parts(p) is not None:
                            yield p

    def strays(self) -> Iterator[Path]:
        """What sits in the v1/ tree but is not part of its shape: files, links, badly named folders."""
        def walk(d: Path, depth: int) -> Iterator[Path]:
            try:
                with os.scandir(d) as it:
                    items = sorted(it, key=lambda e: e.name)
            except OSError:
                return
            for e in items:
                p = Path(e.path)
                if not e.is_dir(follow_symlinks=False):
                    if depth < 4:
                        yield p
                    continue
                ok = ((depth == 0 and _ARCH.fullmatch(e.name)) or (depth == 1 and _OP.fullmatch(e.name))
                      or (depth == 2 and re.fullmatch(r"[0-9a-f]{2}", e.name))
                      or (depth == 3 and entry_parts(p) is not None))
                if not ok:
                    yield p
                elif depth < 3:
                    yield from walk(p, depth + 1)
        if _is_real_dir(self.root / LAYOUT):
            yield from walk(self.root / LAYOUT, 0)

    def misfiled(self) -> Iterator[Path]:
        """The stray folders (see `strays`) that hold a cache entry, or are one: a key folder under the wrong
        shard (`<key[:2]>` that is not its key's), or an entry below a badly named arch, op or shard folder.
        Lookups never find these and prune removes them, so `dsagen verify` reports them; an empty or
        unrelated stray folder is left to prune alone."""
        for p in self.strays():
            if _is_real_dir(p) and _holds_entry(p, depth=4):
                yield p


def _holds_entry(path: Path, depth: int) -> bool:
    """Whether the real folder `path`, or one below it at most `depth` levels down (links not followed), is
    named like a cache key or holds a manifest.json."""
    if _HEX64.fullmatch(path.name) or _lstat(path / MANIFEST) is not None:
        return True
    return depth > 0 and any(_holds_entry(d, depth - 1) for d in _subdirs(path))


_warned_roots: set[str] = set()


def _warn_once(root: Path, msg: str) -> None:
    if str(root) not in _warned_roots:
        _warned_roots.add(str(root))
        warnings.warn(msg, stacklevel=4)


def _check_permissions(root: Path) -> None:
    """Warn when a cache root exists and other users can write it (they could then plant kernels)."""
    st = _lstat(root)
    if st is None:
        return
    try:
        st = os.stat(root)
    except OSError:
        return
    if st.st_mode & 0o022 or (hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0)):
        _warn_once(root, f"dsagen: the cache root {root} is writable by, or owned by, another user "
                         f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); anyone who can write it can "
                         f"plant kernels this process will run. Restrict it: chmod go-w {root}")


def _absolute(p: Path, var: str, warn: bool) -> Path:
    p = Path(p).expanduser()
    if not p.is_absolute():
        p2 = Path(os.path.abspath(p))
        if warn:
            warnings.warn(f"dsagen: {var} entry {str(p)!r} is relative; using {p2}", stacklevel=4)
        p = p2
    return p


class CacheStore:
    """The layered cache. `CacheStore.from_env()` builds it from the DSAGEN_CACHE* variables."""

    def __init__(self, writable_root: Path | None, readonly_roots: list[Path] = (), mode: str = "rw",
                 verify_hashes: bool = True, wheel_caches: tuple[InstalledCache, ...] = ()):
        if mode not in ("rw", "ro", "off"):
            raise ValueError(f"mode={mode!r}: expected rw, ro or off")
        self.mode = mode
        self.verify_hashes = verify_hashes
        layers = [] if mode == "off" else [Layer(Path(r), False) for r in readonly_roots]
        if mode != "off":
            known = {layer.root for layer in layers} | ({Path(writable_root)} if writable_root is not None else set())
            layers += [Layer(c.root, False, wheel=c.dist) for c in wheel_caches if c.root not in known]
        self.writable: Layer | None = None
        if mode != "off" and writable_root is not None:
            self.writable = Layer(Path(writable_root), mode == "rw", primary=True)
            layers.append(self.writable)
        self.layers: list[Layer] = layers

    @classmethod
    def from_env(cls) -> "CacheStore":
        """The store of DSAGEN_CACHE_DIR, DSAGEN_CACHE_PATH, DSAGEN_CACHE, DSAGEN_VERIFY and the installed kernel
        wheels (unless DSAGEN_WHEEL_CACHES=0; installed.py).

        An empty DSAGEN_CACHE_DIR is an error (never the current folder); relative paths are made
        absolute (DSAGEN_CACHE_PATH entries with a warning); roots other users can write are warned about."""
        raw = os.environ.get(env.CACHE_DIR.name)
        if raw is not None and not raw.strip():
            raise CacheRootError(f"{env.CACHE_DIR.name} is set but empty; unset it for the default "
                                 f"({env.CACHE_DIR.default()}) or give a folder")
        root = _absolute(env.CACHE_DIR.get(), env.CACHE_DIR.name, warn=False)
        ro = [_absolute(p, env.CACHE_PATH.name, warn=True) for p in env.CACHE_PATH.get()]
        for p in ro:
            if os.path.lexists(p) and not p.is_dir():
                _warn_once(p, f"dsagen: {env.CACHE_PATH.name} entry {p} is not a folder; it holds no kernels")
        wheels = installed_caches() if env.WHEEL_CACHES.get() else ()
        store = cls(root, ro, env.CACHE_MODE.get(), env.VERIFY.get(), wheel_caches=wheels)
        for layer in store.layers:
            _check_permissions(layer.root)
        return store

    # ---- the root marker --------------------------------------------------------------------------
    def ensure_root(self, create: bool = True) -> Layer:
        """The writable layer, after making sure its root is a dsagen cache: one dsagen marked, or a new or
        empty folder, which gets the CACHEDIR.TAG marker. A folder holding anything else is refused with
        CacheRootError, even one holding only folders named like dsagen's (tmp/, v1/, ...): a user's
        folder can have those names, and prune would delete what they hold. A root that is not a folder
        is refused too. `create=False` leaves a missing root missing (prune)."""
        layer = self._require_writable()
        root = layer.root
        marker = root / MARKER

        def marked() -> bool:
            """Whether the root carries dsagen's marker (the CACHEDIR.TAG signature and dsagen's line)."""
            try:
                text = _read_nofollow(marker, 4096)
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError as e:
                raise CacheRootError(f"{root}: unreadable cache marker {MARKER}: {e}") from None
            return text.startswith(_MARKER_SIGNATURE) and _MARKER_DSAGEN in text

        if marked():
            return layer
        if root.exists() and not root.is_dir():
            raise CacheRootError(f"the cache root {root} ({env.CACHE_DIR.name}) is not a folder")
        if not root.exists():
            if not create:
                return layer
            make_dirs(root)
        # another process may be marking the same new root right now: its temporary marker is ours too,
        # and a marker that is there is judged below (ours, written since, or another tool's)
        foreign = sorted(n for n in os.listdir(root) if n != MARKER and not n.startswith(f".{MARKER}."))
        if foreign and not marked():  # not marked: still not, after another process may have marked it
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            theirs = f"a {MARKER} that is not dsagen's" if os.path.lexists(marker) else f"no dsagen {MARKER}"
            raise CacheRootError(
                f"{root} ({env.CACHE_DIR.name}) is not a dsagen cache: it holds {shown} and {theirs}; dsagen "
                f"refuses to write or prune there (it takes only a folder it marked, or an empty one). "
                f"Point {env.CACHE_DIR.name} at a new or empty folder.")
        if foreign:
            return layer
        tmp = root / f".{MARKER}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            _write_file(tmp, MARKER_TEXT.encode())
            with contextlib.suppress(FileExistsError):  # create-if-absent: a marker is never replaced
                os.link(tmp, marker)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if not marked():  # there was one already (ours, written by another process since, or not ours)
            raise CacheRootError(f"{root} ({env.CACHE_DIR.name}) is not a dsagen cache: it holds a {MARKER} "
                                 f"that is not dsagen's; dsagen refuses to write or prune there")
        return layer

    def own_dir(self, *parts: str) -> Path:
        """The folder `<writable root>/<parts...>` as a real folder, created where missing. A link or file
        found at any level below the root is removed (as a link: its target is never touched) and
        replaced by a real folder, so nothing is ever written, renamed or deleted through a link. Every
        level is left without group/other write (whatever the umask); one that another user owns is
        refused (CacheRootError)."""
        layer = self.ensure_root()
        p = layer.root
        for part in parts:
            p = p / part
            st = _lstat(p)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                remove_path(p)
                st = None
            if st is None:
                with contextlib.suppress(FileExistsError):
                    make_dir(p)
            if not _is_real_dir(p):
                raise CacheRootError(f"{p}: cannot make a real folder there (another process races it)")
            _restrict(p)  # a folder left group-writable by an earlier umask is made safe again
            unsafe = foreign_write(os.lstat(p))
            if unsafe is not None:
                raise CacheRootError(f"{p}: the cache folder is {unsafe}; dsagen does not write into a folder "
                                     f"another user can change (entries there would not be served)")
        return p

    # ---- reading ----------------------------------------------------------------------------------
    def chain_is_real(self, layer: Layer, path: Path) -> bool:
        """Whether every folder from the layer's v1/ down to `path` is a real folder (no link)."""
        rel = path.relative_to(layer.root)
        p = layer.root
        for part in rel.parts:
            p = p / part
            if not _is_real_dir(p):
                return False
        return True

    @staticmethod
    def path_problem(layer: Layer, path: Path) -> tuple[Path, str] | None:
        """(folder or file, why) when another user could have planted or could swap the entry at `path`:
        a folder from the layer's v1/ down to the entry, or a file in it, that is writable by others or
        owned by another user (see `foreign_write`); None when there is none. The root itself is only
        warned about (`from_env`): whoever can write it can at most swap in a v1/ of their own, which
        they own and this check refuses."""
        p = layer.root
        for part in path.relative_to(layer.root).parts:
            p = p / part
            st = _lstat(p)
            why = foreign_write(st) if st is not None else None
            if why is not None:
                return p, why
        try:
            with os.scandir(path) as it:
                files = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)
        except OSError:
            return None  # load_entry reports an unreadable folder
        for name, st in files:
            why = foreign_write(st)
            if why is not None:
                return path / name, why
        return None

    def _load(self, layer: Layer, path: Path, expect: dict | None = None) -> Entry | None:
        if _lstat(path / MANIFEST) is None:
            return None  # absent, or a commit still in flight elsewhere: not visible
        try:
            _need(self.chain_is_real(layer, path), path, "reached through a link")
            problem = self.path_problem(layer, path)
            if problem is not None:
                # skipped, never quarantined, in every layer: the entry's bytes are not what is wrong, and
                # moving things around in a folder another user controls is a race with that user
                where, why = problem
                _warn_once(where, f"dsagen: not serving the cache entries at or below {where}: it is {why}, "
                                  f"so another user could have planted them. Restrict it (chmod go-w, or "
                                  f"chown to yourself), or `dsagen prune` and rebuild")
                return None
            m, blobs = load_entry(path, self.verify_hashes, expect=expect, bytecode_ok=layer.bytecode_ok)
            _log.debug("loaded entry %s (%s) from %s", m.get("name"), path.name[:12], layer.origin)
            return Entry(path, m, layer, blobs)
        except CacheCorruption as e:
            if layer.writable:
                self.quarantine(path, str(e))
            else:
                warnings.warn(f"dsagen: skipping corrupt entry in read-only cache layer: {e}", stacklevel=3)
            return None

    def lookup(self, arch: str, op: str, key: str, expect: dict | None = None) -> Entry | None:
        """The valid entry with this exact key, searching read-only layers first. `expect` (manifest
        fields such as the spec) must match too; an entry that does not is corrupt for this request."""
        for layer in self.layers:
            e = self._load(layer, layer.entry_dir(arch, op, key), dict(expect or {}, arch=arch, op=op))
            if e is not None:
                return e
        return None

    def lookup_identity(self, arch: str, op: str, identity: str, toolchain: dict | None = None,
                        spec: dict | None = None, prefer_toolchain: dict | None = None) -> Entry | None:
        """A valid entry answering to this identity (and, when given, built by exactly `toolchain`, and
        for exactly this canonical spec), searching read-only layers first. Within a layer the choice
        among several follows `candidate_order`: an entry built by `prefer_toolchain` (the toolchain
        installed here, for a lookup that accepts any) first, never by what an entry declares."""
        for layer in self.layers:
            found = []
            for path in layer.entry_dirs(arch, op):
                try:
                    m = loads_strict(_read_nofollow(path / MANIFEST, MAX_MANIFEST_BYTES))
                except (OSError, ValueError, RecursionError):
                    continue
                if not isinstance(m, dict) or identity not in entry_identities(m):
                    continue
                if toolchain is not None and m.get("toolchain") != toolchain:
                    continue
                found.append((candidate_order(m, path.name, identity, prefer_toolchain), path))
            expect = {} if spec is None else {"spec": spec}
            for _, path in sorted(found, key=lambda t: t[0]):
                e = self._load(layer, path, expect)
                if e is not None and identity in entry_identities(e.manifest) and (
                        toolchain is None or e.manifest["toolchain"] == toolchain):
                    return e
        return None

    def entries(self) -> Iterator[tuple[Layer, Path]]:
        """(layer, entry folder) for every entry-shaped folder in every layer (valid or not)."""
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
        """A per-key inter-process lock in the writable root (filelock). timeout=0: try once.
        CacheLockPathError when something other than a file sits at the lock path."""
        import filelock  # imported here: only writers need it, and it is slow to import

        locks = self.own_dir("locks")
        path = locks / f"{key}.lock"
        if os.path.islink(path):
            remove_path(path)  # a planted link: filelock would refuse it (or open its target)
        _check_lock_path(path)
        lock = filelock.FileLock(str(path),
                                 timeout=env.LOCK_TIMEOUT.get() if timeout is None else timeout)
        try:
            self._acquire(lock, key)
        except filelock.Timeout as e:
            raise CacheLockTimeout(f"timed out waiting for {e.lock_file}") from None
        except IsADirectoryError:  # a folder made there since the check
            _check_lock_path(path)
            raise
        try:
            yield
        finally:
            lock.release()

    @staticmethod
    def _acquire(lock, key: str) -> None:
        """Take `lock` within its timeout; a wait longer than LOCK_WAIT_WARN_AFTER seconds logs one WARNING first
        (the key and the lock path), so that a process stalled behind another one's compile says why."""
        import filelock

        total = lock.timeout
        if total <= LOCK_WAIT_WARN_AFTER:  # a try without waiting (prune), or a short wait: nothing to explain
            lock.acquire()
            return
        t0 = time.monotonic()
        try:
            lock.acquire(timeout=LOCK_WAIT_WARN_AFTER)
            return
        except filelock.Timeout:
            pass
        _log.warning("waiting for the compile lock of key %s (%s): another process is compiling it; "
                     "waiting up to %.0fs (DSAGEN_LOCK_TIMEOUT)", key, lock.lock_file, total)
        lock.acquire(timeout=max(0.0, total - (time.monotonic() - t0)))

    def commit(self, arch: str, op: str, key: str, files: dict[str, bytes], manifest: dict) -> Entry:
        """Atomically publish an entry: stage files in tmp/, fsync, manifest last, rename into place.

        `manifest` gets `key`, `arch` and `artifacts` (size + sha256 of each file) filled in here.
        Call under `lock(key)`.
        """
        layer = self.ensure_root()
        manifest = dict(manifest, key=key, arch=arch,
                        artifacts={n: {"size": len(b), "sha256": sha256_hex(b)} for n, b in sorted(files.items())})
        stage = make_locked_dir(self.own_dir("tmp") / staging_name(key))
        try:
            for name, data in files.items():
                _write_file(stage / name, data)
            _write_manifest(stage / MANIFEST, manifest)
            _fsync_dir(stage)
            final = self.place(stage, arch, op, key, "replaced by a fresh build")
        except BaseException:
            remove_path(stage)
            raise
        finally:
            release_dir_lock(stage)  # renamed into place or removed: no longer a staging folder
        return Entry(final, manifest, layer, dict(files))

    def place(self, staged: Path, arch: str, op: str, key: str, why: str) -> Path:
        """Rename the complete folder `staged` into the entry path of (arch, op, key) in the writable root
        (call under `lock(key)`). Whatever sits there is invalid (the caller checked): a real folder is
        quarantined, a link or file removed as such. Every folder on the way is a real one (`own_dir`)."""
        layer = self._require_writable()
        parent = self.own_dir(LAYOUT, arch, op, key[:2])
        final = parent / key
        st = _lstat(final)
        if st is not None:
            if not stat.S_ISDIR(st.st_mode) or self.quarantine(final, why) is None:
                remove_path(final)
        os.replace(staged, final)
        _fsync_dir(parent)
        assert final == layer.entry_dir(arch, op, key)
        return final

    def add_identity(self, entry: Entry, identity: str) -> Entry:
        """Record one more identity for an existing entry of the writable root (call under `lock(key)`).

        A template edit that leaves a spec's rendered source unchanged keeps the cache key but changes
        the identity (computed from the template files); the entry then answers to both. The manifest
        is replaced atomically, so readers see the old or the new one, never a partial file."""
        layer = self.ensure_root()
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
        """Move a bad entry of the writable root out of the way (kept for inspection). Returns where it
        went, or None when it could not be moved (another process moved it first, the root is read-only
        or full, or not a dsagen cache): the caller then treats the entry as absent."""
        layer = self.writable
        if layer is None or not layer.writable:
            return None
        if not _is_real_dir(path) or not self.chain_is_real(layer, path.parent):
            warnings.warn(f"dsagen: not quarantining {path}: it is, or is reached through, a link ({reason})",
                          stacklevel=3)
            return None
        try:
            dest = self.own_dir("quarantine") / f"{path.name}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
            os.replace(path, dest)
        except FileNotFoundError:
            return None  # someone else moved it first
        except (OSError, CacheRootError) as e:
            warnings.warn(f"dsagen: cannot quarantine the bad cache entry {path} ({e}); skipping it: {reason}",
                          stacklevel=3)
            return None
        with contextlib.suppress(OSError):
            _write_file(dest / "QUARANTINE_REASON", (reason + "\n").encode())
        warnings.warn(f"dsagen: quarantined cache entry {path.name}: {reason}", stacklevel=3)
        return dest

    def prune(self, *, everything: bool = False, keep_toolchain: dict | None = None,
              keep_generator: str | None = None, system_temp: bool = True) -> "PruneResult":
        """Clean the writable root; returns what was removed (only what is really gone), with `failed`
        listing what prune meant to remove but could not, and why:

        - tmp/ staging folders no live process uses (see `_staging_gone`: a folder whose liveness lock
          is held is never touched, whatever its name says), quarantine/, stray files, links and folders
          in v1/, and anything but a regular file at a lock path in locks/;
        - entries that are invalid, that another user could have planted (see `path_problem`), or built
          by another toolchain/generator (every entry with everything=True), each under its per-key lock
          taken without waiting (a key being built now is skipped);
        - with system_temp, compile folders `dsagen-build-<pid>-*` of this user that no live process
          uses (see `_prune_system_temp`).

        Links are removed as links, never followed. A root that is not a dsagen cache is refused."""
        layer = self._require_writable()
        result = PruneResult()
        if not layer.root.exists():
            if system_temp:
                self._prune_system_temp(result)
            return result
        self.ensure_root(create=False)
        max_age = max(env.LOCK_TIMEOUT.get(), 60.0)
        for name in ("tmp", "quarantine", "locks"):
            d = layer.root / name
            if _lstat(d) is not None and not _is_real_dir(d):
                result.drop(d)  # a link or file where a folder belongs: the link goes, its target stays
                continue
            for p in sorted(d.iterdir()) if _is_real_dir(d) else ():
                if self._prune_keeps(name, p, max_age):
                    continue
                result.drop(p)
        for p in list(layer.strays()):
            result.drop(p)
        for n in sorted(os.listdir(layer.root)):  # marker temporaries of processes killed while marking
            parts = n.split(".")
            if (n.startswith(f".{MARKER}.") and len(parts) == 5 and (pid := _parse_pid(parts[3])) is not None
                    and not _pid_alive(pid)):
                result.drop(layer.root / n)
        for path in list(layer.entry_dirs()):
            self._prune_entry(layer, path, everything, keep_toolchain, keep_generator, result)
        if system_temp:
            self._prune_system_temp(result)
        return result

    @staticmethod
    def _prune_keeps(folder: str, p: Path, max_age: float) -> bool:
        """Whether prune keeps `p`, an item of the root's tmp/, quarantine/ or locks/ folder: a staging
        folder still in use (tmp/), a regular lock file (locks/; a lock of a key being built is one)."""
        if folder == "tmp":
            return _is_real_dir(p) and not _staging_gone(p, max_age)
        if folder == "locks":
            st = _lstat(p)
            return st is None or stat.S_ISREG(st.st_mode)
        return False

    def _prune_entry(self, layer: Layer, path: Path, everything: bool, keep_toolchain, keep_generator,
                     result: "PruneResult") -> None:
        def stale() -> bool:
            if everything or self.path_problem(layer, path) is not None:
                return True
            try:
                m = check_entry(path, self.verify_hashes)
            except CacheCorruption:
                return True
            km = m["key_material"]
            return ((keep_toolchain is not None and km.get("toolchain") != keep_toolchain)
                    or (keep_generator is not None and km.get("generator") != keep_generator))
        if not stale():
            return
        try:
            with self.lock(path.name, timeout=0):
                if _lstat(path) is None or not stale():
                    return
                if not self.chain_is_real(layer, path):
                    return  # reached through a link: the link goes with the strays, never its target
                trash = self.own_dir("tmp") / staging_name(f"prune-{path.name}")
                os.replace(path, trash)  # the entry disappears at once; then its files go
        except CacheLockTimeout:
            return  # being built right now: not stale for long
        except (OSError, CacheRootError) as e:
            result.failed.append((str(path), str(e)))
            return
        why = try_remove(trash)
        if why is None:
            result.append(str(path))
        else:
            result.failed.append((str(path), f"moved to {trash}, where it could not all be removed: {why}"))

    @staticmethod
    def _prune_system_temp(result: "PruneResult") -> None:
        """Remove this user's compile folders in the system temp folder that no live process uses: the
        liveness lock is not held and the pid in the name (`dsagen-build-<pid>-*`) is no live process
        here. Folders left under their pending name (killed between making and locking one) go once
        they are older than the lock timeout."""
        base = Path(tempfile.gettempdir())
        try:
            names = [n for n in os.listdir(base) if n.startswith((BUILD_TMP_PREFIX, PENDING_PREFIX))]
        except OSError:
            return
        max_age = max(env.LOCK_TIMEOUT.get(), 60.0)
        for n in sorted(names):
            p = base / n
            st = _lstat(p)
            if (st is None or not stat.S_ISDIR(st.st_mode)
                    or (hasattr(os, "getuid") and st.st_uid != os.getuid()) or dir_lock_held(p) is True):
                continue
            if n.startswith(PENDING_PREFIX):
                if time.time() - st.st_mtime > max_age:
                    result.drop(p)
                continue
            m = re.match(re.escape(BUILD_TMP_PREFIX) + r"([0-9]+)-", n)
            pid = _parse_pid(m.group(1)) if m else None
            if pid is not None and not _pid_alive(pid):
                result.drop(p)


class PruneResult(list):
    """What `CacheStore.prune` removed: the list of paths that are gone now; `failed` holds (path, why)
    for each path it meant to remove but could not (a read-only root, a folder of another user)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[str, str]] = []

    def drop(self, path: Path) -> None:
        """Remove `path` (never following a link) and record how that went."""
        if _lstat(path) is None:
            return
        why = try_remove(path)
        if why is None:
            self.append(str(path))
        else:
            self.failed.append((str(path), why))
