"""Ship a cache as a pip-installable wheel (`dsagen pack --wheel --out DIR [--name NAME]`).

The wheel `{name}-{version}-py3-none-any.whl` (written with the standard library, byte-for-byte the same for the
same entries, name and version) holds:

    {pkg}/__init__.py                      a docstring: what the package is
    {pkg}/cache/PACK-CHECKSUMS.json        sha256 of every file below, as a pack's checksum list
    {pkg}/cache/v1/<arch>/<op>/<key[:2]>/<key>/{manifest.json, kernel.py, kernel.cubin, kernel.ptx}
    {name}-{version}.dist-info/METADATA, WHEEL, entry_points.txt, top_level.txt, RECORD

`pkg` is the normalized name (`dsagen-kernels` -> `dsagen_kernels`). entry_points.txt declares `{pkg} = {pkg}` in
the group `dsagen.caches`, through which an installed wheel's `cache/` folder becomes a read-only layer with no
environment variable (installed.py). The entries are those `dsagen pack` ships (every valid, hash-checked entry of
DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH, `pack.shippable_entries`); once installed they pass the same `load_entry`
checks as any layer's, and `dsagen verify` also checks the tree against its checksum list. The default version is
dsagen's with the first 12 hex digits of the checksum list's sha256 as its local label, so a wheel with other
kernels is another version (pip replaces the installed one) and the same kernels give the same file.

The wheel declares no dependency (dsagen itself is installed separately: `pip install --no-deps` is not needed,
nothing is pulled from an index). Like a pack, its kernels are run as they are: install kernel wheels only from
where you would take code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import keyword
import re
import zipfile
from pathlib import Path

from .._version import __version__
from ..errors import ConfigError
from ..log import get_logger
from .installed import CACHE_FOLDER, GROUP
from .pack import CHECKSUMS, shippable_entries
from .store import CacheStore, replaced_when_written

DEFAULT_NAME = "dsagen-kernels"
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
# PEP 440 public version (N(.N)*[{a|b|rc}N][.postN][.devN]) with an optional local label
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                      r"(\+[a-z0-9]+(\.[a-z0-9]+)*)?")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same entries give the same bytes
_log = get_logger("store")


def package_name(name: str) -> str:
    """The import name of the package a wheel called `name` installs (`dsagen-kernels` -> `dsagen_kernels`);
    ConfigError for a name that is not a valid distribution name, not a Python identifier once normalized, or
    that would shadow dsagen itself."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"--name {name!r}: a wheel name is letters, digits, '.', '-' and '_', starting and "
                          f"ending with a letter or digit")
    pkg = re.sub(r"[-_.]+", "_", name).lower()
    if not pkg.isidentifier() or keyword.iskeyword(pkg):
        raise ConfigError(f"--name {name!r}: its package name {pkg!r} is not a Python identifier "
                          f"(start it with a letter)")
    if pkg == "dsagen":
        raise ConfigError(f"--name {name!r}: the kernel wheel's package would replace dsagen itself; "
                          f"choose another name, e.g. {DEFAULT_NAME}")
    return pkg


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _zip_info(path: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(path, date_time=_EPOCH)
    info.external_attr = (0o100644 << 16)
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_wheel(store: CacheStore, out_dir: Path, name: str = DEFAULT_NAME, version: str | None = None
                ) -> tuple[Path, int]:
    """Write the kernel wheel of every shippable entry of `store` into the folder `out_dir` (created when
    missing); returns (the wheel's path, the number of entries). ConfigError for a bad name or version, or when
    there is no entry to ship. The file is written under a temporary name and renamed into place."""
    pkg = package_name(name)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: with --wheel, --out is a folder (the wheel's file name is fixed "
                          f"by its name and version)")
    payload: dict[str, bytes] = {}
    sums: dict[str, str] = {}
    arches: set[str] = set()
    count = 0
    for rel, m, files in shippable_entries(store, "pack --wheel"):
        count += 1
        arches.add(m["arch"])
        for fname in sorted(files):
            sums[f"{rel}/{fname}"] = hashlib.sha256(files[fname]).hexdigest()
            payload[f"{pkg}/{CACHE_FOLDER}/{rel}/{fname}"] = files[fname]
    if not count:
        raise ConfigError("nothing to put in a wheel: the cache layers hold no valid entry "
                          "(build kernels first, e.g. dsagen build --preset deepseek-v3.2)")
    sums_blob = (json.dumps(sums, indent=1, sort_keys=True) + "\n").encode()
    if version is None:
        version = f"{__version__}+{hashlib.sha256(sums_blob).hexdigest()[:12]}"
    elif not _VERSION.fullmatch(version):
        raise ConfigError(f"--wheel-version {version!r}: not a version pip accepts here "
                          f"(e.g. 1.0, 2.1.post1, 1.0+cu13)")
    summary = (f"dsagen kernel cache: {count} prebuilt kernel{'s' if count != 1 else ''} for "
               f"{', '.join(sorted(arches))}")
    payload[f"{pkg}/__init__.py"] = (
        f'"""{summary} (dsagen pack --wheel).\n\nInstalled, dsagen finds the kernels in this package\'s '
        f'{CACHE_FOLDER}/ folder through the {GROUP!r}\nentry point, with no environment variable; '
        f'`dsagen list` shows them. Nothing here is imported.\n"""\n').encode()
    payload[f"{pkg}/{CACHE_FOLDER}/{CHECKSUMS}"] = sums_blob
    dist_info = f"{pkg}-{version}.dist-info"
    meta = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
                     f"Keywords: dsagen,kernels,cubin\n\n{summary}, made by dsagen {__version__} "
                     f"(`dsagen pack --wheel`).\nInstall it next to dsagen; `dsagen list` shows its kernels.\n"),
        "WHEEL": f"Wheel-Version: 1.0\nGenerator: dsagen {__version__}\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "entry_points.txt": f"[{GROUP}]\n{pkg} = {pkg}\n",
        "top_level.txt": f"{pkg}\n",
    }
    for fname, text in meta.items():
        payload[f"{dist_info}/{fname}"] = text.encode()
    record_path = f"{dist_info}/RECORD"
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in sorted(payload.items()))
    record += f"{record_path},,\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{pkg}-{version.replace('-', '_')}-py3-none-any.whl"
    with replaced_when_written(out) as tmp, zipfile.ZipFile(tmp, "w") as z:
        # dist-info last (as wheel builders do): the package first, RECORD at the very end
        for p in sorted(payload, key=lambda p: (p.startswith(dist_info), p)):
            z.writestr(_zip_info(p), payload[p])
        z.writestr(_zip_info(record_path), record.encode())
    _log.info("wrote kernel wheel %s (%d entries)", out, count)
    return out, count


__all__ = ["write_wheel", "package_name", "DEFAULT_NAME"]
