"""Ship a cache as a pip-installable wheel (`dsagen pack --wheel --out DIR [--name NAME]`).

The wheel `{name}-{version}-py3-none-any.whl` (written with the standard library, byte-for-byte the same for the
same entries, name and version) holds:

    {pkg}/__init__.py                      a docstring: what the package is
    {pkg}/dsagen-kernels.json              what the kernels need (`wheel_record`): format, dsagen, toolchain, CUDA
    {pkg}/cache/PACK-CHECKSUMS.json        sha256 of every file below, as a pack's checksum list
    {pkg}/cache/v1/<arch>/<op>/<key[:2]>/<key>/{manifest.json, kernel.py, kernel.cubin[, kernel.ptx]}
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
its checksum list. As in a pack, the PTX is left out unless `keep_ptx` (the runtime reads only kernel.cubin).

Versions are PEP 440 (`packaging.version.Version`), written normalized (`1.0-1` -> `1.0.post1`). The default is
public, as package indexes require (no local `+label`): dsagen's release `X.Y.Z.post<N>`, N the first 8 hex digits
of the checksum list's sha256 as a number, so a wheel with other kernels is another version (pip replaces the
installed one) and the same kernels give the same file.

`{pkg}/dsagen-kernels.json` records the wheel format (WHEEL_FORMAT), the dsagen version that wrote it, the
toolchain versions of its entries and the CUDA major their cubins need (CUDA_MAJOR); installed.py skips, with a
warning, a wheel whose format or CUDA major is not the one this dsagen serves.

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

from packaging.version import InvalidVersion, Version

from .._version import __version__
from ..errors import ConfigError
from ..log import get_logger
from .installed import CACHE_FOLDER, CUDA_MAJOR, GROUP, RECORD_FILE, WHEEL_FORMAT
from .pack import CHECKSUMS, Selection, nothing_selected, replacing_file, shippable_entries
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


def wheel_version(version: str | None, sums_blob: bytes) -> str:
    """The normalized PEP 440 version of a wheel: `version` when given (ConfigError naming --wheel-version when
    `packaging` does not parse it), else the public default `<dsagen release>.post<N>`, N the first 8 hex digits
    of the sha256 of the checksum list `sums_blob` (other kernels, other version; the same kernels, the same)."""
    if version is None:
        n = int(hashlib.sha256(sums_blob).hexdigest()[:8], 16)
        return str(Version(f"{Version(__version__).base_version}.post{n}"))
    try:
        return str(Version(version))
    except (InvalidVersion, TypeError):
        raise ConfigError(f"--wheel-version {version!r}: not a version pip accepts (PEP 440, "
                          f"e.g. 1.0, 1.0rc1, 2.1.post1, 1!1.0, 1.0+cu13)") from None


def wheel_record(manifests: list[dict]) -> dict:
    """The content of `{pkg}/dsagen-kernels.json`: the wheel format, the dsagen version writing it, every
    toolchain distribution's versions across the entries' manifests, and the CUDA major their cubins need."""
    toolchain: dict[str, set[str]] = {}
    for m in manifests:
        for dist, ver in m["toolchain"].items():
            toolchain.setdefault(str(dist), set()).add(str(ver))
    return {"format": WHEEL_FORMAT, "dsagen": __version__, "cuda_major": CUDA_MAJOR,
            "toolchain": {d: sorted(v) for d, v in sorted(toolchain.items())},
            "arches": sorted({m["arch"] for m in manifests}), "entries": len(manifests)}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _zip_info(path: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(path, date_time=_EPOCH)
    info.external_attr = (0o100644 << 16)
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_wheel(store: CacheStore, out_dir: Path, name: str = DEFAULT_NAME, version: str | None = None,
                select: Selection | None = None, keep_ptx: bool = False) -> tuple[Path, int]:
    """Write the kernel wheel of every shippable entry of `store` that `select` selects (without `keep_ptx`,
    without PTX) into the folder `out_dir` (created when missing); returns (the wheel's path, the number of
    entries). ConfigError for a bad name or version, or when no entry is selected. The file is written through
    `pack.replacing_file` (a new file of a random name, renamed into place; PackError when the wheel's path is
    a link)."""
    pkg = package_name(name)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: with --wheel, --out is a folder (the wheel's file name is fixed "
                          f"by its name and version)")
    if version is not None:
        wheel_version(version, b"")  # a bad --wheel-version is reported before the entries are read
    payload: dict[str, bytes] = {}
    sums: dict[str, str] = {}
    manifests: list[dict] = []
    for rel, m, files in shippable_entries(store, "pack --wheel", select, keep_ptx):
        manifests.append(m)
        for fname in sorted(files):
            sums[f"{rel}/{fname}"] = hashlib.sha256(files[fname]).hexdigest()
            payload[f"{pkg}/{CACHE_FOLDER}/{rel}/{fname}"] = files[fname]
    count = len(manifests)
    if not count:
        raise nothing_selected(select, "put in a wheel")
    arches = {m["arch"] for m in manifests}
    sums_blob = (json.dumps(sums, indent=1, sort_keys=True) + "\n").encode()
    version = wheel_version(version, sums_blob)
    record = wheel_record(manifests)
    payload[f"{pkg}/{RECORD_FILE}"] = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
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
                     f"(`dsagen pack --wheel`) with {_toolchain_text(record)}; the cubins need a CUDA "
                     f"{CUDA_MAJOR} driver.\nInstall it next to dsagen; `dsagen list` shows its kernels.\n"),
        "WHEEL": f"Wheel-Version: 1.0\nGenerator: dsagen {__version__}\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "entry_points.txt": f"[{GROUP}]\n{pkg} = {pkg}\n",
        "top_level.txt": f"{pkg}\n",
    }
    for fname, text in meta.items():
        payload[f"{dist_info}/{fname}"] = text.encode()
    record_path = f"{dist_info}/RECORD"
    rows = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in sorted(payload.items()))
    rows += f"{record_path},,\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{pkg}-{version.replace('-', '_')}-py3-none-any.whl"
    with replacing_file(out) as f, zipfile.ZipFile(f, "w") as z:
        # dist-info last (as wheel builders do): the package first, RECORD at the very end
        for p in sorted(payload, key=lambda p: (p.startswith(dist_info), p)):
            z.writestr(_zip_info(p), payload[p])
        z.writestr(_zip_info(record_path), rows.encode())
    _log.info("wrote kernel wheel %s (%d entries)", out, count)
    return out, count


def _toolchain_text(record: dict) -> str:
    """The toolchain of a wheel record as words, e.g. "nvidia-cutlass-dsl 4.8.1"."""
    return ", ".join(f"{d} {'/'.join(v)}" for d, v in record["toolchain"].items()) or "no recorded toolchain"


__all__ = ["write_wheel", "package_name", "wheel_version", "wheel_record", "DEFAULT_NAME"]
