"""Ship a cache: `pack` writes every valid entry of the layers into one tar with a checksum list;
`unpack` verifies the whole pack before it adds anything to the writable root.

A pack holds the entries `shippable_entries` yields (every valid entry of DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH;
an installed kernel wheel's entries ship as that wheel). It is a plain tar of regular files
`v1/<arch>/<op>/<key[:2]>/<key>/<file>` (exactly an entry's
manifest.json and the artifacts it lists) plus `PACK-CHECKSUMS.json` (sha256 of every member), so it
also extracts with `tar` into a tree that DSAGEN_CACHE_PATH can point at.

`pack` is atomic: it writes `FILE.tmp-<pid>` and renames it. `unpack` is all-or-nothing for the
checks and atomic per entry for the writes: a first streaming pass checks every member (names, types,
sizes against the caps, checksums, every entry's manifest, key and artifacts) without writing
anything; a second pass streams the members into one staging folder under the cache's tmp/, checking
each against the first pass; then each entry is moved into place with one rename under its per-key
lock. An unpack interrupted during the renames leaves a subset of complete entries (rerun it to add
the rest); a failed one leaves no staging behind (a killed one leaves it to `dsagen prune`). Entries
already present and valid are kept. Members are never read whole into memory, except manifests and
the checksum list (each at most 1 MiB).

What a pack is trusted with: unpacking runs nothing, and a bad pack (not a tar, a bad checksum list,
traversal, links, devices, oversized or extra members, an invalid entry) is one PackError that leaves
the cache as it was. But the kernels inside a well-formed pack are run as they are: unpack packs only
from sources you would take code from (notes/design.md, threat model).
"""

from __future__ import annotations

import bz2
import hashlib
import io
import json
import lzma
import os
import re
import tarfile
import warnings
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..errors import DsagenError
from ..log import get_logger
from .store import (LAYOUT, MANIFEST, MAX_MANIFEST_BYTES, PYCACHE, CacheCorruption, CacheLockTimeout, CacheStore,
                    _read_nofollow, entry_parts, load_entry, make_dirs, make_locked_dir, remove_path,
                    replaced_when_written, staging_name, validate_entry_manifest)

_log = get_logger("store")

CHECKSUMS = "PACK-CHECKSUMS.json"
MAX_MEMBER_BYTES = 256 << 20      # one artifact (the largest PTX of today's kernels is a few MiB)
MAX_TOTAL_BYTES = 4 << 30         # a whole pack, unpacked
MAX_MEMBERS = 100_000
_CHUNK = 1 << 20
_MEMBER = re.compile(LAYOUT + r"/sm_[0-9]+[a-z]?/[a-z][a-z0-9_]*/[0-9a-f]{2}/[0-9a-f]{64}/"
                     r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class PackError(DsagenError, ValueError):
    """A pack file that is malformed, unsafe, over the size caps, or does not match its checksums."""


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0o644, 0, 0, 0, "", ""
    return info


def shippable_entries(store: CacheStore, what: str = "pack") -> Iterator[tuple[str, dict, dict[str, bytes]]]:
    """(entry folder relative to its root, manifest, {file name: bytes}) of every valid entry of the store's
    DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH layers (the first layer wins per key), fully hash-checked; the files
    are exactly the manifest (as stored) and the artifacts it lists. Invalid entries (see `load_entry`: links,
    sub-folders, bad manifests, bad hashes) are skipped with a warning naming `what`, and nothing is read
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
        files = dict(blobs)
        files[MANIFEST] = (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()
        yield path.relative_to(layer.root).as_posix(), m, files


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


def pack(store: CacheStore, out: Path) -> int:
    """Write every valid entry of the configured layers (`shippable_entries`) into the tar `out`; returns
    the count."""
    out = Path(out)
    sums: dict[str, str] = {}
    n = 0
    with replaced_when_written(out) as tmp, tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel, _m, files in shippable_entries(store, "pack"):
            n += 1
            for name in sorted(files):
                data = files[name]
                sums[f"{rel}/{name}"] = hashlib.sha256(data).hexdigest()
                tar.addfile(_tar_info(f"{rel}/{name}", len(data)), io.BytesIO(data))
        blob = json.dumps(sums, indent=1, sort_keys=True).encode()
        tar.addfile(_tar_info(CHECKSUMS, len(blob)), io.BytesIO(blob))
    _log.info("packed %d entries into %s", n, out)
    return n


def _open_stream(file: Path) -> tarfile.TarFile:
    """The pack as a forward-only tar stream (plain or compressed); PackError when it is not a tar."""
    try:
        return tarfile.open(file, "r|*")
    except (tarfile.ReadError, tarfile.CompressionError, EOFError) as e:
        raise PackError(f"{file}: not a tar file ({e})") from None


def _members(file: Path, tar: tarfile.TarFile, max_member: int, max_total: int):
    """Every member of the stream after the per-member checks: a regular file with a safe name in the
    pack's shape, not repeated, within the caps. Yields (member, readable stream of its data)."""
    seen: set[str] = set()
    total = 0
    try:
        for n, m in enumerate(tar, 1):
            if n > MAX_MEMBERS:
                raise PackError(f"{file}: more than {MAX_MEMBERS} members")
            name = m.name
            if not (name == CHECKSUMS or _MEMBER.fullmatch(name)) or PurePosixPath(name).as_posix() != name:
                raise PackError(f"{file}: unexpected member {name!r} (a dsagen pack holds only "
                                f"{LAYOUT}/<arch>/<op>/<key[:2]>/<key>/<file> and {CHECKSUMS})")
            if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise PackError(f"{file}: member {name!r} is not a regular file (links, folders and devices "
                                f"are refused)")
            if name in seen:
                raise PackError(f"{file}: member {name!r} appears twice")
            seen.add(name)
            cap = MAX_MANIFEST_BYTES if name.endswith("/" + MANIFEST) or name == CHECKSUMS else max_member
            if m.size > cap:
                raise PackError(f"{file}: member {name!r} has {m.size} bytes, over the cap of {cap}")
            total += m.size
            if total > max_total:
                raise PackError(f"{file}: the members add up to more than the cap of {max_total} bytes")
            yield m, tar.extractfile(m)
    except (tarfile.TarError, EOFError, OSError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"{file}: unreadable tar data ({e})") from None


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


def _decompressed(file: Path):
    """The pack's bytes as a tar stream sees them (gzip, bzip2 and xz undone), in chunks of at most
    1 MiB however much a compressed chunk inflates."""
    with open(file, "rb") as f:
        head = f.read(6)
        f.seek(0)
        if head[:2] == b"\x1f\x8b":
            d, kind = zlib.decompressobj(31), "zlib"
        elif head[:3] == b"BZh":
            d, kind = bz2.BZ2Decompressor(), "stream"
        elif head[:6] == b"\xfd7zXZ\x00":
            d, kind = lzma.LZMADecompressor(), "stream"
        else:
            d, kind = None, "plain"
        try:
            while raw := f.read(1 << 16):
                if kind == "plain":
                    yield raw
                elif kind == "zlib":
                    while raw and not d.eof:
                        yield d.decompress(raw, _CHUNK)
                        raw = d.unconsumed_tail
                else:
                    out = d.decompress(raw, max_length=_CHUNK)
                    yield out
                    while not d.eof and not d.needs_input:
                        yield d.decompress(b"", max_length=_CHUNK)
                if kind != "plain" and d.eof:
                    return
        except (zlib.error, OSError, EOFError, lzma.LZMAError) as e:
            raise PackError(f"{file}: not a readable compressed tar ({e})") from None


def _octal_or_base256(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n if field[:1] == b"\x80" else n - 256 ** (len(field) - 1)
    text = field.replace(b"\0", b" ").strip()
    return int(text, 8) if text else 0


def _checksum_ok(block: bytes) -> bool:
    """Whether a 512-byte tar header carries its own checksum (unsigned or signed sum, as tarfile accepts)."""
    try:
        want = int(block[148:156].replace(b"\0", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    rest = block[:148] + b" " * 8 + block[156:]
    return want in (sum(rest), sum(x - 256 if x > 127 else x for x in rest))


def _prescan(file: Path, max_member: int, max_total: int) -> None:
    """Walk the tar headers of the (decompressed) stream in bounded memory before `tarfile` sees it:
    `tarfile` reads an extended header (PAX, GNU long name) whole into memory, so every such header
    must be at most 1 MiB, every member within its cap, the members at most MAX_MEMBERS and their sum
    within `max_total`. Global PAX headers are refused (a dsagen pack never has one)."""
    buf = bytearray()
    skip = members = total = 0
    pax_size = None
    ext: tuple[bytes, int] | None = None   # (type, bytes left) of an extended header being collected
    ext_data = bytearray()
    for chunk in _decompressed(file):
        buf += chunk
        while True:
            if skip:
                n = min(skip, len(buf))
                if ext is not None:
                    ext_data += buf[:n]
                del buf[:n]
                skip -= n
                if skip:
                    break
                if ext is not None:
                    if ext[0] == b"x":
                        for rec in bytes(ext_data[:ext[1]]).split(b"\n"):
                            if b" size=" in rec:
                                try:
                                    pax_size = int(rec.split(b"=", 1)[1])
                                except ValueError:
                                    raise PackError(f"{file}: a PAX header with a bad size record") from None
                    ext, ext_data = None, bytearray()
            if len(buf) < 512:
                break
            block = bytes(buf[:512])
            del buf[:512]
            if block == bytes(512):
                return  # end of archive, as tarfile reads it
            if not _checksum_ok(block):
                raise PackError(f"{file}: not a tar file (a header at byte {members * 512} or later fails its "
                                f"checksum)" if members else f"{file}: not a tar file")
            try:
                size = _octal_or_base256(block[124:136])
            except ValueError:
                raise PackError(f"{file}: not a tar file (a header with a bad size field)") from None
            kind = block[156:157]
            members += 1
            if members > 2 * MAX_MEMBERS + 2:
                raise PackError(f"{file}: more than {MAX_MEMBERS} members")
            if kind == b"g":
                raise PackError(f"{file}: a global PAX header (a dsagen pack never has one)")
            if kind in (b"x", b"L", b"K"):
                if not 0 <= size <= MAX_MANIFEST_BYTES:
                    raise PackError(f"{file}: an extended tar header of {size} bytes, over the cap of "
                                    f"{MAX_MANIFEST_BYTES}")
                ext = (kind, size)
            else:
                if pax_size is not None:
                    size, pax_size = pax_size, None
                if not 0 <= size <= max_member:
                    raise PackError(f"{file}: a member of {size} bytes, over the cap of {max_member}")
                total += size
                if total > max_total:
                    raise PackError(f"{file}: the members add up to more than the cap of {max_total} bytes")
            skip = -(-size // 512) * 512


def _scan(file: Path, max_member: int, max_total: int) -> dict[str, dict]:
    """First pass, writing nothing: {entry folder: {"files": {name: (size, sha256)}}} after checking
    every member, the checksum list and every entry's manifest (each manifest is checked as it is read
    and only its artifact list is kept, so memory does not grow with the number of entries)."""
    _prescan(file, max_member, max_total)
    found: dict[str, tuple[int, str]] = {}
    listed: dict[str, dict[str, tuple[int, str]]] = {}   # entry folder -> its manifest's artifacts
    sums_raw = b""
    with _open_stream(file) as tar:
        for m, data in _members(file, tar, max_member, max_total):
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


def unpack(store: CacheStore, file: Path, *, max_member_bytes: int = MAX_MEMBER_BYTES,
           max_total_bytes: int = MAX_TOTAL_BYTES) -> int:
    """Verify the pack `file` and add its entries to the writable root; returns how many were added
    (see the module docstring for the checks, the caps and what is atomic)."""
    file = Path(file)
    layer = store.ensure_root()
    if not file.is_file():
        raise PackError(f"{file}: no such pack file") if not file.exists() else PackError(f"{file}: not a file")
    entries = _scan(file, max_member_bytes, max_total_bytes)
    expected = {f"{folder}/{b}": sha for folder, e in entries.items() for b, (_, sha) in e["files"].items()}
    stage = store.own_dir("tmp") / staging_name("unpack")
    make_locked_dir(stage)  # locked while it exists: prune in another PID namespace sees it is live
    added = 0
    try:
        with _open_stream(file) as tar:
            for m, data in _members(file, tar, max_member_bytes, max_total_bytes):
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
    _log.info("unpacked %s: %d entries added", file, added)
    return added


__all__ = ["pack", "unpack", "shippable_entries", "checksums_problems", "PackError", "CHECKSUMS", "MAX_MEMBER_BYTES", "MAX_TOTAL_BYTES", "MAX_MEMBERS"]
