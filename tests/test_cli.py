"""The dsagen command line, end to end on a private cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsagen.cli import main
from dsagen.spec import CompactifySpec, LocalToGlobalSpec

SPEC = LocalToGlobalSpec(arch="sm_90a", threads=128).canonical_json()
SPEC_NAME = LocalToGlobalSpec(arch="sm_90a", threads=128).name()


def test_env_and_empty_list(cache_env, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "DSAGEN_CACHE_DIR" in out and str(cache_env) in out and "toolchain" in out
    assert main(["list"]) == 0 and "empty" in capsys.readouterr().out


def test_unknown_preset_is_an_error(cache_env):
    with pytest.raises(ValueError, match="unknown preset"):
        main(["build", "--preset", "nope"])


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


@pytest.mark.compile
def test_build_from_tests_collects_required_specs(cache_env, capsys):
    assert main(["build", "--from-tests", "tests/gpu/test_foundation.py", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "runtime_probe_cluster_sm_90a" in out and "local_to_global_sm_100a" in out
