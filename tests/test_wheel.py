"""Kernel wheels: `dsagen pack --wheel` writes a pip-installable wheel; once pip installs it, dsagen finds its cache
as a read-only layer through the `dsagen.caches` entry point, with no environment variable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from dsagen.cli import main
from dsagen.errors import ConfigError
from dsagen.spec import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec
from dsagen.store import CacheStore
from dsagen.store import installed
from dsagen.store.wheel import package_name, write_wheel

from cache_util import commit_fake

ROOT = Path(__file__).resolve().parent.parent
SPECS = [CompactifySpec(arch="sm_90a"), LocalToGlobalSpec(arch="sm_90a", threads=128)]


def _fake_cache(store) -> dict[str, str]:
    """Commit a fake entry per SPECS; {spec name: key}."""
    return {s.name(): commit_fake(store, s).key for s in SPECS}


# a wheel's source in `dsagen list` is "wheel NAME VERSION"; with the default version (dsagen's + .post<N>) it is
# longer than the table's column and cut in the middle, so tests that read the table give a short version
SHORT_VERSION = ["--wheel-version", "1.0"]


def _wheel(tmp_path, name="test-dsagen-kernels", **kw) -> Path:
    out = tmp_path / "dist"
    assert main(["pack", "--wheel", "--out", str(out), "--name", name, *kw.get("extra", [])]) == 0
    (whl,) = out.glob("*.whl")
    return whl


def _pip_install(whl: Path, target: Path, python: str = sys.executable) -> None:
    r = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                        "--target", str(target), str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _clean_env(**extra) -> dict:
    """The environment of a process that uses installed wheels only: no DSAGEN_* variable but a fresh writable
    root, JIT off."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("DSAGEN_") and k != "PYTHONPATH"}
    e.update(extra)
    return e


RESOLVE = textwrap.dedent("""
    import json, sys
    from dsagen.jit import resolve
    from dsagen.jit.toolchain import toolchain_versions
    from dsagen.spec import KernelSpec
    out = []
    for canonical in json.loads(sys.argv[1]):
        e = resolve(KernelSpec.from_canonical(canonical))
        out.append({"name": e.manifest["name"], "key": e.key, "path": str(e.path), "source": e.layer.origin,
                    "cubin": len(e.read("kernel.cubin"))})
    print(json.dumps({"entries": out, "toolchain": toolchain_versions(), "modules": sorted(
        m for m in sys.modules if m.split(".")[0] in ("torch", "cutlass", "jinja2"))}))
""")


def test_wheel_layout_record_and_entry_point(cache_env, tmp_path, capsys):
    keys = _fake_cache(CacheStore.from_env())
    whl = _wheel(tmp_path)
    assert "install it with: pip install" in capsys.readouterr().out
    # the default version is public (package indexes refuse a local +label): dsagen's release .post<N>
    assert re.fullmatch(r"test_dsagen_kernels-0\.1\.0\.post[0-9]+-py3-none-any\.whl", whl.name), whl.name
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        assert (z.read(f"{dist_info}/entry_points.txt").decode()
                == "[dsagen.caches]\ntest_dsagen_kernels = test_dsagen_kernels\n")
        meta = z.read(f"{dist_info}/METADATA").decode()
        assert "Name: test-dsagen-kernels\n" in meta and "Requires-Dist" not in meta
        assert "Tag: py3-none-any" in z.read(f"{dist_info}/WHEEL").decode()
        record = list(csv.reader(io.StringIO(z.read(f"{dist_info}/RECORD").decode())))
        assert sorted(r[0] for r in record) == sorted(names)
        for path, digest, size in record:
            if path.endswith("RECORD"):
                assert (digest, size) == ("", "")
                continue
            data = z.read(path)
            assert size == str(len(data))
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        sums = json.loads(z.read("test_dsagen_kernels/cache/PACK-CHECKSUMS.json"))
        for key in keys.values():
            assert any(f"/{key}/kernel.cubin" in n for n in sums)
        assert all(hashlib.sha256(z.read(f"test_dsagen_kernels/cache/{n}")).hexdigest() == h for n, h in sums.items())
    # the same entries, name and version give the same bytes
    first = whl.read_bytes()
    whl.unlink()
    assert _wheel(tmp_path).read_bytes() == first


def test_installed_wheel_is_a_layer_without_env_vars(cache_env, tmp_path):
    keys = _fake_cache(CacheStore.from_env())
    whl = _wheel(tmp_path, extra=SHORT_VERSION)
    site = tmp_path / "site"
    _pip_install(whl, site)
    assert list(site.glob("test_dsagen_kernels/cache/v1/*/*/*/*/__pycache__")), \
        "pip byte-compiles kernel.py into entries"
    env = _clean_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", DSAGEN_CACHE_DIR=str(tmp_path / "fresh"),
                     DSAGEN_DISABLE_JIT="1")
    r = subprocess.run([sys.executable, "-m", "dsagen", "list", "--json"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["name"]: row["key"] for row in rows} == keys
    assert {row["source"] for row in rows} == {f"wheel test-dsagen-kernels {whl.name.split('-')[1]}"}
    assert all(row["path"].startswith(str(site)) and "error" not in row for row in rows)
    r = subprocess.run([sys.executable, "-m", "dsagen", "list"], env=env, capture_output=True, text=True, timeout=120)
    assert "wheel test-dsagen-kernels" in r.stdout and all(len(line) <= 100 for line in r.stdout.splitlines())
    r = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([s.canonical() for s in SPECS])], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["entries"]
    assert [g["key"] for g in got] == [keys[s.name()] for s in SPECS]
    assert all(g["path"].startswith(str(site)) and g["cubin"] > 0 for g in got)
    r = subprocess.run([sys.executable, "-m", "dsagen", "verify"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 ok, 0 bad" in r.stdout, r.stdout + r.stderr

    # DSAGEN_WHEEL_CACHES=0: the layer is gone
    r = subprocess.run([sys.executable, "-m", "dsagen", "list", "--json"], env=dict(env, DSAGEN_WHEEL_CACHES="0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout) == []

    # a flipped byte: verify reports the entry and the checksum list, the lookup skips the entry with a warning
    cubin = next(site.glob(f"test_dsagen_kernels/cache/v1/sm_90a/compactify/*/{keys['compactify_sm_90a']}/"
                           f"kernel.cubin"))
    data = bytearray(cubin.read_bytes())
    data[0] ^= 1
    cubin.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "dsagen", "verify"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "1 bad" in r.stdout and "kernel.cubin: does not match its checksum" in r.stdout
    r = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([SPECS[0].canonical()])], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "KernelNotCached" in r.stderr and "skipping corrupt entry" in r.stderr
    # an extra file in the tree is named too
    (cubin.parent / "extra.bin").write_bytes(b"x")
    r = subprocess.run([sys.executable, "-m", "dsagen", "verify"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "extra.bin: not listed in PACK-CHECKSUMS.json" in r.stdout


@pytest.mark.slow
def test_fresh_runtime_only_venv_installs_and_uses_a_wheel(cache_env, tmp_path):
    """A new virtual environment with nothing but pip, dsagen's source (as a .pth, the way an editable install
    works; no torch, CuTe-DSL or jinja2) and the wheel, installed by that environment's own pip."""
    keys = _fake_cache(CacheStore.from_env())
    whl = _wheel(tmp_path, extra=SHORT_VERSION)
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300, capture_output=True)
    py = str(venv / "bin" / "python")
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dsagen-source.pth").write_text(f"{ROOT}\n")
    r = subprocess.run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                        str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env = _clean_env(DSAGEN_CACHE_DIR=str(tmp_path / "fresh"))
    r = subprocess.run([py, "-c", RESOLVE, json.dumps([s.canonical() for s in SPECS])], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["toolchain"] == {} and got["modules"] == []          # runtime only: no DSL, nothing compiled
    assert [e["key"] for e in got["entries"]] == [keys[s.name()] for s in SPECS]
    assert all(e["path"].startswith(str(site)) and e["source"].startswith("wheel test-dsagen-kernels ")
               for e in got["entries"])
    r = subprocess.run([py, "-m", "dsagen", "list"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count("wheel test-dsagen-kernels") == 2, r.stdout + r.stderr
    # pip uninstall takes the layer away again
    r = subprocess.run([py, "-m", "pip", "uninstall", "-y", "test-dsagen-kernels"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([py, "-m", "dsagen", "list"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "(cache is empty)" in r.stdout


@pytest.mark.compile
def test_compiled_kernels_ship_in_a_wheel(cache_env, tmp_path):
    """Real cross-compiled cubins (no GPU) into a wheel, installed with pip --target, found with no variable."""
    specs = [RuntimeProbeSpec(arch="sm_90a", feature="cluster"), CompactifySpec(arch="sm_90a")]
    assert main(["build", "-j", "1", *(a for s in specs for a in ("--spec", s.canonical_json()))]) == 0
    whl = _wheel(tmp_path, name="probe-dsagen-kernels")
    site = tmp_path / "site"
    _pip_install(whl, site)
    env = _clean_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", DSAGEN_CACHE_DIR=str(tmp_path / "fresh"),
                     DSAGEN_DISABLE_JIT="1")
    r = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([s.canonical() for s in specs])], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["entries"]
    built = {row["name"]: row for row in json.loads(_list_json())}
    for spec, e in zip(specs, got):
        assert e["source"].startswith("wheel probe-dsagen-kernels ") and e["path"].startswith(str(site))
        assert e["key"] == built[spec.name()]["key"]
        cubin = Path(built[spec.name()]["path"]) / "kernel.cubin"
        assert e["cubin"] == cubin.stat().st_size > 1000


def _list_json() -> str:
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["list", "--json"]) == 0
    return buf.getvalue()


# ---- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,msg", [("-bad", "a wheel name is letters"), ("1kernels", "ends with -dsagen-kernels"),
                                      ("dsagen", "would replace dsagen itself"), ("a b", "a wheel name is letters"),
                                      ("import", "ends with -dsagen-kernels"),
                                      ("xdsagen-kernels", "ends with -dsagen-kernels"),
                                      ("torch", "would replace torch")])
def test_bad_wheel_names(name, msg):
    with pytest.raises(ConfigError, match=msg):
        package_name(name)


def test_package_name_normalizes():
    assert package_name("H200.DSAgen--Kernels") == "h200_dsagen_kernels"


def test_wheel_errors_in_the_cli(cache_env, tmp_path, capsys):
    def err(argv) -> str:
        assert main(argv) == 2
        out = capsys.readouterr().err
        assert out.startswith("dsagen: error: ") and out.count("\n") == 1
        return out

    assert "no valid entry" in err(["pack", "--wheel", "--out", str(tmp_path / "d")])
    _fake_cache(CacheStore.from_env())
    (tmp_path / "file").write_text("x")
    assert "--out is a folder" in err(["pack", "--wheel", "--out", str(tmp_path / "file")])
    assert "--name and --wheel-version go with --wheel" in err(["pack", "--out", str(tmp_path / "k.tar"),
                                                                "--name", "x"])
    assert "not a version" in err(["pack", "--wheel", "--out", str(tmp_path / "d"), "--wheel-version", "1.0-x y"])
    assert main(["pack", "--wheel", "--out", str(tmp_path / "d"), "--wheel-version", "2.0+cu13"]) == 0
    assert (tmp_path / "d" / "dsagen_kernels-2.0+cu13-py3-none-any.whl").is_file()


def test_entry_point_naming_a_missing_package_warns(monkeypatch):
    import importlib.metadata as md

    ep = md.EntryPoint(name="ghost", value="no_such_dsagen_cache_pkg", group=installed.GROUP)
    monkeypatch.setattr(installed.md, "entry_points", lambda group: [ep] if group == installed.GROUP else [])
    installed.forget()
    try:
        with pytest.warns(UserWarning, match="no_such_dsagen_cache_pkg.*not installed; it provides no kernels"):
            assert installed.installed_caches() == ()
    finally:
        installed.forget()


def test_wheel_layers_sit_after_the_cache_path_and_before_the_writable_root(tmp_path, monkeypatch):
    wheel_root = tmp_path / "pkg" / "cache"
    wheel_root.mkdir(parents=True)
    monkeypatch.setattr(installed, "installed_caches", lambda: (installed.InstalledCache(wheel_root, "k 1.0"),))
    import dsagen.store.store as st

    monkeypatch.setattr(st, "installed_caches", installed.installed_caches)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(tmp_path / "rw"))
    monkeypatch.setenv("DSAGEN_CACHE_PATH", str(tmp_path / "ro"))
    monkeypatch.delenv("DSAGEN_WHEEL_CACHES", raising=False)
    monkeypatch.setenv("DSAGEN_CACHE", "rw")
    layers = CacheStore.from_env().layers
    assert [(la.root, la.origin, la.writable) for la in layers] == [
        (tmp_path / "ro", "DSAGEN_CACHE_PATH", False), (wheel_root, "wheel k 1.0", False),
        (tmp_path / "rw", "DSAGEN_CACHE_DIR", True)]
    monkeypatch.setenv("DSAGEN_WHEEL_CACHES", "0")
    assert wheel_root not in [la.root for la in CacheStore.from_env().layers]
    monkeypatch.setenv("DSAGEN_CACHE", "off")
    monkeypatch.delenv("DSAGEN_WHEEL_CACHES")
    assert CacheStore.from_env().layers == []


def test_pycache_is_accepted_only_in_wheel_layers(cache_env):
    from dsagen.store.store import CacheCorruption, check_entry

    e = commit_fake(CacheStore.from_env())
    (e.path / "__pycache__").mkdir()
    (e.path / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"bytecode")
    with pytest.raises(CacheCorruption, match="links or sub-folders"):
        check_entry(e.path)
    assert check_entry(e.path, bytecode_ok=True)["key"] == e.key
    (e.path / "other").mkdir()
    with pytest.raises(CacheCorruption, match=r"links or sub-folders: \['other'\]"):
        check_entry(e.path, bytecode_ok=True)


def test_pack_and_wheel_skip_entries_of_installed_wheels(cache_env, tmp_path, monkeypatch):
    """An installed wheel's entries ship as that wheel: a new pack or wheel holds only the configured layers'."""
    import shutil

    keys = _fake_cache(CacheStore.from_env())
    wheel_root = tmp_path / "pkg" / "cache"
    shutil.copytree(cache_env / "v1", wheel_root / "v1")
    shutil.rmtree(cache_env / "v1" / "sm_90a" / "local_to_global")
    store = CacheStore(cache_env, [], wheel_caches=(installed.InstalledCache(wheel_root, "k 1.0"),))
    assert len(list(store.entries())) == 3
    whl, n = write_wheel(store, tmp_path / "dist")
    assert n == 1
    with zipfile.ZipFile(whl) as z:
        assert any(keys["compactify_sm_90a"] in name for name in z.namelist())
        assert not any(keys[SPECS[1].name()] in name for name in z.namelist())
