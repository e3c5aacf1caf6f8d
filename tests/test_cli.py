"""The dsagen command line, end to end on a private cache."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import dsagen
import dsagen.cli as cli
from dsagen.cli import main
from dsagen.errors import ConfigError
from dsagen.spec import CompactifySpec, LocalToGlobalSpec

ROOT = Path(__file__).resolve().parent.parent

SPEC = LocalToGlobalSpec(arch="sm_90a", threads=128).canonical_json()
SPEC_NAME = LocalToGlobalSpec(arch="sm_90a", threads=128).name()


def test_env_and_empty_list(cache_env, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "DSAGEN_CACHE_DIR" in out and str(cache_env) in out and "toolchain" in out
    assert main(["list"]) == 0 and "empty" in capsys.readouterr().out


def test_unknown_preset_is_an_error(cache_env, capsys):
    assert main(["build", "--preset", "nope"]) == 2
    assert capsys.readouterr().err == "dsagen: error: unknown preset 'nope'; known: deepseek-v3.2, nsa, qsa\n"


@pytest.mark.compile
def test_build_list_show_verify_prune_pack_unpack(cache_env, tmp_path, capsys, monkeypatch):
    assert main(["build", "--spec", SPEC, "--spec", CompactifySpec(arch="sm_90a").canonical_json(), "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert SPEC_NAME in out and "compactify_sm_90a" in out and "0 failed" in out
    assert main(["build", "--spec", SPEC, "-j", "1"]) == 0
    assert "1 cached" in capsys.readouterr().out

    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in rows}
    assert {SPEC_NAME, "compactify_sm_90a"} <= names
    key = next(r["key"] for r in rows if r["name"] == "compactify_sm_90a")

    assert main(["show", key[:10]]) == 0
    assert json.loads(capsys.readouterr().out)["spec"] == CompactifySpec(arch="sm_90a").canonical()
    assert main(["show", "no-such-kernel"]) == 1

    assert main(["verify"]) == 0
    assert "0 bad" in capsys.readouterr().out
    path = next(r["path"] for r in rows if r["key"] == key)
    cubin = f"{path}/kernel.cubin"
    data = bytearray(Path(cubin).read_bytes())
    data[100] ^= 0x40
    Path(cubin).write_bytes(bytes(data))
    assert main(["verify"]) == 1
    assert "MISMATCH" in capsys.readouterr().out

    assert main(["prune"]) == 0                          # removes the corrupt entry
    capsys.readouterr()
    assert main(["verify"]) == 0

    pack_file = tmp_path / "k.tar"
    assert main(["pack", "--out", str(pack_file)]) == 0
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(tmp_path / "other"))
    assert main(["unpack", str(pack_file)]) == 0
    assert "unpacked" in capsys.readouterr().out
    assert main(["list", "--json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == names - {"compactify_sm_90a"}


# ---- user errors: one line on stderr, exit 2, no traceback -------------------------------------------
def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dsagen: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_dsl_needed(monkeypatch):
    """`dsagen build` past its CuTe-DSL check without the DSL (the cases here fail before compiling)."""
    import dsagen.jit.toolchain as tc

    monkeypatch.setattr(tc, "dsl_available", lambda: True)


USER_ERRORS = {
    "bad spec JSON": (["build", "--spec", "{bad"], {}, r"--spec '\{bad': not valid JSON"),
    "spec not an object": (["build", "--spec", "[1]"], {}, r"a spec is a JSON object"),
    "spec missing a field": (["build", "--spec", '{"op": "compactify", "fields": {}}'], {},
                             r"missing 1 required positional argument: 'arch'"),
    "unknown op": (["build", "--spec", '{"op": "nope", "fields": {"arch": "sm_90a"}}'], {}, r"unknown op 'nope'"),
    "invalid spec field": (["build", "--spec", '{"op": "compactify", "fields": {"arch": "sm_7"}}'], {},
                           r"arch 'sm_7' is unknown"),
    "unknown preset": (["build", "--preset", "nope"], {}, r"unknown preset 'nope'; known: deepseek-v3.2"),
    "unknown --arch": (["build", "--preset", "deepseek-v3.2", "--arch", "sm_90a,sm_80"], {},
                       r"unknown arch 'sm_80'; known: sm_100a, sm_90a"),
    "empty --arch": (["build", "--preset", "deepseek-v3.2", "--arch", ","], {}, r"--arch ',': give one or more"),
    "missing --spec-file": (["build", "--spec-file", "/nonexistent/specs.json"], {},
                            r"No such file or directory: '/nonexistent/specs.json'"),
    "nothing to build": (["build"], {}, r"nothing to build: give --preset"),
    "DSAGEN_CACHE=ro": (["build", "--spec", SPEC], {"DSAGEN_CACHE": "ro"}, r"DSAGEN_CACHE=ro \(never writes\)"),
    "DSAGEN_CACHE=off": (["build", "--spec", SPEC], {"DSAGEN_CACHE": "off"}, r"DSAGEN_CACHE=off"),
    "bad DSAGEN_CACHE": (["list"], {"DSAGEN_CACHE": "sometimes"}, r"DSAGEN_CACHE='sometimes': expected rw, ro or off"),
    "bad DSAGEN_VERIFY": (["verify"], {"DSAGEN_VERIFY": "maybe"}, r"DSAGEN_VERIFY='maybe': expected one of"),
    "bad DSAGEN_ARCH": (["build", "--preset", "deepseek-v3.2"], {"DSAGEN_ARCH": "sm_80"},
                        r"DSAGEN_ARCH='sm_80': unknown arch 'sm_80'"),
    "bad DSAGEN_DEBUG": (["list"], {"DSAGEN_DEBUG": "loud"}, r"DSAGEN_DEBUG='loud': expected one of"),
    "missing pack": (["unpack", "/nonexistent/k.tar"], {}, r"/nonexistent/k\.tar"),
    "pack into a missing folder": (["pack", "--out", "/nonexistent/dir/k.tar"], {}, r"No such file or directory"),
    "unknown bench": (["bench", "nope"], {}, r"no benchmark 'nope'"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_error_is_one_line_and_exit_2(case, cache_env, capsys, monkeypatch, no_dsl_needed):
    argv, env_vars, message = USER_ERRORS[case]
    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 2
    assert re.search(message, _one_line_error(capsys))


def test_not_a_tar_pack_is_one_line(cache_env, tmp_path, capsys):
    bad = tmp_path / "k.tar"
    bad.write_text("this is not a tar file\n" * 40)
    assert main(["unpack", str(bad)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"dsagen: error: {bad}: not a ") and "tar file" in line, line


@pytest.mark.parametrize("how", ["--debug first", "--debug after the command", "DSAGEN_DEBUG=1"])
def test_debug_shows_the_traceback(how, cache_env, capsys, monkeypatch):
    argv = ["build", "--preset", "nope"]
    if how == "--debug first":
        argv = ["--debug", *argv]
    elif how == "--debug after the command":
        argv = ["build", "--debug", "--preset", "nope"]
    else:
        monkeypatch.setenv("DSAGEN_DEBUG", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "SpecError: unknown preset 'nope'" in err
    assert err.endswith("dsagen: error: unknown preset 'nope'; known: deepseek-v3.2, nsa, qsa\n")


def test_a_bug_is_not_hidden(cache_env, monkeypatch):
    """Only dsagen's own errors and OSError become one line: anything else is a bug and propagates."""
    monkeypatch.setattr(cli, "cmd_list", lambda args: 1 // 0)
    monkeypatch.setattr(cli, "make_parser", _parser_with(cli.make_parser, "list", cli.cmd_list))
    with pytest.raises(ZeroDivisionError):
        main(["list"])


def _parser_with(make, command, fn):
    def parser():
        p = make()
        p._subparsers._group_actions[0].choices[command].set_defaults(fn=fn)
        return p
    return parser


def _run_cli(args, stdout, **kw):
    return subprocess.run([sys.executable, "-m", "dsagen.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT, timeout=120, **kw)


@pytest.mark.parametrize("command", [["env"], ["list", "--json"]])
def test_closed_pipe_exits_quietly(command, cache_env):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write, like `dsagen env | head -0`
    try:
        r = _run_cli(command, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 1, r.stderr
    assert r.stderr == "", r.stderr


def test_pipe_into_head(cache_env):
    r = subprocess.run(f"{sys.executable} -m dsagen.cli env | head -1", shell=True, capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout == f"dsagen {dsagen.__version__} (Python {sys.version.split()[0]})\n"
    assert r.stderr == ""


# ---- DSAGEN_LOCK_TIMEOUT ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf", "1e999", "abc", ""])
def test_lock_timeout_rejects_bad_values(value, cache_env, capsys, monkeypatch, no_dsl_needed):
    from dsagen import env

    monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", value)
    with pytest.raises(ConfigError, match=f"DSAGEN_LOCK_TIMEOUT='{value}': expected a"):
        env.LOCK_TIMEOUT.get()
    assert main(["build", "--spec", SPEC]) == 2
    assert f"dsagen: error: DSAGEN_LOCK_TIMEOUT='{value}'" in _one_line_error(capsys)
    assert main(["env"]) == 0
    assert "INVALID: DSAGEN_LOCK_TIMEOUT" in capsys.readouterr().out


@pytest.mark.parametrize("value,seconds", [("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_lock_timeout_accepts_finite_non_negative(value, seconds, monkeypatch):
    from dsagen import env

    monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", value)
    assert env.LOCK_TIMEOUT.get() == seconds


# ---- --arch with every spec source (no compiling: _build_one is replaced) ---------------------------------
@pytest.fixture
def fake_build(monkeypatch, no_dsl_needed):
    """Record what `dsagen build` (-j 1) would build instead of building it."""
    built = []

    def build_one(canonical):
        from dsagen.spec import KernelSpec

        spec = KernelSpec.from_canonical(canonical)
        built.append(spec)
        return {"name": spec.name(), "op": spec.op, "arch": spec.arch, "key": "0" * 64, "status": "built",
                "seconds": 0.0, "regs": 1, "smem": 0, "path": "x"}

    monkeypatch.setattr(cli, "_build_one", build_one)
    return built


def test_arch_retargets_spec_and_spec_file(cache_env, tmp_path, fake_build, capsys, monkeypatch):
    monkeypatch.setenv("DSAGEN_ARCH", "sm_100a")
    assert main(["build", "--spec", SPEC, "-j", "1"]) == 0          # no --arch: the spec's own arch
    assert fake_build == [LocalToGlobalSpec(arch="sm_90a", threads=128)]
    fake_build.clear()
    capsys.readouterr()
    assert main(["build", "--spec", SPEC, "--arch", "sm_100a", "-j", "1"]) == 0
    assert fake_build == [LocalToGlobalSpec(arch="sm_100a", threads=128)]
    assert "sm_90a" not in capsys.readouterr().out
    fake_build.clear()
    f = tmp_path / "specs.json"
    f.write_text(json.dumps([CompactifySpec(arch="sm_90a").canonical(), CompactifySpec(arch="sm_100a").canonical()]))
    assert main(["build", "--spec-file", str(f), "--arch", "sm_90a,sm_100a", "-j", "1"]) == 0
    assert fake_build == [CompactifySpec(arch="sm_90a"), CompactifySpec(arch="sm_100a")]
    fake_build.clear()
    assert main(["build", "--spec-file", str(f), "--arch", "sm_100a", "-j", "1"]) == 0
    assert fake_build == [CompactifySpec(arch="sm_100a")]


def test_build_reads_the_gpu_tests_spec_file(cache_env, fake_build):
    """The GPU tests' kernels come from the data file tests/gpu/required_specs.json, in its order."""
    data = Path(__file__).resolve().parent / "gpu" / "required_specs.json"
    assert main(["build", "--spec-file", str(data), "-j", "1"]) == 0
    assert [s.canonical() for s in fake_build] == json.loads(data.read_text())



def test_preset_names_the_ops_an_arch_lacks(cache_env, fake_build, capsys):
    assert main(["build", "--preset", "deepseek-v3.2", "--arch", "sm_100a", "-j", "1"]) == 0
    assert {s.op for s in fake_build} == {"compactify", "local_to_global"}
    assert {s.arch for s in fake_build} == {"sm_100a"}
    err = capsys.readouterr().err
    assert ("dsagen: preset 'deepseek-v3.2' has no sm_100a kernels yet for: dense_attn_score_recompute, "
            "dense_indexer_backward, indexer_backward, "
            "indexer_scores_mask_lse, indexer_topk, kv_fp8_codec, "
            "lightning_indexer_score, lightning_indexer_topk, row_scatter_add, sparse_attention_bwd, "
            "sparse_attention_bwd_order, sparse_attention_combine, "
            "sparse_attention_fwd, sparse_attn_score_recompute, sparse_indexer_score_recompute") in err
    fake_build.clear()
    assert main(["build", "--preset", "deepseek-v3.2", "--arch", "sm_90a", "-j", "1"]) == 0
    assert "has no" not in capsys.readouterr().err
    assert {s.op for s in fake_build} >= {"lightning_indexer_score", "sparse_attention_fwd", "sparse_attention_bwd"}


# ---- build honesty: "built" only for what the cache holds -------------------------------------------------
def test_build_refuses_cache_ro_or_off_before_building(cache_env, fake_build, capsys, monkeypatch):
    for mode in ("ro", "off", "OFF"):
        monkeypatch.setenv("DSAGEN_CACHE", mode)
        assert main(["build", "--spec", SPEC, "-j", "1"]) == 2
        assert "unset it or set DSAGEN_CACHE=rw" in _one_line_error(capsys)
    assert fake_build == []


@pytest.mark.parametrize("path", ["gone", None])
def test_build_fails_when_the_entry_is_not_on_disk(path, cache_env, tmp_path, capsys, monkeypatch, no_dsl_needed):
    """An entry removed right after it was stored (a concurrent prune), or one only in memory, is FAILED."""
    import dsagen.jit
    from dsagen.store.store import Entry

    calls = []

    def resolve(spec, store=None, *, jit=None, must_store=False):
        calls.append((jit, must_store))
        return Entry(None if path is None else tmp_path / path, {"key": "f" * 64, "kernel": {}}, None)

    monkeypatch.setattr(dsagen.jit, "resolve", resolve)
    assert main(["build", "--spec", SPEC, "-j", "1"]) == 1
    cap = capsys.readouterr()
    assert calls == [(True, True)]
    assert "0 built, 0 cached, 1 failed" in cap.out
    assert f"FAILED {SPEC_NAME}: CacheNotStored: {SPEC_NAME} was compiled but is not in the cache" in cap.err


@pytest.mark.compile
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_build_fails_when_the_disk_refuses_the_entry(err, cache_env, capsys, monkeypatch):
    from dsagen.store.store import CacheStore

    def commit(self, *a, **kw):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(CacheStore, "commit", commit)
    assert main(["build", "--spec", CompactifySpec(arch="sm_90a").canonical_json(), "-j", "1"]) == 1
    cap = capsys.readouterr()
    assert "0 built, 0 cached, 1 failed" in cap.out and "FAILED" in cap.out
    assert "FAILED compactify_sm_90a: CacheNotStored:" in cap.err and os.strerror(err) in cap.err
    assert main(["list"]) == 0 and "empty" in capsys.readouterr().out


@pytest.mark.compile
def test_build_fails_on_a_lock_timeout(cache_env, capsys, monkeypatch):
    from dsagen.jit.keys import key_material, key_of
    from dsagen.store.store import CacheStore
    from dsagen.jit.render import render
    from dsagen.jit.toolchain import toolchain_versions

    spec = CompactifySpec(arch="sm_90a")
    key = key_of(key_material(spec, render(spec), toolchain_versions()))
    monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", "0.2")
    with CacheStore.from_env().lock(key):                 # another builder holds the kernel's lock
        assert main(["build", "--spec", spec.canonical_json(), "-j", "1"]) == 1
    cap = capsys.readouterr()
    assert "0 built, 0 cached, 1 failed" in cap.out
    assert "CacheNotStored" in cap.err and "timed out waiting for the compile lock" in cap.err
    assert main(["build", "--spec", spec.canonical_json(), "-j", "1"]) == 0   # the lock is free again
    assert "1 built" in capsys.readouterr().out


# ---- killing `dsagen build -j N` stops its workers -------------------------------------------------------
SLOW_BUILD = """
import os, sys, time
import dsagen
import dsagen.cli as cli
import dsagen.jit.toolchain as toolchain

def slow_build_one(canonical):   # a worker that takes long: it records its pid and sleeps
    open(os.path.join(os.environ["DSAGEN_TEST_MARKS"], str(os.getpid())), "w").close()
    time.sleep(600)

cli._build_one = slow_build_one        # the spawned workers import this module as __mp_main__ too
toolchain.dsl_available = lambda: True
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


def _wait(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_build_stops_its_workers(sig, cache_env, tmp_path):
    script = tmp_path / "slow_build.py"
    script.write_text(SLOW_BUILD)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, DSAGEN_TEST_MARKS=str(marks), PYTHONPATH=str(ROOT))
    specs = [CompactifySpec(arch="sm_90a").canonical_json(), SPEC]
    # the build starts with SIGINT's default disposition, as from a terminal: a test run launched as a background
    # job (`cmd &` in a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    parent = subprocess.Popen([sys.executable, str(script), "build", "--spec", specs[0], "--spec", specs[1],
                               "-j", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait(lambda: len(list(marks.iterdir())) == 2, 60), "the two workers did not start"
        workers = [int(p.name) for p in marks.iterdir()]
        assert not any(_gone(w) for w in workers)
        parent.send_signal(sig)
        out, err = parent.communicate(timeout=30)
        assert _wait(lambda: all(_gone(w) for w in workers), 10), f"workers {workers} outlived the build"
    finally:
        parent.kill()
        parent.wait()
        for w in [int(p.name) for p in marks.iterdir()]:
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
    assert parent.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[sig], err
    if sig != signal.SIGKILL:
        assert "Traceback" not in err, err


# ---- everyday conveniences ------------------------------------------------------------------------------
def test_version_and_python_m_dsagen():
    from dsagen._version import __version__

    assert dsagen.__version__ == __version__
    for argv in (["-m", "dsagen", "--version"], ["-m", "dsagen.cli", "--version"]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0 and r.stdout == f"dsagen {__version__}\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "dsagen", "build", "--preset", "nope"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr == "dsagen: error: unknown preset 'nope'; known: deepseek-v3.2, nsa, qsa\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "dsagen._version.__version__"' in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]


def test_every_command_and_argument_has_help():
    parser = cli.make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helped = {c.dest for c in sub._choices_actions if c.help}
    assert helped == set(sub.choices), set(sub.choices) - helped
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"dsagen {name}: {action.option_strings or action.dest} has no help"
        assert all(len(line) <= 100 for line in p.format_help().splitlines() if not line.startswith("usage")), name
    for action in parser._actions:
        assert action.help, action.option_strings
    build_help = sub.choices["build"].format_help()
    assert '{"op": OP, "fields": {FIELD: VALUE, ...}}' in build_help and "--model CONFIG.json" in build_help
    from dsagen.spec import spec_types

    assert all(f"  {op}: arch" in build_help for op in spec_types())


def test_tables_fit_100_columns(cache_env, capsys, monkeypatch):
    from cache_util import commit_fake
    from dsagen.kernels.testing.spec import RuntimeProbeSpec
    from dsagen.store import CacheStore

    store = CacheStore.from_env()
    long = RuntimeProbeSpec(arch="sm_90a", feature="smem", smem_bytes=227 * 1024)
    for spec in (long, CompactifySpec(arch="sm_90a")):
        commit_fake(store, spec)
    monkeypatch.setenv("DSAGEN_CACHE_PATH", "/a/very/long/read/only/cache/path/that/goes/on/and/on/" + "x" * 80)
    for argv in (["list"], ["env"], ["build", "--spec", long.canonical_json(), "--dry-run"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= 100, (argv, out)
    rows = [{"name": "n" * 150, "source": "s" * 90, "arch": "sm_90a"}]
    table = cli._table(rows, ["name", "arch", "source"], shrink=("name", "source"))
    assert max(map(len, table.splitlines())) == 100 and ".." in table.splitlines()[2]
    assert cli._fit("abcdefghij", 6) == "ab..ij" and cli._fit("abc", 6) == "abc"


def test_list_shows_where_each_entry_comes_from(cache_env, tmp_path, capsys, monkeypatch):
    from cache_util import commit_fake
    from dsagen.store import CacheStore

    ro = tmp_path / "ro"
    commit_fake(CacheStore(ro, []), LocalToGlobalSpec(arch="sm_90a"))
    commit_fake(CacheStore.from_env())
    monkeypatch.setenv("DSAGEN_CACHE_PATH", str(ro))
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["source"], r["layer"]) for r in rows] == [
        ("local_to_global_sm_90a", "DSAGEN_CACHE_PATH", str(ro)), ("compactify_sm_90a", "DSAGEN_CACHE_DIR", str(cache_env))]
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "arch", "key", "created", "source"]
    assert lines[2].split()[-1] == "DSAGEN_CACHE_PATH" and lines[3].split()[-1] == "DSAGEN_CACHE_DIR"


def test_show_by_op_name(cache_env, capsys):
    from cache_util import commit_fake
    from dsagen.store import CacheStore

    store = CacheStore.from_env()
    a = commit_fake(store, LocalToGlobalSpec(arch="sm_90a"))
    b = commit_fake(store, LocalToGlobalSpec(arch="sm_90a", threads=128))
    commit_fake(store)
    assert main(["show", "local_to_global"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert isinstance(shown, list) and sorted(m["key"] for m in shown) == sorted([a.key, b.key])
    assert main(["show", "compactify"]) == 0 and json.loads(capsys.readouterr().out)["op"] == "compactify"
    assert main(["show", "lightning_indexer_score"]) == 1
    err = capsys.readouterr().err
    assert "'lightning_indexer_score' is an op; the cache holds none of its kernels" in err
    assert main(["show", "nonsense"]) == 1 and "is an op" not in capsys.readouterr().err


def test_env_json(cache_env, capsys, monkeypatch):
    monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", "-1")
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["version"] == dsagen.__version__
    by_name = {v["variable"]: v for v in info["variables"]}
    assert by_name["DSAGEN_CACHE_DIR"] == {"variable": "DSAGEN_CACHE_DIR", "value": str(cache_env),
                                           "effective": str(cache_env), "valid": True, "meaning": "writable cache root"}
    assert not by_name["DSAGEN_LOCK_TIMEOUT"]["valid"] and "INVALID" in by_name["DSAGEN_LOCK_TIMEOUT"]["effective"]
    assert by_name["DSAGEN_CACHE_PATH"]["value"] is None and by_name["DSAGEN_CACHE_PATH"]["effective"] == []
    assert info["layers"] == [{"root": str(cache_env), "source": "DSAGEN_CACHE_DIR", "writable": True}]
    assert set(info) >= {"toolchain", "torch", "cuda", "devices", "python"}


LOGGED = textwrap.dedent("""
    import logging, warnings
    from cache_util import commit_fake
    from dsagen.jit import resolve
    from dsagen.spec import CompactifySpec, LocalToGlobalSpec
    from dsagen.store import CacheStore
    log = logging.getLogger("dsagen")
    null = sum(isinstance(h, logging.NullHandler) for h in log.handlers)
    print("handlers", len(log.handlers) - null, "level", log.level, "null", null)
    commit_fake(CacheStore.from_env())
    resolve(CompactifySpec(arch="sm_90a"))
    try:
        resolve(LocalToGlobalSpec(arch="sm_90a"))
    except LookupError:
        pass
""")


@pytest.mark.parametrize("level", [None, "INFO", "debug"])
def test_logging_through_the_standard_module(level, cache_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DSAGEN_LOG_LEVEL"}
    env.update(DSAGEN_DISABLE_JIT="1", PYTHONPATH=str(ROOT / "tests"))
    if level is not None:
        env["DSAGEN_LOG_LEVEL"] = level
    r = subprocess.run([sys.executable, "-c", LOGGED], env=env, capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    if level is None:  # no handler, no level, nothing printed
        assert r.stdout == "handlers 0 level 0 null 1\n" and r.stderr == ""
        return
    import logging

    assert r.stdout == f"handlers 1 level {getattr(logging, level.upper())} null 1\n"
    assert "dsagen.jit INFO: cache miss: local_to_global_sm_90a (JIT not available)" in r.stderr
    hit = "dsagen.jit DEBUG: cache hit: compactify_sm_90a in DSAGEN_CACHE_DIR"
    loaded = "dsagen.store DEBUG: loaded entry compactify_sm_90a"
    assert (hit in r.stderr and loaded in r.stderr) == (level == "debug")


def test_bad_log_level_warns_at_import_and_fails_a_build(cache_env, capsys, monkeypatch):
    env = dict(os.environ, DSAGEN_LOG_LEVEL="loud")
    r = subprocess.run([sys.executable, "-c", "import dsagen"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "DSAGEN_LOG_LEVEL='loud': expected one of DEBUG" in r.stderr
    monkeypatch.setenv("DSAGEN_LOG_LEVEL", "loud")
    assert main(["build", "--spec", SPEC]) == 2
    assert "dsagen: error: DSAGEN_LOG_LEVEL='loud'" in capsys.readouterr().err
