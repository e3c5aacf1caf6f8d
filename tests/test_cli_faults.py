"""Faults a careless or hostile user can provoke in the command line, in spec parsing and in the public ops'
inputs. Each test's docstring names the fault it guards against; none needs a GPU or a compiler."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch

import dsagen
import dsagen.cli as cli
from dsagen.cli import main
from dsagen.spec import base as spec_base
from dsagen.spec import CompactifySpec, KernelSpec, LocalToGlobalSpec, SpecError, spec_types

ROOT = Path(__file__).resolve().parent.parent
SPEC = LocalToGlobalSpec(arch="sm_90a", threads=128).canonical_json()
CONTROL = "\x1b[2J\x1b]0;owned\x07\r\x08"      # clear screen, set title, bell, carriage return, backspace


@pytest.fixture
def no_dsl_needed(monkeypatch):
    """`dsagen build` past its CuTe-DSL check without the DSL (the cases here fail before compiling)."""
    import dsagen.jit.toolchain as tc

    monkeypatch.setattr(tc, "dsl_available", lambda: True)


def _no_raw_controls(text: str) -> bool:
    """No character of `text` is a control or other non-printable character, line breaks aside."""
    return all(c.isprintable() or c == "\n" for c in text)


def _run(args, *, stdout=subprocess.PIPE, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsagen.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          cwd=ROOT, timeout=120, env=env, **kw)


# ---- control characters in names and paths ---------------------------------------------------------------
def _commit_named(name: str):
    """A valid cache entry whose manifest's name is `name` (a manifest's name is any string)."""
    from cache_util import fake_entry
    from dsagen.store import CacheStore

    store = CacheStore.from_env()
    spec = CompactifySpec(arch="sm_90a")
    key, files, manifest = fake_entry(spec)
    manifest["name"] = name
    with store.lock(key):
        return store.commit(spec.arch, spec.op, key, files, manifest)


def test_list_escapes_control_characters_of_manifest_names(cache_env, capsys):
    """A manifest name holding terminal escapes is printed by `dsagen list` as escape sequences, not raw (a cache
    from elsewhere must not clear the screen or forge lines); `--json` stays JSON with the exact name."""
    name = f"evil{CONTROL}name"
    _commit_named(name)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert _no_raw_controls(out), repr(out)
    assert r"evil\x1b[2J\x1b]0;owned\x07\r\x08name" in out, out
    assert main(["list", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == [name]


def test_error_lines_escape_control_characters_of_spec_values(cache_env, capsys, no_dsl_needed):
    """A spec value holding terminal escapes, echoed in the one-line error, is escaped there too."""
    spec = json.dumps({"op": "compactify", "fields": {"arch": f"sm{CONTROL}"}})
    assert main(["build", "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert _no_raw_controls(err) and err.startswith("dsagen: error: ") and r"\x1b[2J" in err, repr(err)


@pytest.mark.parametrize("argv,status", [(["prune"], 0), (["env"], 0), (["verify"], 1)])
def test_plain_text_output_escapes_control_characters_of_paths(argv, status, tmp_path, monkeypatch, capsys):
    """A cache folder whose name holds control characters is printed escaped by every command that names it (prune's
    removed items and summary, env's layer table, verify's mismatches)."""
    root = tmp_path / f"cache{CONTROL}dir"
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    monkeypatch.setenv("DSAGEN_WHEEL_CACHES", "0")
    monkeypatch.setenv("DSAGEN_CACHE", "rw")
    entry = _commit_named(f"n{CONTROL}")
    (entry.path / "kernel.cubin").write_bytes(b"changed")      # a mismatch that verify and prune name
    assert main(argv) == status
    cap = capsys.readouterr()
    assert _no_raw_controls(cap.out) and _no_raw_controls(cap.err), (repr(cap.out), repr(cap.err))


# ---- SIGTERM during a one-kernel build --------------------------------------------------------------------
STALLED_BUILD = """
import os, sys, time
import dsagen.cli as cli
import dsagen.jit.build as build
import dsagen.jit.resolver as resolver
import dsagen.jit.toolchain as toolchain
import dsagen.store.store as store_mod

marks = os.environ["DSAGEN_TEST_MARKS"]
toolchain.dsl_available = lambda: True


def stall(where):   # says where it is, then waits to be terminated
    open(os.path.join(marks, where), "w").close()
    time.sleep(600)


if os.environ["DSAGEN_TEST_STALL"] == "compile":   # inside the compile folder, with a file written there
    def compile_module(spec, source, workdir):
        open(os.path.join(workdir, "partial.o"), "w").close()
        stall("compile")
    build.compile_module = compile_module
else:                                                # in the cache's staging folder, one file written
    resolver.compile_entry_files = lambda spec, source, material, identity: (
        {"kernel.py": source.encode(), "kernel.cubin": b"cubin"}, {"name": spec.name()})
    write_file = store_mod._write_file

    def stalled_write(path, data):   # the entry's files in <cache>/tmp/<staging>/, not the root's own files
        write_file(path, data)
        if path.parent.parent.name == "tmp":
            stall("commit")
    store_mod._write_file = stalled_write
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stall", ["compile", "commit"])
def test_sigterm_during_a_one_kernel_build_cleans_up_and_says_so(stall, cache_env, tmp_path):
    """SIGTERM to `dsagen build -j 4` of one spec (no worker pool) unwinds the build: no compile folder
    (dsagen-build-*) or staging folder (<cache>/tmp/*) is left, it prints that it was terminated and exits 143."""
    script = tmp_path / "stalled_build.py"
    script.write_text(STALLED_BUILD)
    marks, systmp = tmp_path / "marks", tmp_path / "systmp"
    marks.mkdir()
    systmp.mkdir()
    env = dict(os.environ, DSAGEN_TEST_MARKS=str(marks), DSAGEN_TEST_STALL=stall, TMPDIR=str(systmp),
               PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), "build", "--spec", SPEC, "-j", "4"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        end = time.monotonic() + 120
        while not (marks / stall).exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert (marks / stall).exists(), proc.communicate(timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "dsagen: terminated" in err and "Traceback" not in err, err
    assert [p.name for p in systmp.iterdir() if p.name.startswith("dsagen-build-")] == []
    assert not (cache_env / "tmp").exists() or list((cache_env / "tmp").iterdir()) == []


# ---- paths that are not UTF-8, printed to a strict UTF-8 stdout -------------------------------------------
def _strict_env(**extra) -> dict:
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict", PYTHONPATH=str(ROOT), DSAGEN_WHEEL_CACHES="0",
               DSAGEN_CACHE="rw", **extra)
    env.pop("DSAGEN_CACHE_PATH", None)
    return env


@pytest.mark.parametrize("argv,status", [(["prune"], 0), (["env"], 0), (["verify"], 1), (["pack", "--out", "OUT"], 0)])
def test_non_utf8_paths_print_escaped_on_a_strict_stdout(argv, status, tmp_path, monkeypatch):
    """A cache folder (or --out) whose name holds the byte 0xff (a surrogate escape in Python) is printed as
    `\\xff` on a strict UTF-8 stdout: the command succeeds without a UnicodeEncodeError after its work."""
    base = os.fsdecode(bytes(tmp_path) + b"/k\xff")
    os.mkdir(base)
    root = os.path.join(base, "cache")
    monkeypatch.setenv("DSAGEN_CACHE_DIR", root)
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    entry = _commit_named("n")
    if argv != ["pack", "--out", "OUT"]:
        (entry.path / "kernel.cubin").write_bytes(b"changed")  # a mismatch that verify and prune name by path
    argv = [os.path.join(base, "k.tar") if a == "OUT" else a for a in argv]
    r = _run(argv, env=_strict_env(DSAGEN_CACHE_DIR=root))
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == status and "Traceback" not in err, err
    assert b"\\xff" in r.stdout + r.stderr and b"\xff" not in r.stdout + r.stderr, r.stdout


def test_non_utf8_paths_stay_valid_json(tmp_path):
    """`dsagen env --json` with a cache folder named with the byte 0xff is JSON on a strict UTF-8 stdout."""
    root = os.fsdecode(bytes(tmp_path) + b"/c\xffche")
    r = _run(["env", "--json"], env=_strict_env(DSAGEN_CACHE_DIR=root))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"][0]["root"] == root


# ---- spec fields, unknown keys, -j and the size of a spec file --------------------------------------------
def _fields_of(kind_name: str) -> list:
    """(op, field) of every registered spec field whose annotation is exactly `kind_name` (int, bool or str)."""
    out = []
    for op, cls in sorted(spec_types().items()):
        hints = typing.get_type_hints(cls)
        out += [pytest.param(cls, f.name, id=f"{op}.{f.name}") for f in dataclasses.fields(cls)
                if hints[f.name] is {"int": int, "bool": bool, "str": str}[kind_name]]
    return out


def _refused(cls, field: str, value) -> str:
    """The SpecError message of `cls` with `field` set to `value`, from its canonical form as a spec file has it."""
    fields = dict(cls(arch="sm_90a").canonical()["fields"], **{field: value})
    spec = KernelSpec.from_canonical({"op": cls.op, "fields": fields})
    with pytest.raises(SpecError) as info:
        spec.check()
    return str(info.value)


@pytest.mark.parametrize("cls,field", _fields_of("int"))
@pytest.mark.parametrize("value", [8.0, True, "8", None])
def test_int_fields_refuse_floats_bools_and_strings(cls, field, value):
    """An int field given 8.0 or true (equal to an int in Python, but another cache key) is an error naming it."""
    msg = _refused(cls, field, value)
    assert f"field {field} must be an int, got {json.dumps(value)}" in msg, msg


@pytest.mark.parametrize("cls,field", _fields_of("bool"))
@pytest.mark.parametrize("value", [1, 0, "true"])
def test_bool_fields_refuse_numbers_and_strings(cls, field, value):
    """A bool field given 1 or 0 is an error naming it."""
    msg = _refused(cls, field, value)
    assert f"field {field} must be a bool, got {json.dumps(value)}" in msg, msg


@pytest.mark.parametrize("cls,field", _fields_of("str"))
@pytest.mark.parametrize("value", [1, True])
def test_str_fields_refuse_numbers(cls, field, value):
    """A str field given a number is an error naming it."""
    msg = _refused(cls, field, value)
    assert f"field {field} must be a str, got {json.dumps(value)}" in msg, msg


def test_well_typed_specs_still_pass():
    """Every preset spec (ints, bools and strs of their own types) passes the type rules."""
    from dsagen.spec import get_preset

    for arch in ("sm_90a", "sm_100a"):
        for spec in get_preset("deepseek-v3.2", arch):
            assert KernelSpec.from_canonical(json.loads(spec.canonical_json())).check() == spec


@pytest.fixture
def no_build(monkeypatch, no_dsl_needed):
    """`dsagen build` that must not get as far as building: a build attempt is a failed row (exit 1, not 2)."""
    def build_one(canonical):
        raise AssertionError(f"built {canonical}")

    monkeypatch.setattr(cli, "_build_one", build_one)


@pytest.mark.parametrize("value", ["8.0", "true"])
def test_build_refuses_a_mistyped_int_field(value, cache_env, capsys, no_build):
    """`dsagen build --spec` with warps_per_cta 8.0 or true is one error line naming the field, exit 2."""
    spec = '{"op": "compactify", "fields": {"arch": "sm_90a", "warps_per_cta": %s}}' % value
    assert main(["build", "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsagen: error: ") and f"field warps_per_cta must be an int, got {value}" in err, err


def test_unknown_top_level_keys_are_an_error(cache_env, capsys, no_build):
    """A spec with a key beside "op" and "fields" (an "arch" put at the top) is refused, naming the key, instead
    of silently building the default arch."""
    with pytest.raises(SpecError, match=r"unknown top-level key.*'arch'"):
        KernelSpec.from_canonical({"op": "compactify", "arch": "sm_100a", "fields": {"arch": "sm_90a"}})
    spec = '{"op": "compactify", "arch": "sm_100a", "fields": {"arch": "sm_90a"}}'
    assert main(["build", "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsagen: error: --spec ") and "'arch'" in err, err


@pytest.mark.parametrize("jobs", ["-5", "0"])
def test_jobs_must_be_positive(jobs, cache_env, capsys):
    """`-j -5` (or 0) is a usage error naming -j/--jobs, not one job."""
    assert main(["build", "--spec", SPEC, "-j", jobs]) == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and jobs in err and "positive" in err, err


def test_a_huge_spec_file_is_refused_without_reading_it_whole(cache_env, tmp_path, capsys, no_dsl_needed,
                                                              monkeypatch):
    """--spec-file larger than 16 MiB (or endless: /dev/zero) is an error naming it; the read stops after the cap."""
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate((16 << 20) + 1)                          # sparse: no disk used
    for path in (huge, Path("/dev/zero")):
        if not path.exists():
            continue
        assert main(["build", "--spec-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == (f"dsagen: error: --spec-file {path}: larger than 16 MiB (the most dsagen reads from one "
                       f"spec or config file)\n"), err

    small = tmp_path / "small.json"
    small.write_text(SPEC)
    monkeypatch.setattr(spec_base, "SPEC_FILE_MAX_BYTES", len(SPEC))
    assert main(["build", "--spec-file", str(small), "--dry-run"]) == 0
    capsys.readouterr()
    small.write_text(SPEC + " ")
    assert main(["build", "--spec-file", str(small), "--dry-run"]) == 2
    assert "larger than" in capsys.readouterr().err


def test_a_huge_model_config_is_refused(cache_env, tmp_path, capsys, no_dsl_needed):
    """--model larger than the same cap is an error naming it."""
    huge = tmp_path / "config.json"
    with open(huge, "wb") as f:
        f.truncate((16 << 20) + 1)
    assert main(["build", "--model", str(huge)]) == 2
    assert f"--model {huge}: larger than 16 MiB" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["num_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
                                   "index_head_dim", "index_topk"])
@pytest.mark.parametrize("value", [True, 64.0])
def test_model_attention_refuses_mistyped_ints(field, value):
    """A ModelAttention built in code with a bool or float for an int field is refused, naming the field."""
    from dsagen.spec.model_config import DEEPSEEK_V32, ModelConfigError

    model = dataclasses.replace(DEEPSEEK_V32, **{field: value})
    with pytest.raises(ModelConfigError, match=rf"{field} must be an int, got {json.dumps(value)}"):
        model.check()


def test_model_attention_refuses_a_mistyped_dtype():
    """A ModelAttention whose dtype is not a str is refused, naming it."""
    from dsagen.spec.model_config import DEEPSEEK_V32, ModelConfigError

    with pytest.raises(ModelConfigError, match=r"dtype must be a str, got 1"):
        dataclasses.replace(DEEPSEEK_V32, dtype=1).check()


# ---- --help and --version that cannot be written; a benchmark without CUDA --------------------------------
HELPS = [["--help"], ["--version"], ["build", "--help"], ["list", "--help"]]


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_into_a_closed_pipe_is_not_success(argv):
    """--help / --version whose reader is gone exit 1 quietly (as every command does), not 0."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = _run(argv, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 1 and r.stderr == b"", r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_into_a_full_device_is_an_error(argv):
    """--help / --version into a full device (`> /dev/full`) is one error line and exit 2, not 0."""
    with open("/dev/full", "wb") as full:
        r = _run(argv, stdout=full)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("dsagen: error: ") and "No space left" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_with_stdout_closed_is_an_error(argv):
    """--help / --version started with stdout closed (`>&-`) is an error, not 0."""
    r = subprocess.run(" ".join([sys.executable, "-m", "dsagen.cli", *argv, ">&-"]), shell=True, cwd=ROOT,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "dsagen: error: standard output is closed\n", r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fault is a machine without CUDA")
def test_bench_without_cuda_is_one_line(cache_env, capsys, monkeypatch):
    """`dsagen bench overhead` where torch has no CUDA is one error line naming the need, not a traceback."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["bench", "overhead"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dsagen: error: ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "benchmark 'overhead' needs a CUDA device" in lines[0], err


# ---- sparse-layout tensors given to the public ops --------------------------------------------------------
def _r(*shape):
    return torch.rand(*shape, dtype=torch.float32)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


_IDS = torch.tensor([[[0, 1], [1, -1], [2, 0], [3, 1]]], dtype=torch.int32)    # [B=1, S=4, topk=2]
_LEN = _i32(2, 1, 2, 2)
B, S, H, D = 1, 4, 2, 8

# One valid CPU call of each public op: name -> (function, keyword arguments); each tensor argument is then swapped
# for a sparse one in turn.
OP_CALLS = {
    "compactify": lambda: (dsagen.compactify, dict(topk_idxs=_IDS[0], topk_length=_LEN)),
    "local_to_global": lambda: (dsagen.local_to_global, dict(topk_idxs=_IDS, seqlen_k=4)),
    "lightning_indexer": lambda: (dsagen.lightning_indexer, dict(q=_r(B, S, H, D), k=_r(B, S, D),
                                                                 weights=_r(B, S, H), topk=2)),
    "lightning_indexer packed": lambda: (dsagen.lightning_indexer, dict(
        q=_r(1, S, H, D), k=_r(1, S, D), weights=_r(1, S, H), topk=2, cu_seqlens=_i32(0, 4),
        cu_seqlens_k=_i32(0, 4))),
    "indexer_scores": lambda: (dsagen.indexer_scores, dict(q_indexer=_r(B, S, H, D), k_indexer=_r(B, S, D),
                                                           weights=_r(B, S, H), q_causal_offsets=_i32(0))),
    "indexer_scores packed": lambda: (dsagen.indexer_scores, dict(
        q_indexer=_r(S, H, D), k_indexer=_r(S, D), weights=_r(S, H), cu_seqlens_q=_i32(0, 4),
        cu_seqlens_k=_i32(0, 4))),
    "indexer_topk": lambda: (dsagen.indexer_topk, dict(input_values=_r(4, 4), seq_lens=_i32(4, 4, 4, 4), top_k=2)),
    "indexer_forward_topk": lambda: (dsagen.indexer_forward_topk, dict(
        q_indexer=_r(B, S, H, D), k_indexer=_r(B, S, D), weights=_r(B, S, H), top_k=2, q_causal_offsets=_i32(0))),
    "sparse_indexer_score_recompute": lambda: (dsagen.sparse_indexer_score_recompute, dict(
        q_indexer=_r(B, S, H, D), k_indexer=_r(B, S, D), weights=_r(B, S, H), topk_indices=_IDS,
        topk_length=_LEN.view(1, 4))),
    "dense_indexer_score_recompute": lambda: (dsagen.dense_indexer_score_recompute, dict(
        q_indexer=_r(B, S, H, D), k_indexer=_r(B, S, D), weights=_r(B, S, H), q_causal_offsets=_i32(0))),
    "indexer_backward": lambda: (dsagen.indexer_backward, dict(
        index_q=_r(B, S, H, D), weights=_r(B, S, H), index_k=_r(B, S, D), attn_score=_r(B, S, 2),
        index_score=_r(B, S, 2), topk_indices=_IDS, grad_loss=torch.ones(()))),
    "dense_indexer_backward": lambda: (dsagen.dense_indexer_backward, dict(
        index_q=_r(B, S, H, D), weights=_r(B, S, H), index_k=_r(B, S, D), attn_score=_r(B, S, S),
        attn_l1norm=_r(B, S), index_score=_r(B, S, S), index_lse=_r(B, S), grad_loss=torch.ones(()),
        q_causal_offsets=_i32(0))),
    "sparse_attention": lambda: (dsagen.sparse_attention, dict(q=_r(4, H, D), kv=_r(4, D), topk_idxs=_IDS[0],
                                                               attn_sink=_r(H), topk_length=_LEN)),
    "sparse_attention_backward": lambda: (dsagen.sparse_attention_backward, dict(
        q=_r(4, H, D), kv=_r(4, D), out=_r(4, H, D), dout=_r(4, H, D), lse=_r(4, H), topk_idxs=_IDS[0],
        attn_sink=_r(H), topk_length=_LEN)),
    "sparse_attn_score_recompute": lambda: (dsagen.sparse_attn_score_recompute, dict(
        q_attn=_r(B, S, H, D), k_attn=_r(B, S, D), lse=_r(B, S, H), topk_indices=_IDS, topk_length=_LEN.view(1, 4))),
    "dense_indexer_kl_backward": lambda: (dsagen.dense_indexer_kl_backward, dict(
        q=_r(B, S, H, D), k=_r(B, S, D), lse=_r(B, S, H), index_q=_r(B, S, H, D), weights=_r(B, S, H),
        index_k=_r(B, S, D), q_causal_offsets=_i32(0))),
    "quantize_kv_fp8": lambda: (dsagen.quantize_kv_fp8, dict(kv=torch.zeros(2, 576, dtype=torch.bfloat16))),
    "dequantize_kv_fp8": lambda: (dsagen.dequantize_kv_fp8, dict(cache=torch.zeros(2, 656, dtype=torch.uint8))),
    "quantize_index_k_fp8": lambda: (dsagen.quantize_index_k_fp8, dict(k=torch.zeros(2, 4, 8, dtype=torch.bfloat16))),
    "indexer_decode_topk": lambda: (dsagen.indexer_decode_topk, dict(
        q_indexer=torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), weights=torch.zeros(1, 1, 2),
        k_cache=torch.zeros(2, 4, 8, dtype=torch.bfloat16), block_table=_i32(1, 0).view(1, 2),
        cache_seqlens=_i32(5), top_k=2)),
    "sparse_attention_decode": lambda: (dsagen.sparse_attention_decode, dict(
        q=torch.zeros(1, 1, 2, 576, dtype=torch.bfloat16), kv_cache=torch.zeros(2, 4, 1, 656, dtype=torch.uint8),
        indices=_i32(0, 5, -1).view(1, 1, 3), topk_length=_i32(2))),
    "dense_attn_score_recompute": lambda: (dsagen.dense_attn_score_recompute, dict(
        q=_r(B, S, H, D), k=_r(B, S, D), lse=_r(B, S, H), q_causal_offsets=_i32(0))),
    "qsa_indexed_forward": lambda: (dsagen.qsa_indexed_forward, dict(
        q=_r(4, H, D), k=_r(4, 1, D), v=_r(4, 1, D), indices=_i32(0, 1, 2, 3).repeat(4, 1))),
    "qsa_bitmap_forward": lambda: (dsagen.qsa_bitmap_forward, dict(
        q=_r(4, H, D), k=_r(4, 1, D), v=_r(4, 1, D), block_bitmap=torch.ones(4, 1, dtype=torch.uint8),
        cu_seqlens=_i32(0, 4))),
    "native_sparse_attention": lambda: (dsagen.native_sparse_attention, dict(
        query=_r(1, 4, H, D), key=_r(1, 4, 1, D), value=_r(1, 4, 1, D), g_cmp=_r(1, 4, H), g_slc=_r(1, 4, H),
        block_counts=1, block_size=2)),
    "native_sparse_attention selected": lambda: (dsagen.native_sparse_attention, dict(
        query=_r(1, 4, H, D), key=_r(1, 4, 1, D), value=_r(1, 4, 1, D),
        block_indices=torch.zeros(1, 4, 1, 1, dtype=torch.int32), block_counts=torch.ones(1, 4, 1, dtype=torch.int32),
        cu_seqlens=_i32(0, 4), block_size=2)),
}
OP_TENSOR_ARGS = [pytest.param(op, arg, id=f"{op}:{arg}") for op, call in OP_CALLS.items()
                  for arg, v in call()[1].items() if isinstance(v, torch.Tensor)]


def test_the_sparse_layout_cases_cover_every_public_op():
    """Every public op appears in OP_CALLS (so a new op gets its sparse-layout case)."""
    from dsagen import _OPS

    assert {name.split()[0] for name in OP_CALLS} == set(_OPS)


@pytest.mark.parametrize("op", list(OP_CALLS))
def test_the_sparse_layout_calls_are_valid(op):
    """Each call of OP_CALLS runs as given (so a refused sparse argument is refused for its layout alone)."""
    fn, kwargs = OP_CALLS[op]()
    fn(**kwargs, impl="reference")


@pytest.mark.parametrize("op,arg", OP_TENSOR_ARGS)
def test_sparse_coo_tensor_arguments_are_a_value_error(op, arg):
    """A sparse COO tensor for any tensor argument of a public op is a ValueError naming that argument, raised by the
    input checks before it can reach torch internals."""
    fn, kwargs = OP_CALLS[op]()
    kwargs[arg] = kwargs[arg].to_sparse()
    with pytest.raises(ValueError, match=rf"^{arg} must be a dense \(strided\) tensor, got layout torch\.sparse_coo$"):
        fn(**kwargs, impl="reference")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"])
@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_compressed_sparse_layouts_are_a_value_error(layout, impl):
    """CSR, CSC, BSR and BSC tensors are refused alike, for either impl (the check runs before dispatch)."""
    ids = _IDS[0]
    sparse = ids.to_sparse(layout=getattr(torch, layout), blocksize=(1, 1) if "bs" in layout else None)
    message = rf"^topk_idxs must be a dense \(strided\) tensor, got layout torch\.{layout}$"
    with pytest.raises(ValueError, match=message):
        dsagen.compactify(sparse, impl=impl)


def test_the_workspace_helper_refuses_sparse_tensors():
    """sparse_attention_backward_workspace (no impl argument) refuses a sparse q, naming it."""
    with pytest.raises(ValueError, match=r"^q must be a dense \(strided\) tensor"):
        dsagen.sparse_attention_backward_workspace(_r(4, H, D).to_sparse(), _r(4, D), _IDS[0])
