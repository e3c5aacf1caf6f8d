"""The cache: keys, the commit protocol, racing processes, crashes, corruption, layers, JIT switches,
deployments without CuTe-DSL, pack/unpack."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsagen.jit import KernelNotCached, identity_of, key_material, key_of, resolve

from dsagen.store import CacheStore
from dsagen.jit.keys import identity_material
from dsagen.jit.keys import canonical_json
from dsagen.store.pack import PackError, pack, unpack
from dsagen.jit import toolchain
from dsagen.jit.render import render
from dsagen.spec import CompactifySpec, LocalToGlobalSpec

from cache_util import commit_fake, fake_entry

ROOT = Path(__file__).resolve().parent.parent
TC = {"nvidia-cutlass-dsl": "4.8.1"}


def _key(spec, source=None, toolchain=TC):
    return key_of(key_material(spec, source if source is not None else render(spec), toolchain))


# ---- keys -----------------------------------------------------------------------------------------
def test_key_changes_with_every_spec_field_and_arch():
    base = LocalToGlobalSpec(arch="sm_90a")
    variants = [LocalToGlobalSpec(arch="sm_100a"), LocalToGlobalSpec(arch="sm_90a", threads=128),
                LocalToGlobalSpec(arch="sm_90a", items_per_thread=2), CompactifySpec(arch="sm_90a")]
    keys = {_key(base)} | {_key(v) for v in variants}
    assert len(keys) == 1 + len(variants)


def test_key_changes_with_source_toolchain_and_helpers(monkeypatch):
    spec = LocalToGlobalSpec(arch="sm_90a")
    src = render(spec)
    k0 = _key(spec, src)
    assert _key(spec, src + "\n# edited\n") != k0
    assert _key(spec, src, {"nvidia-cutlass-dsl": "4.9.0"}) != k0
    m = key_material(spec, src, TC)
    m2 = dict(m, helpers={"dsagen.kernels.x": "0" * 64})
    assert key_of(m2) != key_of(m)



def test_identity_follows_templates_and_helpers_but_not_toolchain(monkeypatch, tmp_path):
    import shutil

    import dsagen.jit.render as r

    spec = LocalToGlobalSpec(arch="sm_90a")
    ident = identity_of(spec)
    assert ident == identity_of(LocalToGlobalSpec(arch="sm_90a")) != identity_of(LocalToGlobalSpec(arch="sm_100a"))
    assert "indices/local_to_global.py.j2" in identity_material(spec)["templates"]
    assert "_kernel_module.py.j2" in identity_material(spec)["templates"]  # the base it extends
    templates = tmp_path / "templates"
    shutil.copytree(r.TEMPLATES, templates)
    monkeypatch.setattr(r, "TEMPLATES", templates)
    assert identity_of(spec) == ident
    base = templates / "_kernel_module.py.j2"
    base.write_text(base.read_text() + "# changed\n")
    assert identity_of(spec) != ident


def _sparse_attention_specs():
    from dsagen.kernels.sparse_mla.spec import SparseAttnFwdSpec

    return [SparseAttnFwdSpec(arch="sm_90a"), SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512)]


def test_identity_follows_included_and_imported_templates(monkeypatch, tmp_path):
    """A template that extends, includes or imports others ({% extends %}: every kernel module's base; no template is
    split into parts now that kernel bodies are Python modules) has every file in its identity, and editing any of
    them changes the identity."""
    import shutil

    import dsagen.jit.render as r
    from dsagen.jit.render import template_name
    from dsagen.spec import get_preset

    templates = tmp_path / "templates"
    shutil.copytree(r.TEMPLATES, templates)
    monkeypatch.setattr(r, "TEMPLATES", templates)
    specs = get_preset("deepseek-v3.2", "sm_90a") + _sparse_attention_specs()
    parts = {t for s in specs for t in identity_material(s)["templates"] if t != template_name(s)}
    assert "_kernel_module.py.j2" in parts
    for part in sorted(parts):
        users = [s for s in specs if part in identity_material(s)["templates"]]
        assert users, part
        before = [identity_of(s) for s in users]
        path = templates / part
        path.write_text(path.read_text() + "{#- changed #}\n")
        assert all(identity_of(s) != b for s, b in zip(users, before)), part


def test_identity_covers_every_template_a_render_loads(monkeypatch):
    """template_sources (what the identity hashes, found without jinja2) lists at least every file jinja2 loads to
    render the spec: no template reference it cannot follow (a name computed at render time would be one)."""
    import jinja2

    import dsagen.jit.render as r
    from dsagen.jit.render import template_sources
    from dsagen.spec import get_preset

    loaded = []

    class Recording(jinja2.FileSystemLoader):
        def get_source(self, environment, template):
            loaded.append(template)
            return super().get_source(environment, template)

    env = jinja2.Environment(loader=Recording(str(r.TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False, cache_size=0)   # every render loads
    monkeypatch.setattr(r, "_environment", lambda: env)
    for spec in get_preset("deepseek-v3.2", "sm_90a") + _sparse_attention_specs():
        loaded.clear()
        render(spec)
        assert loaded and set(loaded) <= set(template_sources(spec)), (spec.name(), loaded)


def test_key_is_stable_and_independent_of_run_time_sizes():
    """Two calls with different sequence lengths and batches build the same spec, hence the same key."""
    import torch

    import dsagen.kernels.indices.host as fused

    seen = []
    monkey = fused._kernel
    fused._kernel = lambda op, index: seen.append(op) or type("K", (), {"launch": lambda *a: None})()
    try:
        for b, s, k in [(1, 7, 5), (3, 1000, 64)]:
            fused.local_to_global(torch.zeros((b, s, k), dtype=torch.int32), 10)
    finally:
        fused._kernel = monkey
    assert seen == ["local_to_global", "local_to_global"]
    assert _key(LocalToGlobalSpec(arch="sm_90a")) == _key(LocalToGlobalSpec(arch="sm_90a"))


def test_key_material_fails_closed_on_unknown_types():
    with pytest.raises(TypeError, match="cannot be key material"):
        canonical_json({"a": object()})
    with pytest.raises(TypeError, match="non-finite"):
        canonical_json({"a": float("nan")})


# ---- store protocol (no compiler needed) ------------------------------------------------------------
def _commit(store, source="src", payload=b"cubin-bytes"):
    return commit_fake(store, source=source, cubin=payload)


def test_commit_then_lookup(tmp_path):
    store = CacheStore(tmp_path, [])
    e = _commit(store)
    assert store.lookup("sm_90a", "compactify", e.key).read("kernel.cubin") == b"cubin-bytes"
    assert store.lookup_identity("sm_90a", "compactify", identity_of(CompactifySpec(arch="sm_90a"))).key == e.key
    assert not list((tmp_path / "tmp").iterdir())


def test_flipped_byte_is_quarantined(tmp_path):
    store = CacheStore(tmp_path, [])
    e = _commit(store)
    blob = bytearray((e.path / "kernel.cubin").read_bytes())
    blob[3] ^= 0xFF
    (e.path / "kernel.cubin").write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="quarantined"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    assert not e.path.exists()
    q = list((tmp_path / "quarantine").iterdir())
    assert len(q) == 1 and "sha256" in (q[0] / "QUARANTINE_REASON").read_text()


def test_crash_between_files_and_manifest_leaves_no_entry(tmp_path):
    key = fake_entry(source="crash")[0]
    code = textwrap.dedent(f"""
        import os
        from dsagen.store import store as st
        from cache_util import commit_fake
        st._write_manifest = lambda path, manifest: os._exit(17)   # die after the artifacts, before the manifest
        commit_fake(st.CacheStore({str(tmp_path)!r}, []), source="crash")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}"))
    assert r.returncode == 17
    store = CacheStore(tmp_path, [])
    assert store.lookup("sm_90a", "compactify", key) is None
    assert not (tmp_path / "v1" / "sm_90a" / "compactify" / key[:2]).exists()
    assert list((tmp_path / "tmp").iterdir())            # the half-written stage stays invisible in tmp/
    store.prune()
    assert not list((tmp_path / "tmp").iterdir())
    assert _commit(store, "crash").path.exists()       # a later writer commits normally


def test_readonly_layer_is_searched_first_and_never_written(tmp_path):
    shipped = CacheStore(tmp_path / "shipped", [])
    e = _commit(shipped)
    store = CacheStore(tmp_path / "rw", [tmp_path / "shipped"])
    hit = store.lookup("sm_90a", "compactify", e.key)
    assert hit.layer.root == tmp_path / "shipped" and not hit.layer.writable
    (hit.path / "kernel.cubin").write_bytes(b"tampered!!!")     # corrupt in a read-only layer: skipped
    with pytest.warns(UserWarning, match="read-only"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    assert hit.path.exists()                                    # never moved: not ours to change


def test_mode_ro_and_off(tmp_path):
    ro = CacheStore(tmp_path, [], mode="ro")
    with pytest.raises(PermissionError, match="not writable"):
        _commit(ro)
    assert CacheStore(tmp_path, [tmp_path], mode="off").layers == []


def test_pack_unpack_round_trip_and_tamper_detection(tmp_path):
    src = CacheStore(tmp_path / "a", [])
    e1 = _commit(src, "source one")
    _commit(src, "source two", b"other")
    f = tmp_path / "kernels.tar"
    assert pack(src, f) == 2 and f.exists()
    dst = CacheStore(tmp_path / "b", [])
    assert unpack(dst, f) == 2
    assert dst.lookup("sm_90a", "compactify", e1.key).read("kernel.cubin") == b"cubin-bytes"
    assert unpack(dst, f) == 0                                  # already present: kept
    import io
    import tarfile

    bad = tmp_path / "bad.tar"
    with tarfile.open(f) as t_in, tarfile.open(bad, "w") as t_out:
        for m in t_in.getmembers():
            data = t_in.extractfile(m).read()
            if m.name.endswith("kernel.cubin"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            t_out.addfile(m, io.BytesIO(data))
    with pytest.raises(PackError, match="checksum"):
        unpack(CacheStore(tmp_path / "c", []), bad)
    assert not (tmp_path / "c" / "v1").exists()                 # nothing was added


# ---- resolve: JIT, locks, races (needs CuTe-DSL) -----------------------------------------------------
@pytest.mark.compile
def test_jit_builds_once_then_hits(cache_env):
    spec = CompactifySpec(arch="sm_90a")
    e1 = resolve(spec)
    m = e1.manifest
    assert m["kernel"]["symbol"].startswith(spec.symbol()) and m["key_material"]["spec"] == spec.canonical()
    assert set(m["artifacts"]) == {"kernel.py", "kernel.cubin", "kernel.ptx"}
    assert (e1.path / "kernel.py").read_text() == render(spec)  # the exact source that compiled
    assert resolve(spec).path == e1.path


@pytest.mark.compile
def test_disabled_jit_miss_names_spec_and_command(cache_env, monkeypatch):
    monkeypatch.setenv("DSAGEN_DISABLE_JIT", "1")
    spec = LocalToGlobalSpec(arch="sm_90a", threads=128)
    with pytest.raises(KernelNotCached) as ei:
        resolve(spec)
    msg = str(ei.value)
    assert spec.name() in msg and "dsagen build --spec" in msg and '"threads":128' in msg
    monkeypatch.setenv("DSAGEN_DISABLE_JIT", "0")
    assert resolve(spec).path.exists()


@pytest.mark.compile
def test_corrupt_entry_is_rebuilt(cache_env):
    spec = CompactifySpec(arch="sm_90a")
    e = resolve(spec)
    good = (e.path / "kernel.cubin").read_bytes()
    blob = bytearray(good)
    blob[len(blob) // 2] ^= 0x01
    (e.path / "kernel.cubin").write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="quarantined"):
        e2 = resolve(spec)
    assert (e2.path / "kernel.cubin").read_bytes() == good      # deterministic rebuild


@pytest.mark.compile
def test_new_identity_with_unchanged_source_is_recorded(cache_env, monkeypatch):
    """A template edit that changes the identity but not the rendered source keeps the key: the entry
    must then answer to the new identity too, or a JIT-disabled process would miss it."""
    import dsagen.jit.resolver as resolver_mod

    spec = CompactifySpec(arch="sm_90a")
    first = resolve(spec)
    monkeypatch.setattr(resolver_mod, "identity_of", lambda s: "f" * 64)   # as after a no-op template edit
    again = resolve(spec)
    assert again.path == first.path and again.manifest["aliases"] == ["f" * 64]
    store = CacheStore.from_env()
    for ident in (first.manifest["identity"], "f" * 64):
        hit = store.lookup_identity(spec.arch, spec.op, ident, toolchain.toolchain_versions())
        assert hit is not None and hit.path == first.path
    assert (first.path / "kernel.cubin").read_bytes() == again.read("kernel.cubin")
    assert not list(first.path.glob(".manifest*"))                   # no temporary left behind
    monkeypatch.setenv("DSAGEN_DISABLE_JIT", "1")
    assert resolve(spec).path == first.path


@pytest.mark.compile
def test_deployment_without_dsl_finds_kernels_by_identity(tmp_path, monkeypatch):
    """Built with one toolchain into a shipped layer; a process without CuTe-DSL finds it."""
    shipped = tmp_path / "shipped"
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(shipped))
    spec = CompactifySpec(arch="sm_90a")
    built = resolve(spec)
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "cutlass" or name.startswith("cutlass."):
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        from dsagen.jit import toolchain
        toolchain.toolchain_versions = lambda: {}
        from dsagen.jit import resolve
        from dsagen.spec import CompactifySpec
        print(resolve(CompactifySpec(arch="sm_90a")).key)
        assert not any(m.split(".")[0] in ("cutlass", "jinja2") for m in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DSAGEN_CACHE_PATH=str(shipped),
               DSAGEN_CACHE_DIR=str(tmp_path / "rw"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == built.key
    assert not (tmp_path / "rw" / "v1").exists()


@pytest.mark.compile
def test_four_racing_processes_compile_once(cache_env, tmp_path):
    log = tmp_path / "compiles.log"
    code = textwrap.dedent(f"""
        import os, sys, time
        import dsagen.jit.resolver as r
        real = r.compile_entry_files
        def counted(*a, **k):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(0.5)   # widen the window for the others to race
            return real(*a, **k)
        r.compile_entry_files = counted
        from dsagen.spec import LocalToGlobalSpec
        sys.stdout.write(r.resolve(LocalToGlobalSpec(arch="sm_90a", items_per_thread=8)).key)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert len(log.read_text().split()) == 1                    # exactly one compile


@pytest.mark.compile
def test_cache_off_compiles_in_memory(cache_env, monkeypatch):
    monkeypatch.setenv("DSAGEN_CACHE", "off")
    e = resolve(LocalToGlobalSpec(arch="sm_90a", threads=512))
    assert e.path is None and e.read("kernel.cubin")[:4] == b"\x7fELF"
    assert not cache_env.exists()                               # nothing written anywhere


@pytest.mark.compile
def test_lock_timeout_compiles_in_memory_and_warns(cache_env, monkeypatch):
    import filelock

    spec = LocalToGlobalSpec(arch="sm_90a", threads=64)
    key = key_of(key_material(spec, render(spec), toolchain.toolchain_versions()))
    CacheStore(cache_env, []).ensure_root()        # a marked cache: a bare folder of locks/ is not one
    (cache_env / "locks").mkdir()
    held = filelock.FileLock(str(cache_env / "locks" / f"{key}.lock"))
    held.acquire()
    try:
        monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", "0.2")
        with pytest.warns(UserWarning, match="timed out waiting for the compile lock"):
            e = resolve(spec)
        assert e.path is None and e.key == key
    finally:
        held.release()
    assert resolve(spec).path is not None                       # the lock is free again: committed
