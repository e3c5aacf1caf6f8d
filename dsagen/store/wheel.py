"""Ship a cache as a pip-installable wheel (`dsagen pack --wheel --out DIR [--name NAME]`).

The wheel `{name}-{version}-py3-none-any.whl` (written with the standard library, byte-for-byte the same for the
same entries, name and version) holds:

    {pkg}/__init__.py                      a docstring: what the package is
    {pkg}/cache/PACK-CHECKSUMS.json        sha256 of every file below, as a pack's checksum list
    {pkg}/cache/v1/<arch>/<op>/<key[:2]>/<key>/{manifest.json, kernel.py, kernel.cubin, kernel.ptx}
    {name}-{version}.dist-info/METADATA, WHEEL, entry_points.txt, top_level.txt, RECORD

`name` is `dsagen-kernels` or ends with `-dsagen-kernels` (e.g. `my-model-dsagen-kernels`): pip replaces an
installed project of the same name, so a kernel wheel's name lives where no other project's can (dsagen's own
name and its requirements are also refused by name). A suffix rather than a prefix keeps the part that tells two
kernel wheels apart at the front, which is what a table that cuts long names in the middle (`dsagen list`) still
shows. `pkg` is the normalized name (`my-model-dsagen-kernels` -> `my_model_dsagen_kernels`), so the package
cannot replace another project's files either.

entry_points.txt declares `{pkg} = {pkg}` in the group `dsagen.caches`, through which an installed wheel's `cache/`
folder becomes a read-only layer with no environment variable (installed.py). The entries are those `dsagen pack`
ships (every valid, hash-checked entry of DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH, `pack.shippable_entries`); once
installed they pass the same `load_entry` checks as any layer's, and `dsagen verify` also checks the tree against
its checksum list. The default version is dsagen's with the first 12 hex digits of the checksum list's sha256 as
its local label, so a wheel with other kernels is another version (pip replaces the installed one) and the same
kernels give the same file.

The wheel declares no dependency (dsagen itself is installed separately: `pip install --no-deps` is not needed,
nothing is pulled from an index). Like a pack, its kernels are run as they are: install kernel wheels only from
where you would take code.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import re
import zipfile
from pathlib import Path

from .._version import __version__
from ..errors import ConfigError
from ..log import get_logger
from .installed import CACHE_FOLDER, GROUP
from .pack import CHECKSUMS, replacing_file, shippable_entries
from .store import CacheStore

DEFAULT_NAME = "dsagen-kernels"   # also the end of every kernel wheel's name
# projects no kernel wheel may be named after, whatever the suffix rule: dsagen, what it runs on and builds with
# (pip installing a wheel of that name would replace the project); those dsagen's installed metadata requires are
# added when a name is checked
_RESERVED = frozenset({"dsagen", "torch", "cuda-python", "cuda-bindings", "cuda-core", "filelock", "jinja2",
                       "markupsafe", "numpy", "nvidia-cutlass-dsl", "nvidia-cuda-nvdisasm", "nvidia-ml-py", "pytest",
                       "pip", "setuptools", "wheel", "triton"})
_REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
# PEP 440 public version (N(.N)*[{a|b|rc}N][.postN][.devN]) with an optional local label
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                      r"(\+[a-z0-9]+(\.[a-z0-9]+)*)?")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same entries give the same bytes
_log = get_logger("store")


def _normalized(name: str) -> str:
    """A distribution name as pip compares it (PEP 503: runs of '-', '_', '.' are one '-', lower case)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _reserved_names() -> frozenset[str]:
    """The normalized names no kernel wheel may take: `_RESERVED` and every project dsagen's installed metadata
    requires (any extra's too)."""
    try:
        requires = importlib.metadata.requires("dsagen") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []  # dsagen run from a source tree without metadata: the fixed list remains
    found = {m.group(0) for r in requires if (m := _REQUIREMENT_NAME.match(r))}
    return frozenset(_normalized(n) for n in found | _RESERVED)


def package_name(name: str) -> str:
    """The import name of the package a wheel called `name` installs (`my-model-dsagen-kernels` ->
    `my_model_dsagen_kernels`); ConfigError naming --name for a name that is not a valid distribution name,
    that is dsagen's or a project's dsagen requires, or that is not `dsagen-kernels` or `...-dsagen-kernels`:
    pip installing a wheel replaces the installed project of the same name, so a kernel wheel's name must be
    one no other project has."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"--name {name!r}: a wheel name is letters, digits, '.', '-' and '_', starting and "
                          f"ending with a letter or digit")
    norm = _normalized(name)
    if norm in _reserved_names():
        what = "dsagen itself" if norm == "dsagen" else f"{norm}, which dsagen needs"
        raise ConfigError(f"--name {name!r}: installing the kernel wheel would replace {what}; a kernel wheel's "
                          f"name is {DEFAULT_NAME} or ends with -{DEFAULT_NAME} (e.g. my-model-{DEFAULT_NAME})")
    if norm != DEFAULT_NAME and not norm.endswith("-" + DEFAULT_NAME):
        raise ConfigError(f"--name {name!r}: a kernel wheel's name is {DEFAULT_NAME} or ends with -{DEFAULT_NAME} "
                          f"(e.g. my-model-{DEFAULT_NAME}), so that installing it cannot replace another project "
                          f"of the same name")
    return norm.replace("-", "_")


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
    there is no entry to ship. The file is written through `pack.replacing_file` (a new file of a random name,
    renamed into place; PackError when the wheel's path is a link)."""
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
    with replacing_file(out) as f, zipfile.ZipFile(f, "w") as z:
        # dist-info last (as wheel builders do): the package first, RECORD at the very end
        for p in sorted(payload, key=lambda p: (p.startswith(dist_info), p)):
            z.writestr(_zip_info(p), payload[p])
        z.writestr(_zip_info(record_path), record.encode())
    _log.info("wrote kernel wheel %s (%d entries)", out, count)
    return out, count


__all__ = ["write_wheel", "package_name", "DEFAULT_NAME"]
