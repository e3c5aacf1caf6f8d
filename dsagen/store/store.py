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
handed to the runtime. The threat model is in notes/design.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
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
from .hashing import canonical_json, key_of, sha256_hex
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
OWN_NAMES = frozenset({LAYOUT, "locks", "tmp", "quarantine", MARKER})
BUILD_TMP_PREFIX = "dsagen-build-"      # compile folders in the system temp dir: dsagen-build-<pid>-<random>
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


class CacheLockTimeout(DsagenError, TimeoutError):
    """Another process held a kernel's compile lock for longer than DSAGEN_LOCK_TIMEOUT."""


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


def remove_path(path: Path) -> bool:
    """Remove `path` without ever following a link: a link or file is unlinked, a real folder is removed
    with shutil.rmtree (which on this platform does not follow links inside). False if it was gone."""
    st = _lstat(path)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        assert shutil.rmtree.avoids_symlink_attacks, "shutil.rmtree must not follow links on this platform"
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return True


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


@contextlib.contextmanager
def replaced_when_written(out: Path) -> Iterator[Path]:
    """A temporary path beside `out` (`<name>.tmp-<pid>`) for the caller to write a whole file to: on a clean exit
    it is fsynced and renamed onto `out`, so readers see the old file or the complete new one; on an error it is
    removed and `out` is left as it was."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _staging_owner_gone(path: Path, max_age: float) -> bool:
    """Whether a staging folder of tmp/ belongs to no live build or unpack: its owner (host, pid in its
    name) is a process of this host that no longer exists, or (another host, or no owner in the name)
    it has not changed for `max_age` seconds. A live process of this host keeps its folder however old."""
    parts = path.name.rsplit(".", 3)
    st = _lstat(path)
    if st is None:
        return False
    age = time.time() - st.st_mtime
    pid = _parse_pid(parts[2]) if len(parts) == 4 else None
    if pid is not None and parts[1] == _HOST:
        return not _pid_alive(pid)
    return age > max_age


# ---- manifest schema and entry validity ---------------------------------------------------------------
def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise CacheCorruption(f"{path}: {what}")


def validate_manifest(m: Any, path: Path) -> dict:
    """Check that `m` is a manifest of the expected schema (types only); CacheCorruption otherwise."""
    _need(isinstance(m, dict), path, f"{MANIFEST} is not a JSON object")
    for name, kind in (("key", str), ("arch", str), ("op", str), ("identity", str), ("name", str),
                       ("spec", dict), ("key_material", dict), ("identity_material", dict),
                       ("toolchain", dict), ("artifacts", dict), ("kernel", dict)):
        _need(isinstance(m.get(name), kind), path, f"{MANIFEST} field {name!r} is missing or not a {kind.__name__}")
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
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CacheCorruption(f"{path}: {MANIFEST} is not JSON (or nested too deeply): {str(e)[:200]}") from None
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


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", v))


def candidate_order(manifest: dict, key: str, identity: str) -> tuple:
    """The sort key that picks among several valid entries answering to one identity in one layer:
    the entry built under that identity before one that only records it as an alias, then the newest
    toolchain (versions compared numerically, distribution by distribution), then the smallest key.
    Every field used is bound by the entry's key (so consistent), and `created` plays no part."""
    tc = manifest.get("toolchain") if isinstance(manifest.get("toolchain"), dict) else {}
    newest_first = tuple((d, tuple(-x for x in _version_tuple(str(v)))) for d, v in sorted(tc.items()))
    return (manifest.get("identity") != identity, newest_first, key)


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
        """The writable layer, after making sure its root is a dsagen cache: a new or empty folder (or
        one that holds only dsagen's own folders) gets the CACHEDIR.TAG marker; a folder holding anything
        else, or a root that is not a folder, is refused with CacheRootError. `create=False` leaves a
        missing root missing (prune)."""
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
            root.mkdir(parents=True, exist_ok=True)
        # another process may be marking the same new root right now: its temporary marker is ours too
        foreign = sorted(n for n in set(os.listdir(root)) - OWN_NAMES if not n.startswith(f".{MARKER}."))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CacheRootError(
                f"{root} ({env.CACHE_DIR.name}) is not a dsagen cache: it holds {shown} and no dsagen "
                f"{MARKER}; dsagen refuses to write or prune there. Point {env.CACHE_DIR.name} at a new "
                f"or empty folder.")
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
        replaced by a real folder, so nothing is ever written, renamed or deleted through a link."""
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
                    os.mkdir(p)
                if not _is_real_dir(p):
                    raise CacheRootError(f"{p}: cannot make a real folder there (another process races it)")
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

    def _load(self, layer: Layer, path: Path, expect: dict | None = None) -> Entry | None:
        if _lstat(path / MANIFEST) is None:
            return None  # absent, or a commit still in flight elsewhere: not visible
        try:
            _need(self.chain_is_real(layer, path), path, "reached through a link")
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
                        spec: dict | None = None) -> Entry | None:
        """A valid entry answering to this identity (and, when given, built by exactly this toolchain,
        and for exactly this canonical spec), searching read-only layers first. Within a layer the
        choice among several follows `candidate_order` (never `created`)."""
        for layer in self.layers:
            found = []
            for path in layer.entry_dirs(arch, op):
                try:
                    m = json.loads(_read_nofollow(path / MANIFEST, MAX_MANIFEST_BYTES))
                except (OSError, ValueError, RecursionError):
                    continue
                if not isinstance(m, dict) or identity not in entry_identities(m):
                    continue
                if toolchain is not None and m.get("toolchain") != toolchain:
                    continue
                found.append((candidate_order(m, path.name, identity), path))
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
        """A per-key inter-process lock in the writable root (filelock). timeout=0: try once."""
        import filelock  # imported here: only writers need it, and it is slow to import

        locks = self.own_dir("locks")
        path = locks / f"{key}.lock"
        if os.path.islink(path):
            remove_path(path)  # a planted link: filelock would refuse it (or open its target)
        lock = filelock.FileLock(str(path),
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
        layer = self.ensure_root()
        manifest = dict(manifest, key=key, arch=arch,
                        artifacts={n: {"size": len(b), "sha256": sha256_hex(b)} for n, b in sorted(files.items())})
        stage = self.own_dir("tmp") / staging_name(key)
        stage.mkdir()
        try:
            for name, data in files.items():
                _write_file(stage / name, data)
            _write_manifest(stage / MANIFEST, manifest)
            _fsync_dir(stage)
            final = self.place(stage, arch, op, key, "replaced by a fresh build")
        except BaseException:
            remove_path(stage)
            raise
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
              keep_generator: str | None = None, system_temp: bool = True) -> list[str]:
        """Clean the writable root and return what was removed:

        - tmp/ staging folders whose owner is gone (see `_staging_owner_gone`; a live build's or
          unpack's folder is never touched), quarantine/, and stray files, links and folders in v1/;
        - entries that are invalid, or built by another toolchain/generator (every entry with
          everything=True), each under its per-key lock taken without waiting (a key being built now
          is skipped);
        - with system_temp, compile folders `dsagen-build-<pid>-*` of dead processes of this user in
          the system temp folder.

        Links are removed as links, never followed. A root that is not a dsagen cache is refused."""
        layer = self._require_writable()
        if not layer.root.exists():
            return self._prune_system_temp() if system_temp else []
        self.ensure_root(create=False)
        removed = []
        max_age = max(env.LOCK_TIMEOUT.get(), 60.0)
        tmp, q = layer.root / "tmp", layer.root / "quarantine"
        for d, owned in ((tmp, True), (q, False)):
            if _lstat(d) is not None and not _is_real_dir(d):
                remove_path(d)  # a link or file where a folder belongs: the link goes, its target stays
                removed.append(str(d))
                continue
            for p in sorted(d.iterdir()) if _is_real_dir(d) else ():
                if owned and _is_real_dir(p) and not _staging_owner_gone(p, max_age):
                    continue
                if remove_path(p):
                    removed.append(str(p))
        for p in list(layer.strays()):
            if remove_path(p):
                removed.append(str(p))
        for n in sorted(os.listdir(layer.root)):  # marker temporaries of processes killed while marking
            parts = n.split(".")
            if (n.startswith(f".{MARKER}.") and len(parts) == 5 and (pid := _parse_pid(parts[3])) is not None
                    and not _pid_alive(pid) and remove_path(layer.root / n)):
                removed.append(str(layer.root / n))
        for path in list(layer.entry_dirs()):
            if self._prune_entry(layer, path, everything, keep_toolchain, keep_generator):
                removed.append(str(path))
        if system_temp:
            removed += self._prune_system_temp()
        return removed

    def _prune_entry(self, layer: Layer, path: Path, everything: bool, keep_toolchain, keep_generator) -> bool:
        def stale() -> bool:
            if everything:
                return True
            try:
                m = check_entry(path, self.verify_hashes)
            except CacheCorruption:
                return True
            km = m["key_material"]
            return ((keep_toolchain is not None and km.get("toolchain") != keep_toolchain)
                    or (keep_generator is not None and km.get("generator") != keep_generator))
        if not stale():
            return False
        try:
            with self.lock(path.name, timeout=0):
                if _lstat(path) is None or not stale():
                    return False
                if not self.chain_is_real(layer, path):
                    return False  # reached through a link: the link goes with the strays, never its target
                trash = self.own_dir("tmp") / staging_name(f"prune-{path.name}")
                os.replace(path, trash)  # the entry disappears at once; then its files go
                remove_path(trash)
                return True
        except CacheLockTimeout:
            return False  # being built right now: not stale for long
        except OSError as e:
            warnings.warn(f"dsagen prune: skipping {path}: {e}", stacklevel=3)
            return False

    @staticmethod
    def _prune_system_temp() -> list[str]:
        removed = []
        base = Path(tempfile.gettempdir())
        try:
            names = [n for n in os.listdir(base) if n.startswith(BUILD_TMP_PREFIX)]
        except OSError:
            return removed
        for n in sorted(names):
            p = base / n
            m = re.match(re.escape(BUILD_TMP_PREFIX) + r"([0-9]+)-", n)
            pid = _parse_pid(m.group(1)) if m else None
            st = _lstat(p)
            if (pid is None or st is None or not stat.S_ISDIR(st.st_mode)
                    or (hasattr(os, "getuid") and st.st_uid != os.getuid()) or _pid_alive(pid)):
                continue
            if remove_path(p):
                removed.append(str(p))
        return removed
