"""Ship a cache: `pack` writes every complete entry of the layers into one tar with a checksum list;
`unpack` verifies that list and every entry before adding the entries to the writable root.

Both are atomic: pack writes `FILE.tmp-*` and renames it; unpack extracts into the cache's tmp/ and
moves each verified entry into place with a rename (entries already present are kept)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from .keys import sha256_hex
from .store import LAYOUT, CacheCorruption, CacheStore, check_entry

CHECKSUMS = "PACK-CHECKSUMS.json"


class PackError(ValueError):
    """A pack file that is malformed or does not match its checksums."""


def pack(store: CacheStore, out: Path) -> int:
    """Write every complete entry (first layer wins per key) into the tar `out`; returns the count."""
    out = Path(out)
    sums: dict[str, str] = {}
    seen: set[str] = set()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        with tarfile.open(tmp, "w") as tar:
            for layer, path in store.entries():
                if path.name in seen:
                    continue
                try:
                    check_entry(path, verify_hashes=True)
                except CacheCorruption:
                    continue  # never ship a bad entry
                seen.add(path.name)
                for f in sorted(path.iterdir()):
                    rel = f.relative_to(layer.root).as_posix()
                    data = f.read_bytes()
                    sums[rel] = sha256_hex(data)
                    info = tarfile.TarInfo(rel)
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
            blob = json.dumps(sums, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(CHECKSUMS)
            info.size, info.mode = len(blob), 0o644
            tar.addfile(info, io.BytesIO(blob))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(seen)


def unpack(store: CacheStore, file: Path) -> int:
    """Verify the pack `file` and add its entries to the writable root; returns how many were added."""
    layer = store._require_writable()
    (layer.root / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=layer.root / "tmp", prefix="unpack-") as work:
        work = Path(work)
        with tarfile.open(file, "r") as tar:
            members = tar.getmembers()
            for m in members:
                parts = Path(m.name).parts
                if not m.isfile() or m.name.startswith("/") or ".." in parts:
                    raise PackError(f"{file}: unexpected member {m.name!r}")
                if m.name != CHECKSUMS and parts[0] != LAYOUT:
                    raise PackError(f"{file}: member {m.name!r} is outside {LAYOUT}/")
            names = {m.name for m in members}
            if CHECKSUMS not in names:
                raise PackError(f"{file}: no {CHECKSUMS}; not a dsagen pack")
            sums = json.loads(tar.extractfile(CHECKSUMS).read())
            if set(sums) != names - {CHECKSUMS}:
                raise PackError(f"{file}: the checksum list does not match the members")
            for m in members:
                if m.name == CHECKSUMS:
                    continue
                data = tar.extractfile(m).read()
                if sha256_hex(data) != sums[m.name]:
                    raise PackError(f"{file}: {m.name} does not match its checksum")
                dest = work / m.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
        entries = sorted({p.parent for p in work.rglob("manifest.json")})
        for e in entries:
            try:
                check_entry(e, verify_hashes=True)
            except CacheCorruption as err:
                raise PackError(f"{file}: {err}") from None
        added = 0
        for e in entries:
            final = layer.root / e.relative_to(work)
            if final.exists():
                continue
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(e, final)
            added += 1
        shutil.rmtree(work, ignore_errors=True)
    return added
