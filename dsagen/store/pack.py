"""Ship a cache: `pack` writes every valid entry of the layers into one tar with a checksum list;
`unpack` verifies the whole pack before it adds anything to the writable root.

A pack holds the entries `shippable_entries` yields (every valid entry of DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH
that the `Selection` selects, without kernel.ptx unless kept; an installed kernel wheel's entries ship as that
wheel), compressed as the output's suffix says (`compression_of`; reproducible: fixed times, gzip mtime 0). It is a plain tar of regular files
`v1/<arch>/<op>/<key[:2]>/<key>/<file>` (exactly an entry's
manifest.json and the artifacts it lists) plus `PACK-CHECKSUMS.json` (sha256 of every member), so it
also extracts with `tar` into a tree that DSAGEN_CACHE_PATH can point at.

`pack` is atomic: it writes a new file of a random name beside FILE (created exclusively, never through a
link) and renames it onto FILE; a FILE that is a link is refused. `unpack` is all-or-nothing for the
checks and atomic per entry for the writes: a first streaming pass checks every member (names, types,
sizes against the caps, checksums, every entry's manifest, key and artifacts) without writing
anything; a second pass streams the members into one staging folder under the cache's tmp/, checking
each against the first pass; then each entry is moved into place with one rename under its per-key
lock. An unpack interrupted during the renames leaves a subset of complete entries (rerun it to add
the rest); a failed one leaves no staging behind (a killed one leaves it to `dsagen prune`). Entries
already present and valid are kept. Members are never read whole into memory, except manifests and
the checksum list (each at most 1 MiB).

The tar stream is read by dsagen's own reader (`_next_header`), not by `tarfile`: it reads exactly what
`pack` writes (regular files in POSIX headers, each with at most one PAX header of at most 4 KiB that
holds only its path; gzip, bzip2 or xz around it) and refuses every other header from its first 512
bytes, before reading anything that header announces (GNU long names, sparse maps, Solaris and global
headers, links, folders, devices). So no header makes unpack allocate more than a few KiB, and the
bytes both passes read are the ones the checks saw (one decompressor, chosen by the file's first bytes).

What a pack is trusted with: unpacking runs nothing, and a bad pack (not a tar, a bad checksum list,
traversal, links, devices, headers of any kind `pack` does not write, oversized or extra members, an
invalid entry) is one PackError that leaves the cache as it was. But the kernels inside a well-formed
pack are run as they are: unpack packs only from sources you would take code from (notes/design.md,
threat model).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import secrets
import tarfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator, NamedTuple

from ..errors import ConfigError, DsagenError
from ..log import get_logger
from .store import (LAYOUT, MANIFEST, MAX_MANIFEST_BYTES, PYCACHE, CacheCorruption, CacheLockTimeout, CacheStore,
                    _read_nofollow, entry_parts, load_entry, make_dirs, make_locked_dir, remove_path,
                    staging_name, validate_entry_manifest)

_log = get_logger("store")

CHECKSUMS = "PACK-CHECKSUMS.json"
PTX = "kernel.ptx"                # kept for inspection only: no runtime path reads it, so packs drop it by default
# the compressions pack writes, by the output file's suffix (longest first: ".tar.gz" before ".tar")
COMPRESSION_SUFFIXES = ((".tar.gz", "gzip"), (".tgz", "gzip"), (".tar.xz", "xz"), (".tar.bz2", "bzip2"),
                        (".tar", "plain"))
MAX_MEMBER_BYTES = 256 << 20      # one artifact (the largest PTX of today's kernels is a few MiB)
MAX_TOTAL_BYTES = 4 << 30         # a whole pack, unpacked
MAX_MEMBERS = 100_000
MAX_PAX_BYTES = 4096              # one PAX header: pack writes one path record of under 300 bytes
_CHUNK = 1 << 20
_READ = 1 << 16                   # compressed bytes read from a pack file at a time
_XZ_MEMLIMIT = 80 << 20           # xz -9's decoder needs 65 MiB; a stream that asks for more is refused
# the names of a pack's members; every part is bounded (a name no file system stores would fail halfway
# through the copy)
_MEMBER = re.compile(LAYOUT + r"/sm_[0-9]{2,4}[a-z]?/[a-z][a-z0-9_]{0,63}/[0-9a-f]{2}/[0-9a-f]{64}/"
                     r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_USTAR = b"ustar\x0000"           # magic and version of a POSIX (ustar, pax) header: the only format pack writes
_REGULAR = (b"0", b"\0")
_PAX = b"x"
_PAX_KEYS = (b"path",)            # the one PAX keyword pack writes (for names over 100 characters)
_TYPES = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
          b"5": "a folder", b"6": "a FIFO", b"7": "a contiguous file", b"g": "a global PAX header",
          b"X": "a Solaris extended header", b"L": "a GNU long name", b"K": "a GNU long link name",
          b"S": "a GNU sparse file", b"D": "a GNU dump folder", b"M": "a GNU multi-volume part",
          b"N": "an old GNU long name", b"V": "a GNU volume label"}
# the compressions a pack may come in: first bytes -> (name, a new decompressor of one stream)
_COMPRESSIONS = {
    b"\x1f\x8b\x08": ("gzip", lambda: zlib.decompressobj(31)),
    b"BZh": ("bzip2", bz2.BZ2Decompressor),
    b"\xfd7zXZ\x00": ("xz", lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=_XZ_MEMLIMIT)),
}


class PackError(DsagenError, ValueError):
    """A pack file that is malformed, unsafe, over the size caps, or does not match its checksums."""


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0o644, 0, 0, 0, "", ""
    return info


@dataclass(frozen=True)
class Selection:
    """Which entries a pack or a wheel ships: those of one of `ops`, one of `arches` and (op, spec) one of
    `specs` (canonical spec JSON), each None for "any". `described` is the selection as the user gave it
    (command-line options), for the error when nothing matches."""

    ops: frozenset[str] | None = None
    arches: frozenset[str] | None = None
    specs: frozenset[str] | None = None
    described: str = ""

    def matches(self, m: dict) -> bool:
        """Whether the (validated) manifest `m` is selected."""
        return ((self.ops is None or m["op"] in self.ops)
                and (self.arches is None or m["arch"] in self.arches)
                and (self.specs is None or _spec_json(m["spec"]) in self.specs))

    @property
    def everything(self) -> bool:
        """True when nothing narrows the selection."""
        return self.ops is None and self.arches is None and self.specs is None


def _spec_json(spec: dict) -> str:
    """A canonical spec dict as compact key-sorted JSON: the form `KernelSpec.canonical_json` writes, so a
    manifest's spec and a spec object compare as strings."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def _without_ptx(m: dict, files: dict[str, bytes]) -> tuple[dict, dict[str, bytes]]:
    """The entry without its PTX: the artifact dropped from the file set and from the manifest's artifact list.
    The entry stays valid: the runtime reads only kernel.cubin (REQUIRED_ARTIFACTS), and the key and identity
    hash their materials, not the artifact list."""
    if PTX not in m["artifacts"]:
        return m, files
    m = dict(m, artifacts={n: a for n, a in m["artifacts"].items() if n != PTX})
    return m, {n: b for n, b in files.items() if n != PTX}


def shippable_entries(store: CacheStore, what: str = "pack", select: Selection | None = None,
                      keep_ptx: bool = True) -> Iterator[tuple[str, dict, dict[str, bytes]]]:
    """(entry folder relative to its root, manifest, {file name: bytes}) of every valid entry of the store's
    DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH layers (the first layer wins per key) that `select` selects, fully
    hash-checked; the files are exactly the manifest and the artifacts it lists. Without `keep_ptx` the PTX is
    left out (`_without_ptx`, the manifest rewritten and checked again). Invalid entries (see `load_entry`:
    links, sub-folders, bad manifests, bad hashes) are skipped with a warning naming `what`, and nothing is read
    through a link. Entries of installed kernel wheels are not shipped again (they ship as their wheel)."""
    seen: set[str] = set()
    for layer, path in store.entries():
        if path.name in seen or layer.wheel is not None:
            continue
        try:
            if not store.chain_is_real(layer, path):
                raise CacheCorruption(f"{path}: reached through a link")
            m, blobs = load_entry(path, verify_hashes=True)
        except CacheCorruption as e:
            warnings.warn(f"dsagen {what}: skipping an invalid entry: {e}", stacklevel=3)
            continue  # never ship a bad entry
        seen.add(path.name)
        if select is not None and not select.matches(m):
            continue
        files = dict(blobs)
        if not keep_ptx:
            m, files = _without_ptx(m, files)
            validate_entry_manifest(m, path)  # what unpack and load_entry will check: never ship what they refuse
        files[MANIFEST] = (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()
        yield path.relative_to(layer.root).as_posix(), m, files


def nothing_selected(select: Selection | None, what: str) -> ConfigError:
    """The error for a selection that matches no entry, naming the selection (or, with none, the layers)."""
    if select is None or select.everything:
        return ConfigError(f"nothing to {what}: the cache layers hold no valid entry "
                           f"(build kernels first, e.g. dsagen build --preset deepseek-v3.2)")
    return ConfigError(f"nothing to {what}: no valid entry of the cache layers matches {select.described}")


def checksums_problems(root: Path, sums: object, bytecode_ok: bool = False) -> list[str]:
    """What is wrong with the cache tree `root` against the checksum list `sums` ({relative path: sha256} of
    every file of every entry, as PACK-CHECKSUMS.json holds): files missing, extra or with another sha256.
    [] when the tree is exactly what the list says. Read without following links; with `bytecode_ok` (an
    installed kernel wheel) a `__pycache__` folder inside an entry is not counted."""
    if not (isinstance(sums, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items())):
        return [f"{root / CHECKSUMS}: not an object of sha256 strings"]
    present: dict[str, Path] = {}
    layer_root = Path(root)
    base = layer_root / LAYOUT
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False) if base.is_dir() else ():
        if bytecode_ok and PYCACHE in dirnames and entry_parts(Path(dirpath)) is not None:
            dirnames.remove(PYCACHE)
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / n
            present[p.relative_to(layer_root).as_posix()] = p
    problems = [f"{name}: listed in {CHECKSUMS} but missing" for name in sorted(set(sums) - set(present))]
    problems += [f"{name}: not listed in {CHECKSUMS}" for name in sorted(set(present) - set(sums))]
    for name in sorted(set(sums) & set(present)):
        try:
            data = _read_nofollow(present[name])
        except OSError as e:
            problems.append(f"{name}: unreadable ({e})")
            continue
        if hashlib.sha256(data).hexdigest() != sums[name]:
            problems.append(f"{name}: does not match its checksum")
    return problems


@contextlib.contextmanager
def replacing_file(out: Path) -> Iterator[BinaryIO]:
    """A new file beside `out`, open for writing, that replaces `out` once the caller has written it whole: on
    a clean exit it is fsynced and renamed onto `out` (readers see the old file or the complete new one); on an
    error it is removed and `out` is left as it was. `pack` and `pack --wheel` write through this.

    The temporary file is created exclusively, never through a link, under a fresh random name, so nothing
    planted beside `out` is ever written to. An `out` that is a link is refused (PackError naming --out): the
    rename would replace the link rather than write where it points, which is not what its owner meant."""
    out = Path(out)
    if out.is_symlink():
        raise PackError(f"--out {out}: is a link; dsagen writes a pack or a wheel only as a file of its own "
                        f"(remove the link or give another path)")
    fd, tmp = _exclusive_temp(out)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _exclusive_temp(out: Path) -> tuple[int, Path]:
    """(descriptor, path) of a new empty file `.<out's name>.<16 random hex digits>.tmp` beside `out`, created
    with O_CREAT|O_EXCL|O_NOFOLLOW (an existing file or link of that name is never opened) and the mode a file
    `open` creates (0o666 less the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = out.with_name(f".{out.name[:100]}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue  # taken by chance, or planted: draw another name
    raise PackError(f"--out {out}: could not create a temporary file beside it")


def compression_of(out: Path) -> str:
    """The compression `pack` writes `out` with, by its suffix (COMPRESSION_SUFFIXES); ConfigError naming --out
    for any other suffix (a pack named .zip or .tar.zst that is a plain tar would mislead whoever reads it)."""
    name = Path(out).name.lower()
    for suffix, kind in COMPRESSION_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return kind
    raise ConfigError(f"--out {out}: a pack's name ends with "
                      f"{', '.join(s for s, _ in COMPRESSION_SUFFIXES)} (the suffix picks the compression)")


@contextlib.contextmanager
def _compressed(f: BinaryIO, kind: str) -> Iterator[BinaryIO]:
    """A writer that compresses into `f` as `kind` and is finished (trailer written, `f` left open) on exit. The
    output depends only on the bytes written: gzip records mtime 0 and no file name, bzip2 and xz record
    neither."""
    if kind == "plain":
        yield f
        return
    if kind == "gzip":
        z: BinaryIO = gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0)
    elif kind == "xz":
        z = lzma.LZMAFile(f, "wb", format=lzma.FORMAT_XZ, preset=6)  # its decoder fits under _XZ_MEMLIMIT
    else:
        z = bz2.BZ2File(f, "wb")
    with z:
        yield z


def pack(store: CacheStore, out: Path, select: Selection | None = None, keep_ptx: bool = False) -> int:
    """Write every valid entry of the configured layers that `select` selects (`shippable_entries`; without
    `keep_ptx`, without PTX) into the tar `out`, compressed as its suffix says (`compression_of`), through
    `replacing_file`; returns the count. ConfigError, leaving `out` as it was, when a selection matches
    nothing."""
    out = Path(out)
    kind = compression_of(out)
    sums: dict[str, str] = {}
    n = 0
    with replacing_file(out) as f, _compressed(f, kind) as z, \
            tarfile.open(fileobj=z, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, _m, files in shippable_entries(store, "pack", select, keep_ptx):
            n += 1
            for name in sorted(files):
                data = files[name]
                sums[f"{rel}/{name}"] = hashlib.sha256(data).hexdigest()
                tar.addfile(_tar_info(f"{rel}/{name}", len(data)), io.BytesIO(data))
        if not n and select is not None and not select.everything:
            raise nothing_selected(select, "pack")
        blob = json.dumps(sums, indent=1, sort_keys=True).encode()
        tar.addfile(_tar_info(CHECKSUMS, len(blob)), io.BytesIO(blob))
    _log.info("packed %d entries into %s (%s)", n, out, kind)
    return n


def _stream(src, size: int, sink=None) -> str:
    """sha256 of `size` bytes read from `src` in chunks, each also written to `sink` when given."""
    h = hashlib.sha256()
    left = size
    while left:
        chunk = src.read(min(_CHUNK, left))
        if not chunk:
            raise PackError("truncated member data")
        h.update(chunk)
        if sink is not None:
            sink.write(chunk)
        left -= len(chunk)
    return h.hexdigest()


class _PackStream:
    """The tar bytes of a pack file as one forward-only stream, gzip, bzip2 or xz undone: what the checks
    read is what the copy reads (both passes of `unpack` read the file only through this). The format is
    decided once, by the file's first bytes; a compressed stream may be followed by more streams of the
    same format (as pigz and pbzip2 write them, and as gzip -d, bzip2 -d and xz -d read them), anything
    else after a stream's end is refused. Memory stays bounded however much a compressed chunk inflates:
    at most `_CHUNK` bytes are decompressed beyond what a read asked for."""

    def __init__(self, file: Path):
        self.file = file
        self.pos = 0                             # bytes of the tar stream handed out so far
        self._f = open(file, "rb")
        self._pending = self._f.read(_READ)      # compressed bytes not yet given to the decompressor
        self._out = bytearray()                  # decompressed bytes not yet handed out
        self._magic, self._kind, self._new = next(
            ((magic, kind, new) for magic, (kind, new) in _COMPRESSIONS.items() if self._pending.startswith(magic)),
            (b"", "plain", None))
        self._d = self._new() if self._new else None

    def __enter__(self) -> "_PackStream":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def read(self, n: int) -> bytes:
        """The next `n` bytes of the tar stream, fewer only at its end."""
        while len(self._out) < n and self._fill():
            pass
        data = bytes(self._out[:n])
        del self._out[:n]
        self.pos += len(data)
        return data

    def _input(self) -> bytes:
        data, self._pending = self._pending or self._f.read(_READ), b""
        return data

    def _fill(self) -> bool:
        """Append the next piece of the stream to `_out`; False at the end of the data."""
        if self._d is None:
            data = self._input()
            self._out += data
            return bool(data)
        try:
            if self._d.eof:
                return self._next_stream(self._d.unused_data)
            self._out += self._inflate()
            return True
        except (zlib.error, OSError, EOFError, lzma.LZMAError) as e:
            raise PackError(f"{self.file}: not a readable {self._kind} stream ({e})") from None

    def _inflate(self) -> bytes:
        """At most `_CHUNK` more bytes out of the current compressed stream."""
        d = self._d
        if self._kind == "gzip":
            data = d.unconsumed_tail or self._input()   # zlib keeps the input it could not inflate yet
        else:
            data = self._input() if d.needs_input else b""
        if not data and (self._kind == "gzip" or d.needs_input):
            raise PackError(f"{self.file}: the {self._kind} stream is cut short")
        return d.decompress(data, _CHUNK)

    def _next_stream(self, rest: bytes) -> bool:
        """After a compressed stream's end: start the next stream of the same format, or report the end of
        the data; PackError for anything else (bytes a check stopping at the first stream would not see)."""
        rest += self._input()
        while 0 < len(rest) < len(self._magic) and (more := self._f.read(_READ)):
            rest += more
        if not rest:
            return False
        if not rest.startswith(self._magic):
            raise PackError(f"{self.file}: data after the end of its {self._kind} stream that is not another "
                            f"{self._kind} stream")
        self._d, self._pending = self._new(), rest
        return True


class _Member(NamedTuple):
    """A member of a pack: its name and the size of its data."""
    name: str
    size: int


class _Data:
    """One member's data, read forward from the pack stream: at most its size, then its padding skipped."""

    def __init__(self, stream: _PackStream, member: _Member):
        self._stream, self._member, self._left = stream, member, member.size

    def read(self, n: int) -> bytes:
        want = min(n, self._left)
        data = self._stream.read(want)
        if len(data) != want:
            raise PackError(f"{self._stream.file}: the tar stream ends inside the data of {self._member.name!r}")
        self._left -= want
        return data

    def skip_rest(self) -> None:
        """Read past what the caller left of the data and the padding up to the next 512-byte block."""
        left = self._left + (-self._member.size % _BLOCK)
        self._left = 0
        while left:
            got = len(self._stream.read(min(left, _CHUNK)))
            if not got:
                raise PackError(f"{self._stream.file}: the tar stream ends inside the data of "
                                f"{self._member.name!r}")
            left -= got


def _checksum_ok(block: bytes) -> bool:
    """Whether a 512-byte tar header carries its own checksum (unsigned or signed sum, as tar writers do)."""
    field = block[148:156].replace(b"\0", b" ").strip()
    if not field or not all(c in b"01234567" for c in field):
        return False
    rest = block[:148] + b" " * 8 + block[156:]
    return int(field, 8) in (sum(rest), sum(x - 256 if x > 127 else x for x in rest))


def _octal(field: bytes) -> int | None:
    """The number in an octal header field (digits, then NULs or spaces); None for anything else (base-256
    and other forms: `pack` never writes them, and every size under the caps fits in octal)."""
    digits = field.split(b"\0", 1)[0].strip(b" ")
    return int(digits, 8) if digits and all(c in b"01234567" for c in digits) else None


def _header_type(file: Path, block: bytes, at: int) -> bytes:
    """The type of the tar header `block` (read at byte `at` of the stream) after checking its checksum,
    its type (a regular file or a PAX header: nothing of any other type is read further) and its format
    (POSIX ustar, the only one `pack` writes)."""
    if not _checksum_ok(block):
        raise PackError(f"{file}: not a tar file" if at == 0 else
                        f"{file}: not a tar file (the header at byte {at} fails its checksum)")
    kind = block[156:157]
    if kind not in _REGULAR and kind != _PAX:
        raise PackError(f"{file}: a header of type {kind.decode('latin-1')!r} "
                        f"({_TYPES.get(kind, 'an unknown kind of member')}) at byte {at}; a dsagen pack holds "
                        f"only regular files, each with at most one PAX header naming it")
    if block[257:265] != _USTAR:
        raise PackError(f"{file}: the header at byte {at} is not a POSIX tar header (a dsagen pack is a POSIX "
                        f"pax tar)")
    return kind


def _pax_path(file: Path, data: bytes, at: int) -> str:
    """The path that the PAX header at byte `at` gives the next member. Its records ("<length> <key>=<value>\\n",
    the length counting the whole record) must fill it exactly and hold one `path` and nothing else: that is
    all `pack` writes, and any other keyword (sizes, sparse maps, charsets) would change how the rest of the
    stream is read."""
    path = None
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 8)
        digits = data[pos:space] if space > pos else b""
        end = pos + int(digits) if digits.isdigit() else -1
        if not (space < end <= len(data) and data[end - 1:end] == b"\n" and b"=" in data[space:end]):
            raise PackError(f"{file}: the PAX header at byte {at} holds a malformed record")
        key, _, value = data[space + 1:end - 1].partition(b"=")
        if key not in _PAX_KEYS or path is not None:
            raise PackError(f"{file}: the PAX header at byte {at} holds the record {key[:40].decode('latin-1')!r}"
                            f"{' twice' if key in _PAX_KEYS else ''}; a dsagen pack's PAX headers hold one path")
        path = value.decode("latin-1")   # checked against the pack's name pattern with every other name
        pos = end
    if path is None:
        raise PackError(f"{file}: the PAX header at byte {at} holds no path")
    return path


def _ustar_name(block: bytes) -> str:
    """The name a POSIX header gives its member: `prefix/name` when the prefix field is not empty."""
    name, prefix = block[0:100].split(b"\0", 1)[0], block[345:500].split(b"\0", 1)[0]
    return (prefix + b"/" + name if prefix else name).decode("latin-1")


def _read_exact(stream: _PackStream, n: int, what: str) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise PackError(f"{stream.file}: not a tar file (empty)" if stream.pos == len(data) == 0 else
                        f"{stream.file}: the tar stream ends inside {what} (cut short?)")
    return data


def _next_header(stream: _PackStream) -> _Member | None:
    """The next member of the tar stream after its headers were checked, or None at the end-of-archive
    block. Only what `pack` writes is read: a regular file in a POSIX header with an octal size, preceded by
    at most one PAX header of at most MAX_PAX_BYTES holding only its path. Any other header is refused from
    its first 512 bytes, before anything it announces is read, so no header makes this allocate more than
    MAX_PAX_BYTES."""
    path = None
    while True:
        at = stream.pos
        block = _read_exact(stream, _BLOCK, "a header")
        if block == _ZERO_BLOCK:
            if path is not None:
                raise PackError(f"{stream.file}: a PAX header with no member after it")
            return None
        kind = _header_type(stream.file, block, at)
        size = _octal(block[124:136])
        if size is None:
            raise PackError(f"{stream.file}: the header at byte {at} has a size field that is not an octal number")
        if kind != _PAX:
            return _Member(_ustar_name(block) if path is None else path, size)
        if path is not None:
            raise PackError(f"{stream.file}: two PAX headers in a row at byte {at} (a dsagen pack has at most one "
                            f"per member)")
        if size > MAX_PAX_BYTES:
            raise PackError(f"{stream.file}: a PAX header of {size} bytes at byte {at}, over the cap of "
                            f"{MAX_PAX_BYTES}")
        path = _pax_path(stream.file, _read_exact(stream, -(-size // _BLOCK) * _BLOCK, "a PAX header")[:size], at)


def _members(file: Path, stream: _PackStream, max_member: int, max_total: int) -> Iterator[tuple[_Member, _Data]]:
    """Every member of the stream after the per-member checks: a regular file with a safe name in the
    pack's shape, not repeated, within the caps. Yields (member, its data); whatever of the data the caller
    does not read is skipped before the next header."""
    seen: set[str] = set()
    total = 0
    n = 0
    while (m := _next_header(stream)) is not None:
        n += 1
        if n > MAX_MEMBERS:
            raise PackError(f"{file}: more than {MAX_MEMBERS} members")
        name = m.name
        if not (name == CHECKSUMS or _MEMBER.fullmatch(name)) or PurePosixPath(name).as_posix() != name:
            raise PackError(f"{file}: unexpected member {name[:300]!r} (a dsagen pack holds only "
                            f"{LAYOUT}/<arch>/<op>/<key[:2]>/<key>/<file> and {CHECKSUMS})")
        if name in seen:
            raise PackError(f"{file}: member {name!r} appears twice")
        seen.add(name)
        cap = MAX_MANIFEST_BYTES if name.endswith("/" + MANIFEST) or name == CHECKSUMS else max_member
        if m.size > cap:
            raise PackError(f"{file}: member {name!r} has {m.size} bytes, over the cap of {cap}")
        total += m.size
        if total > max_total:
            raise PackError(f"{file}: the members add up to more than the cap of {max_total} bytes")
        data = _Data(stream, m)
        yield m, data
        data.skip_rest()


def _scan(file: Path, max_member: int, max_total: int) -> dict[str, dict]:
    """First pass, writing nothing: {entry folder: {"files": {name: (size, sha256)}}} after checking
    every member, the checksum list and every entry's manifest (each manifest is checked as it is read
    and only its artifact list is kept, so memory does not grow with the number of entries)."""
    found: dict[str, tuple[int, str]] = {}
    listed: dict[str, dict[str, tuple[int, str]]] = {}   # entry folder -> its manifest's artifacts
    sums_raw = b""
    with _PackStream(file) as stream:
        for m, data in _members(file, stream, max_member, max_total):
            if m.name == CHECKSUMS or m.name.endswith("/" + MANIFEST):
                raw = data.read(m.size + 1)
                if len(raw) != m.size:
                    raise PackError(f"{file}: member {m.name!r} is truncated")
                sha = hashlib.sha256(raw).hexdigest()
                if m.name == CHECKSUMS:
                    sums_raw = raw
                else:
                    folder = m.name.rsplit("/", 1)[0]
                    try:
                        manifest = validate_entry_manifest(json.loads(raw), Path(folder))
                    except (ValueError, RecursionError) as err:  # CacheCorruption is not a ValueError
                        raise PackError(f"{file}: {m.name} is not JSON ({str(err)[:200]})") from None
                    except CacheCorruption as err:
                        raise PackError(f"{file}: {err}") from None
                    listed[folder] = {n: (a["size"], a["sha256"]) for n, a in manifest["artifacts"].items()}
            else:
                sha = _stream(data, m.size)
            found[m.name] = (m.size, sha)
    if CHECKSUMS not in found:
        raise PackError(f"{file}: no {CHECKSUMS}; not a dsagen pack")
    try:
        sums = json.loads(sums_raw)
    except (ValueError, RecursionError) as e:
        raise PackError(f"{file}: {CHECKSUMS} is not JSON ({str(e)[:200]})") from None
    if not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
        raise PackError(f"{file}: {CHECKSUMS} is not an object of sha256 strings")
    if set(sums) != set(found) - {CHECKSUMS}:
        raise PackError(f"{file}: the checksum list does not match the members")
    for name, want in sums.items():
        if found[name][1] != want:
            raise PackError(f"{file}: {name} does not match its checksum")
    entries: dict[str, dict] = {}
    for name, (size, sha) in found.items():
        if name != CHECKSUMS:
            folder, base = name.rsplit("/", 1)
            entries.setdefault(folder, {"files": {}})["files"][base] = (size, sha)
    for folder, e in entries.items():
        if folder not in listed:
            raise PackError(f"{file}: {folder} has no {MANIFEST}")
        arts = listed[folder]
        if set(e["files"]) != set(arts) | {MANIFEST}:
            raise PackError(f"{file}: {folder} holds {sorted(e['files'])}, its manifest lists "
                            f"{sorted(set(arts) | {MANIFEST})}")
        for base, want in arts.items():
            if e["files"][base] != want:
                raise PackError(f"{file}: {folder}/{base} does not match its manifest (size or sha256)")
    return entries


class Unpacked(NamedTuple):
    """What `unpack_report` did: entries added, and entries whose key the cache already held (valid: kept)."""
    added: int
    present: int


def unpack(store: CacheStore, file: Path, *, max_member_bytes: int = MAX_MEMBER_BYTES,
           max_total_bytes: int = MAX_TOTAL_BYTES) -> int:
    """Verify the pack `file` and add its entries to the writable root; returns how many were added
    (`unpack_report` also counts those already present)."""
    return unpack_report(store, file, max_member_bytes=max_member_bytes, max_total_bytes=max_total_bytes).added


def unpack_report(store: CacheStore, file: Path, *, max_member_bytes: int = MAX_MEMBER_BYTES,
                  max_total_bytes: int = MAX_TOTAL_BYTES) -> Unpacked:
    """Verify the pack `file` and add its entries to the writable root; returns (added, already present)
    (see the module docstring for the checks, the caps and what is atomic). An entry whose key the writable
    root already holds as a valid entry is kept as it is and counted as present; an invalid one is replaced."""
    file = Path(file)
    layer = store.ensure_root()
    if not file.is_file():
        raise PackError(f"{file}: no such pack file") if not file.exists() else PackError(f"{file}: not a file")
    entries = _scan(file, max_member_bytes, max_total_bytes)
    expected = {f"{folder}/{b}": sha for folder, e in entries.items() for b, (_, sha) in e["files"].items()}
    stage = store.own_dir("tmp") / staging_name("unpack")
    make_locked_dir(stage)  # locked while it exists: prune in another PID namespace sees it is live
    added = present = 0
    try:
        with _PackStream(file) as stream:
            for m, data in _members(file, stream, max_member_bytes, max_total_bytes):
                if m.name == CHECKSUMS:
                    continue
                dest = stage / m.name
                make_dirs(dest.parent)  # without group/other write whatever the umask
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as out:
                    sha = _stream(data, m.size, out)
                    out.flush()
                    os.fsync(out.fileno())
                if expected.get(m.name) != sha:
                    raise PackError(f"{file}: {m.name} changed between the check and the copy")
                del expected[m.name]
        if expected:
            raise PackError(f"{file}: members vanished between the check and the copy: {sorted(expected)[:3]}")
        for folder in sorted(entries):
            staged, final = stage / folder, layer.root / folder
            arch, op, key = entry_parts(final)
            try:
                with store.lock(key):
                    if store.chain_is_real(layer, final):
                        try:
                            load_entry(final, verify_hashes=True, read=())
                            present += 1
                            continue  # already present and valid: kept
                        except CacheCorruption:
                            pass
                    store.place(staged, arch, op, key, "replaced by an unpacked entry")
                    added += 1
            except CacheLockTimeout as e:
                raise PackError(f"{file}: {key} is locked by another process ({e}); {added} entries added, "
                                f"rerun to add the rest") from None
    finally:
        remove_path(stage)
    _log.info("unpacked %s: %d entries added, %d already present", file, added, present)
    return Unpacked(added, present)


__all__ = ["pack", "unpack", "unpack_report", "Unpacked", "Selection", "compression_of", "nothing_selected", "PTX",
           "COMPRESSION_SUFFIXES", "shippable_entries", "checksums_problems", "replacing_file", "PackError", "CHECKSUMS",
           "MAX_MEMBER_BYTES", "MAX_TOTAL_BYTES", "MAX_MEMBERS", "MAX_PAX_BYTES"]
