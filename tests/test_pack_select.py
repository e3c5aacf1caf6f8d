"""`dsagen pack` / `pack --wheel`: selecting entries (--preset, --model, --op, --arch), leaving PTX out unless
--keep-ptx, compressing by --out's suffix, the wheel's PEP 440 version and its record of what the kernels need,
and `dsagen unpack` counting entries already present apart from those added."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from dsagen.cli import main
from dsagen.errors import ConfigError
from dsagen.spec import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec
from dsagen.store import CacheStore
from dsagen.store import installed
from dsagen.store.pack import pack, unpack_report
from dsagen.store.store import load_entry

from cache_util import fake_entry

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "deepseek-v3.2-config.json"
PRESET = CompactifySpec(arch="sm_90a")                       # in the deepseek-v3.2 preset on sm_90a
OTHER_OP = RuntimeProbeSpec(arch="sm_90a", feature="cluster")  # in no preset
OTHER_ARCH = CompactifySpec(arch="sm_100a")


def _commit(store, spec, ptx: bool = True):
    """Commit a valid fake entry for `spec`, with a kernel.ptx artifact when `ptx`; returns the Entry."""
    key, files, manifest = fake_entry(spec)
    if ptx:
        files["kernel.ptx"] = b"// PTX of " + spec.name().encode()
    with store.lock(key):
        return store.commit(spec.arch, spec.op, key, files, manifest)


def _cache() -> dict[str, str]:
    """Three entries in the test's writable cache; {spec name: key}."""
    store = CacheStore.from_env()
    return {s.name() + "@" + s.arch: _commit(store, s).key for s in (PRESET, OTHER_OP, OTHER_ARCH)}


def _keys_in_pack(f: Path) -> set[str]:
    with tarfile.open(f) as t:
        return {n.split("/")[4] for n in t.getnames() if n.startswith("v1/")}


def _pack_keys(tmp_path, *options) -> set[str]:
    out = tmp_path / "sel.tar"
    assert main(["pack", "--out", str(out), *options]) == 0
    return _keys_in_pack(out)


def test_pack_selects_by_op_and_arch(cache_env, tmp_path):
    k = _cache()
    p, o, a = k[PRESET.name() + "@sm_90a"], k[OTHER_OP.name() + "@sm_90a"], k[OTHER_ARCH.name() + "@sm_100a"]
    assert _pack_keys(tmp_path) == {p, o, a}
    assert _pack_keys(tmp_path, "--op", "compactify") == {p, a}
    assert _pack_keys(tmp_path, "--op", "compactify", "--op", OTHER_OP.op) == {p, o, a}
    assert _pack_keys(tmp_path, "--arch", "sm_100a") == {a}
    assert _pack_keys(tmp_path, "--arch", "sm_90a", "--arch", "sm_100a") == {p, o, a}
    assert _pack_keys(tmp_path, "--op", "compactify", "--arch", "sm_90a") == {p}       # options intersect


def test_pack_selects_the_kernels_of_a_preset_or_a_model(cache_env, tmp_path):
    k = _cache()
    p, a = k[PRESET.name() + "@sm_90a"], k[OTHER_ARCH.name() + "@sm_100a"]
    assert _pack_keys(tmp_path, "--preset", "deepseek-v3.2") == {p, a}                 # every arch by default
    assert _pack_keys(tmp_path, "--preset", "deepseek-v3.2", "--arch", "sm_90a") == {p}
    assert _pack_keys(tmp_path, "--model", str(EXAMPLE), "--arch", "sm_100a") == {a}


def test_a_selection_that_matches_nothing_is_an_error_naming_it(cache_env, tmp_path, capsys):
    _cache()
    for extra in ([], ["--wheel"]):
        out = tmp_path / ("d" if extra else "none.tar")
        assert main(["pack", "--out", str(out), "--model", str(EXAMPLE), "--op", OTHER_OP.op, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dsagen: error: ") and f"--op {OTHER_OP.op}" in err and str(EXAMPLE) in err, err
        assert not out.exists() or not any(out.iterdir())
    assert main(["pack", "--out", str(tmp_path / "x.tar"), "--arch", "sm_77"]) == 2
    assert "sm_77" in capsys.readouterr().err


def test_ptx_is_left_out_unless_keep_ptx_and_the_entry_stays_valid(cache_env, tmp_path, monkeypatch, capsys):
    src = CacheStore.from_env()
    e = _commit(src, PRESET)
    assert (e.path / "kernel.ptx").is_file()
    stripped, kept = tmp_path / "s.tar", tmp_path / "k.tar"
    assert pack(src, stripped) == 1 and pack(src, kept, keep_ptx=True) == 1
    with tarfile.open(stripped) as t:
        assert not [n for n in t.getnames() if n.endswith("kernel.ptx")]
        m = json.loads(t.extractfile(next(n for n in t.getnames() if n.endswith("manifest.json"))).read())
        assert set(m["artifacts"]) == {"kernel.cubin", "kernel.py"} and m["key"] == e.path.name
    with tarfile.open(kept) as t:
        assert [n for n in t.getnames() if n.endswith("kernel.ptx")]
    for f, files in ((stripped, {"kernel.cubin", "kernel.py", "manifest.json"}),
                     (kept, {"kernel.cubin", "kernel.py", "kernel.ptx", "manifest.json"})):
        root = tmp_path / f"dst-{f.stem}"
        assert unpack_report(CacheStore(root, []), f) == (1, 0)
        (entry,) = root.glob("v1/*/*/*/*")
        assert {p.name for p in entry.iterdir()} == files
        load_entry(entry, verify_hashes=True)                   # a valid entry: schema, key, identity, hashes
        monkeypatch.setenv("DSAGEN_CACHE_DIR", str(root))
        assert main(["verify"]) == 0, capsys.readouterr()


@pytest.mark.parametrize("suffix,magic", [(".tar", None), (".tar.gz", b"\x1f\x8b"), (".tgz", b"\x1f\x8b"),
                                          (".tar.xz", b"\xfd7zXZ\x00"), (".tar.bz2", b"BZh")])
def test_the_compression_follows_the_suffix_and_is_reproducible(cache_env, tmp_path, suffix, magic):
    src = CacheStore.from_env()
    _commit(src, PRESET)
    _commit(src, OTHER_OP)
    f = tmp_path / f"k{suffix}"
    assert pack(src, f) == 2
    data = f.read_bytes()
    if magic is None:
        assert data[257:262] == b"ustar"
    else:
        assert data.startswith(magic)
    if suffix in (".tar.gz", ".tgz"):
        assert data[4:8] == b"\0\0\0\0"                     # gzip header mtime 0
    time.sleep(1.1)                                         # a clock-dependent field would now differ
    assert pack(src, f) == 2 and f.read_bytes() == data
    assert unpack_report(CacheStore(tmp_path / "dst", []), f) == (2, 0)


def test_an_unknown_suffix_is_an_error_naming_out(cache_env, tmp_path, capsys):
    _commit(CacheStore.from_env(), PRESET)
    for name in ("k.zip", "k.tar.zst", "kernels", ".tar"):
        out = tmp_path / name
        assert main(["pack", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}" in err and ".tar.gz" in err, err
        assert not out.exists()
    with pytest.raises(ConfigError, match="--out"):
        pack(CacheStore.from_env(), tmp_path / "k.gz")


def test_unpack_reports_entries_already_present_apart(cache_env, tmp_path, capsys):
    src = CacheStore(tmp_path / "src", [])
    _commit(src, PRESET)
    _commit(src, OTHER_OP)
    f = tmp_path / "k.tar.gz"
    pack(src, f)
    _commit(CacheStore.from_env(), PRESET)                 # one of the two is already in the cache
    assert main(["unpack", str(f)]) == 0
    assert "unpacked 1 entry into" in capsys.readouterr().out
    assert main(["unpack", str(f)]) == 0
    out = capsys.readouterr().out
    assert "unpacked 0 entries into" in out and "2 already present" in out, out


def _wheel_file(tmp_path, *options) -> Path:
    out = tmp_path / "dist"
    for old in out.glob("*.whl"):
        old.unlink()
    assert main(["pack", "--wheel", "--out", str(out), *options]) == 0
    (whl,) = out.glob("*.whl")
    return whl


def test_wheel_versions_are_pep440_and_normalized(cache_env, tmp_path, capsys):
    _commit(CacheStore.from_env(), PRESET)
    for given, written in (("1.0-1", "1.0.post1"), ("1.0rc1", "1.0rc1"), ("1!1.0", "1!1.0"), ("2.0+cu13", "2.0+cu13"),
                           ("1.0.0-alpha.1", "1.0.0a1")):
        whl = _wheel_file(tmp_path, "--wheel-version", given)
        assert whl.name == f"dsagen_kernels-{written}-py3-none-any.whl"
        with zipfile.ZipFile(whl) as z:
            assert f"Version: {written}\n" in z.read(f"dsagen_kernels-{written}.dist-info/METADATA").decode()
    capsys.readouterr()
    for bad in ("1.0-x y", "v1..0", "latest", ""):
        assert main(["pack", "--wheel", "--out", str(tmp_path / "bad"), "--wheel-version", bad]) == 2
        err = capsys.readouterr().err
        assert "--wheel-version" in err and "not a version" in err, err
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_the_default_wheel_version_is_public_reproducible_and_follows_the_kernels(cache_env, tmp_path):
    store = CacheStore.from_env()
    _commit(store, PRESET)
    first = _wheel_file(tmp_path)
    version = Version(first.name.split("-")[1])
    assert version.local is None and version.is_postrelease and not version.is_devrelease
    data = first.read_bytes()
    assert _wheel_file(tmp_path).read_bytes() == data       # same kernels, same version and bytes
    _commit(store, OTHER_OP)
    assert Version(_wheel_file(tmp_path).name.split("-")[1]) != version


def _record(whl: Path) -> dict:
    with zipfile.ZipFile(whl) as z:
        return json.loads(z.read("dsagen_kernels/dsagen-kernels.json"))


def test_the_wheel_records_dsagen_the_toolchain_and_the_cuda_major(cache_env, tmp_path):
    from dsagen import __version__

    _commit(CacheStore.from_env(), PRESET)
    whl = _wheel_file(tmp_path, "--wheel-version", "1.0")
    rec = _record(whl)
    assert rec["format"] == installed.WHEEL_FORMAT and rec["cuda_major"] == installed.CUDA_MAJOR == 13
    assert rec["dsagen"] == __version__ and rec["toolchain"] == {"nvidia-cutlass-dsl": ["4.8.1"]}
    with zipfile.ZipFile(whl) as z:
        meta = z.read("dsagen_kernels-1.0.dist-info/METADATA").decode()
        assert not [n for n in z.namelist() if n.endswith("kernel.ptx")]
        assert "Requires-Dist" not in meta and "nvidia-cutlass-dsl 4.8.1" in meta and "CUDA 13" in meta
    assert [n for n in zipfile.ZipFile(_wheel_file(tmp_path, "--keep-ptx")).namelist() if n.endswith("kernel.ptx")]


def _extracted(whl: Path, site: Path, monkeypatch, edit=None) -> Path:
    """`whl` unzipped into `site` (what pip installs, without pip), optionally with its record edited, and
    `site` on sys.path."""
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    rec = site / "dsagen_kernels" / "dsagen-kernels.json"
    if edit is not None:
        edit(rec)
    monkeypatch.syspath_prepend(str(site))
    installed.forget()
    return rec


@pytest.mark.parametrize("edit,why", [
    (None, None),
    (lambda p: p.write_text(json.dumps(dict(json.loads(p.read_text()), cuda_major=12))), "need CUDA 12"),
    (lambda p: p.write_text(json.dumps(dict(json.loads(p.read_text()), format=99))), "format 99"),
    (lambda p: p.write_text("{not json"), "unreadable"),
    (lambda p: p.write_text("[]"), "not a JSON object"),
    (lambda p: p.unlink(), None),                            # written before records existed: taken as it is
])
def test_an_installed_wheel_for_another_cuda_or_format_is_skipped_with_a_warning(cache_env, tmp_path, monkeypatch,
                                                                                  edit, why):
    import warnings

    _commit(CacheStore.from_env(), PRESET)
    whl = _wheel_file(tmp_path, "--wheel-version", "1.0")
    _extracted(whl, tmp_path / "site", monkeypatch, edit)
    installed._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = [c for c in installed.installed_caches() if str(tmp_path) in str(c.root)]
        msgs = [str(w.message) for w in caught]
        if why is None:
            assert len(found) == 1 and not [m for m in msgs if "dsagen_kernels" in m or "dsagen-kernels" in m]
        else:
            assert found == []
            assert any("skipping the installed kernel wheel dsagen-kernels 1.0" in m and why in m for m in msgs), msgs
    finally:
        installed.forget()


def test_pack_serving_selects_the_forward_kernels_of_a_preset(cache_env, tmp_path, capsys):
    """--serving narrows --preset / --model to the kernels dsagen build --serving builds; alone it is an error."""
    from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdOrderSpec

    k = _cache()
    store = CacheStore.from_env()
    bwd = _commit(store, SparseAttnBwdOrderSpec(arch="sm_90a")).key             # a training kernel of the preset
    p = k[PRESET.name() + "@sm_90a"]
    assert _pack_keys(tmp_path, "--preset", "deepseek-v3.2", "--arch", "sm_90a") == {p, bwd}
    assert _pack_keys(tmp_path, "--preset", "deepseek-v3.2", "--arch", "sm_90a", "--serving") == {p}
    assert main(["pack", "--out", str(tmp_path / "s.tar"), "--serving"]) == 2
    assert "--serving selects among the kernels of a --preset or --model" in capsys.readouterr().err
