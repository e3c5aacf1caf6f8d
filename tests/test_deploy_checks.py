"""The checks a deployment runs before serving, and what it sees while running: `dsagen build --check`,
`dsagen.preload`, the CUDA driver requirement, `dsagen env`'s GPU lines, dsagen's logging as a library and
`dsagen verify` on entries filed where lookups never look. None needs a GPU or a compiler."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dsagen
from cache_util import KERNEL_RECORD, commit_fake
from dsagen.cli import main
from dsagen.errors import ConfigError, DsagenError
from dsagen.jit.toolchain import toolchain_versions
from dsagen.spec import CompactifySpec, LocalToGlobalSpec
from dsagen.spec.model_config import model_from_config, specs_for_model
from dsagen.store import store as store_mod
from dsagen.store.store import CacheStore

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "deepseek-v3.2-config.json"
COMPACTIFY = CompactifySpec(arch="sm_90a")
LOCAL = LocalToGlobalSpec(arch="sm_90a", threads=128)


def _missing_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("MISSING ")]


def _model_specs(arch: str = "sm_90a") -> list:
    return specs_for_model(model_from_config(json.loads(CONFIG.read_text())), arch)


# ---- dsagen build --check ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--preset", "deepseek-v3.2"],
    ["--model", str(CONFIG), "--arch", "sm_90a"],
    ["--spec", COMPACTIFY.canonical_json(), "--spec", LOCAL.canonical_json()],
    ["--spec-file", str(ROOT / "tests" / "gpu" / "required_specs.json"), "--arch", "sm_90a"],
])
def test_build_check_lists_every_missing_kernel_and_exits_1(argv, cache_env, capsys):
    assert main(["build", "--check", *argv]) == 1
    out = capsys.readouterr().out
    missing = _missing_lines(out)
    assert len(missing) >= 2 and all("dsagen build --spec" in line for line in missing)
    assert f"{len(missing)} missing" in out
    assert not cache_env.exists()  # nothing written, not even the cache root


def test_build_check_names_each_kernel_of_a_model(cache_env, capsys):
    assert main(["build", "--check", "--model", str(CONFIG)]) == 1
    names = {line.split()[1] for line in _missing_lines(capsys.readouterr().out)}
    assert names == {s.name() for s in _model_specs()}


def test_build_check_exits_0_when_every_kernel_is_cached(cache_env, capsys):
    store = CacheStore.from_env()
    for spec in (COMPACTIFY, LOCAL):  # as a build would have stored them: this toolchain's entries
        commit_fake(store, spec, toolchain=toolchain_versions())
    assert main(["build", "--check", "--spec", COMPACTIFY.canonical_json(), "--spec", LOCAL.canonical_json()]) == 0
    out = capsys.readouterr().out
    assert not _missing_lines(out) and "2 cached, 0 missing" in out


def test_build_check_reports_only_the_missing_ones(cache_env, capsys):
    commit_fake(CacheStore.from_env(), COMPACTIFY, toolchain=toolchain_versions())
    assert main(["build", "--check", "--spec", COMPACTIFY.canonical_json(), "--spec", LOCAL.canonical_json()]) == 1
    missing = _missing_lines(capsys.readouterr().out)
    assert len(missing) == 1 and missing[0].startswith(f"MISSING {LOCAL.name()} ")


def test_build_check_and_dry_run_together_are_a_usage_error(cache_env, capsys):
    assert main(["build", "--check", "--dry-run", "--spec", COMPACTIFY.canonical_json()]) == 2
    assert "--check and --dry-run" in capsys.readouterr().err


# ---- dsagen.preload ---------------------------------------------------------------------------------------------
def test_preload_is_public():
    from dsagen.deploy import preload

    assert dsagen.preload is preload and "preload" in dsagen.__all__


def test_preload_without_a_gpu_raises_one_error_naming_every_missing_kernel(cache_env, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    specs = _model_specs()
    with pytest.raises(dsagen.deploy.KernelsNotCached) as e:
        dsagen.preload(model=json.loads(CONFIG.read_text()))
    assert isinstance(e.value, LookupError) and isinstance(e.value, DsagenError)
    assert e.value.missing == specs
    assert f"{len(specs)} of {len(specs)} kernel(s)" in str(e.value)
    assert all(s.name() in str(e.value) for s in specs)
    with pytest.raises(dsagen.deploy.KernelsNotCached):  # a config file works as its dict does
        dsagen.preload(model=str(CONFIG))
    assert not cache_env.exists()  # looked up only: nothing compiled, nothing written


def test_preload_without_a_gpu_looks_up_and_returns_the_entries(cache_env, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    store = CacheStore.from_env()
    keys = [commit_fake(store, s).key for s in (COMPACTIFY, LOCAL)]  # any toolchain counts
    assert [e.key for e in dsagen.preload(specs=[COMPACTIFY, LOCAL, COMPACTIFY])] == keys


def test_preload_loads_every_kernel_then_fails_once(cache_env, monkeypatch):
    from dsagen import deploy
    from dsagen.jit import KernelNotCached

    specs = _model_specs()
    absent = {specs[0], specs[-1]}
    tried = []

    def load(spec, index):
        tried.append((spec, index))
        if spec in absent:
            raise KernelNotCached(f"{spec.name()} is not cached")
        return f"loaded {spec.name()}"

    monkeypatch.setattr(deploy, "_cuda_index", lambda device: 3)
    monkeypatch.setattr(deploy, "_device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(deploy, "_load", load)
    with pytest.raises(deploy.KernelsNotCached) as e:
        dsagen.preload(model=str(CONFIG), device="cuda:3")
    assert tried == [(s, 3) for s in specs]  # every kernel was tried before the one error
    assert set(e.value.missing) == absent and f"2 of {len(specs)} kernel(s)" in str(e.value)
    absent.clear()
    assert dsagen.preload(model=str(CONFIG)) == [f"loaded {s.name()}" for s in specs]


def test_preload_needs_a_model_or_specs_and_a_cuda_device():
    with pytest.raises(ConfigError, match="model config"):
        dsagen.preload()
    with pytest.raises(ConfigError, match="not a CUDA device"):
        dsagen.preload(specs=[COMPACTIFY], device="cpu")


# ---- the CUDA driver requirement --------------------------------------------------------------------------------
class _Driver:
    def __init__(self, version: int):
        self.version = version

    def cuDriverGetVersion(self):
        return 0, self.version


@pytest.mark.parametrize("version,text", [(12080, "12.8"), (12040, "12.4")])
def test_an_older_driver_is_a_clear_error_at_kernel_load(version, text, monkeypatch):
    from dsagen.runtime import driver
    from dsagen.runtime.kernel import LoadedKernel

    monkeypatch.setattr(driver, "cu", lambda: _Driver(version))
    with pytest.raises(driver.CudaDriverError) as e:
        LoadedKernel("compactify_sm_90a", dict(KERNEL_RECORD), b"cubin", "sm_90a", 0, "sm_90a")
    msg = str(e.value)
    assert f"CUDA {text} (cuDriverGetVersion {version})" in msg and "CUDA 13.0 or newer" in msg
    assert "cuDriverGetVersion >= 13000" in msg and "driver >= 580" in msg


def test_a_cuda_13_driver_passes_the_check(monkeypatch):
    from dsagen.runtime import driver

    monkeypatch.setattr(driver, "cu", lambda: _Driver(13000))
    assert driver.require_driver() == 13000 and driver.version_text(13010) == "13.1"


# ---- dsagen env's GPU lines -------------------------------------------------------------------------------------
def test_env_says_no_cuda_device(cache_env, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpu_status"] == "no CUDA device" and info["gpus"] == [] and info["driver"] is None
    assert main(["env"]) == 0
    assert "GPUs: no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("version,ok", [(13000, True), (12080, False)])
def test_env_shows_each_gpu_and_the_driver(version, ok, cache_env, monkeypatch, capsys):
    import torch

    from dsagen.runtime import driver

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H200 #{i}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(driver, "cu", lambda: _Driver(version))
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpus"] == [{"index": i, "name": f"NVIDIA H200 #{i}", "capability": "9.0", "arch": "sm_90a"}
                            for i in range(2)]
    assert info["driver_version"] == version and info["driver_ok"] is ok
    assert info["gpu_status"] == "2 CUDA device(s)"
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"CUDA driver: {driver.version_text(version)}" in out and ("TOO OLD" in out) is (not ok)
    assert "NVIDIA H200 #1" in out and "9.0" in out and "sm_90a" in out


# ---- logging as a library ---------------------------------------------------------------------------------------
FAILING_BUILD = """
import sys
import dsagen.cli as cli
import dsagen.jit.toolchain as toolchain

def fail(canonical):
    raise RuntimeError("the compiler crashed")

cli._build_one = fail
toolchain.dsl_available = lambda: True
sys.exit(cli.main(["build", "--spec", sys.argv[1], "--jobs", "1"]))
"""


def test_a_failed_build_prints_its_error_line_once(cache_env):
    """With no logging configured, the FAILED line of `dsagen build` is printed by the command alone: the ERROR
    record logged with it goes to dsagen's NullHandler, not Python's last-resort handler (which printed it again)."""
    env = {k: v for k, v in os.environ.items() if k != "DSAGEN_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", FAILING_BUILD, COMPACTIFY.canonical_json()], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("the compiler crashed") == 1, r.stderr


def test_the_dsagen_logger_has_a_null_handler():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("dsagen").handlers)


class _Compiled:
    cubin, ptx, record, compile_seconds = b"cubin", "ptx", dict(KERNEL_RECORD), 0.01


@pytest.mark.parametrize("must_store,lazy", [(False, True), (True, False)])
def test_a_lazy_compile_logs_one_info_line(must_store, lazy, cache_env, monkeypatch, caplog):
    from dsagen.jit import build, resolve, toolchain

    monkeypatch.setattr(toolchain, "dsl_available", lambda: True)
    monkeypatch.setattr(build, "compile_module", lambda spec, source, workdir: _Compiled())
    caplog.set_level(logging.INFO, logger="dsagen")
    resolve(COMPACTIFY, jit=True, must_store=must_store)
    compiling = [r.getMessage() for r in caplog.records if r.name == "dsagen.jit"
                 and r.getMessage().startswith("compiling ")]
    assert compiling == [f"compiling {COMPACTIFY.name()} (lazy JIT) for sm_90a ..." if lazy
                         else f"compiling {COMPACTIFY.name()} for sm_90a"]


def test_waiting_on_another_compile_lock_logs_one_warning(cache_env, monkeypatch, caplog):
    monkeypatch.setattr(store_mod, "LOCK_WAIT_WARN_AFTER", 0.1)
    store = CacheStore.from_env()
    key = "ab" * 32
    caplog.set_level(logging.WARNING, logger="dsagen")
    waited = []

    def waiter():
        t0 = time.monotonic()
        with store.lock(key):
            waited.append(time.monotonic() - t0)

    with store.lock(key):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.6)
    t.join(timeout=30)
    assert waited and waited[0] >= 0.5
    warnings = [r.getMessage() for r in caplog.records if r.name == "dsagen.store"]
    assert len(warnings) == 1
    assert key in warnings[0] and str(cache_env / "locks" / f"{key}.lock") in warnings[0]
    with store.lock(key):  # a free lock: no wait, nothing logged
        pass
    assert len([r for r in caplog.records if r.name == "dsagen.store"]) == 1


# ---- dsagen verify on misfiled entries --------------------------------------------------------------------------
def _misfile(path: Path, to: Path) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, to)
    return to


def test_verify_reports_an_entry_under_another_keys_shard(cache_env, capsys):
    store = CacheStore.from_env()
    e = commit_fake(store)
    shard = "00" if e.key[:2] != "00" else "01"
    moved = _misfile(e.path, e.path.parents[1] / shard / e.key)
    assert store.lookup_identity("sm_90a", "compactify", e.manifest["identity"]) is None  # lookups ignore it
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert f"MISFILED DSAGEN_CACHE_DIR: {moved} " in out and "1 misfiled folder(s)" in out
    assert str(moved) in store.prune()  # what verify reports is what prune removes


def test_verify_reports_every_entry_below_a_badly_named_folder(cache_env, capsys):
    store = CacheStore.from_env()
    a, b = commit_fake(store), commit_fake(store, LOCAL)
    bad_arch = _misfile(a.path, cache_env / "v1" / "SM90" / "compactify" / a.key[:2] / a.key).parents[2]
    bad_shard = _misfile(b.path, b.path.parents[1] / "zz" / b.key).parent
    (cache_env / "v1" / "sm_90a" / "empty-folder").mkdir()  # no entry: prune's business, not verify's
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("MISFILED")] == \
        sorted([str(bad_arch), str(bad_shard)])
    assert "empty-folder" not in out and "2 misfiled folder(s)" in out


def test_preload_serving_looks_up_only_the_serving_kernels(cache_env, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    serving = specs_for_model(model_from_config(json.loads(CONFIG.read_text())), "sm_90a", serving=True)
    assert 0 < len(serving) < len(_model_specs())
    with pytest.raises(dsagen.deploy.KernelsNotCached) as e:
        dsagen.preload(model=str(CONFIG), serving=True)
    assert e.value.missing == serving
