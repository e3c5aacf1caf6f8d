"""Fault injection against the cache store, one class of fault per section: folders that look like a cache
but are not, builds alive in another PID namespace or on another host, folders other users can write,
entries that declare their own way to the front, manifests of the wrong types or with non-finite
numbers, prunes that cannot remove, and odd things at a lock path. Each test sets up the fault on a
private cache and checks that the user's files survive, that no wrong kernel is served and that the
error is dsagen's own, with a message that says what is wrong."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from dsagen.cli import main
from dsagen.errors import CacheNotStored, CacheRootError, DsagenError
from dsagen.jit import KernelNotCached, identity_of, resolve
from dsagen.jit import toolchain
from dsagen.spec import CompactifySpec
from dsagen.store import CacheStore
from dsagen.store import store as store_mod
from dsagen.store.pack import CHECKSUMS, PackError, pack, unpack
from dsagen.store.store import MARKER, CacheCorruption, check_entry

from cache_util import commit_fake, fake_entry

ROOT = Path(__file__).resolve().parent.parent
SPEC = CompactifySpec(arch="sm_90a")
IDENT = identity_of(SPEC)
CHILD_ENV = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")


def _user_files(d: Path) -> dict[Path, str]:
    """The user's own files, inside folders named like dsagen's: {path: text}."""
    files = {d / "tmp" / "draft.txt": "keep me", d / "v1" / "notes.md": "keep me too",
             d / "quarantine" / "evidence.log": "and me", d / "locks" / "door.key": "me as well"}
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return files


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _strict_json(text: str):
    """Parse `text` as strict JSON (no NaN or Infinity)."""
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=refuse)


# ==== a folder of dsagen-named folders is not a cache =================================================
def test_a_folder_holding_only_dsagen_named_folders_with_user_files_is_not_adopted(tmp_path, monkeypatch, capsys):
    """Fault: DSAGEN_CACHE_DIR points at a user's folder that happens to hold only folders named tmp/,
    v1/, quarantine/ and locks/ (with the user's files inside). It must not be adopted as a cache:
    build and prune refuse it and every file survives."""
    user = tmp_path / "project"
    files = _user_files(user)
    with pytest.raises(CacheRootError, match="not a dsagen cache"):
        commit_fake(CacheStore(user, []))
    with pytest.raises(CacheRootError, match="not a dsagen cache"):
        CacheStore(user, []).prune(everything=True)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(user))
    monkeypatch.setenv("DSAGEN_WHEEL_CACHES", "0")
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    assert main(["prune", "--all"]) == 2
    assert "not a dsagen cache" in capsys.readouterr().err
    assert all(p.read_text() == text for p, text in files.items()) and not (user / MARKER).exists()


def test_an_empty_folder_is_still_taken_and_a_marked_one_kept(tmp_path):
    """Fault: none; the rule's other side. An empty folder is made a cache; a marked cache with its own
    folders stays one."""
    root = tmp_path / "empty"
    root.mkdir()
    e = commit_fake(CacheStore(root, []))
    assert (root / MARKER).exists() and check_entry(e.path)["key"] == e.key
    CacheStore(root, []).prune()
    assert e.path.exists()


# ==== builds alive in another PID namespace or on another host ========================================
_STAGING_CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from dsagen.store import CacheStore
    from dsagen.store import pack as pack_mod
    from dsagen.store import store as store_mod
    from cache_util import commit_fake

    what, root, fake_pid, host = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.getpid = lambda: fake_pid      # the pid this process has in its own namespace
    store_mod._HOST = host
    waited = []

    def wait_once():
        if not waited:
            waited.append(1)
            print("staged", flush=True)
            sys.stdin.readline()      # held until the parent has pruned

    if what == "commit":
        real_write = store_mod._write_file
        def write(path, data):
            real_write(path, data)
            wait_once()
        store_mod._write_file = write
        print("committed", commit_fake(CacheStore(root, [])).path, flush=True)
    else:
        real_stream = pack_mod._stream
        def stream(src, size, sink=None):
            if sink is not None:
                wait_once()
            return real_stream(src, size, sink)
        pack_mod._stream = stream
        print("unpacked", pack_mod.unpack(CacheStore(root, []), Path(sys.argv[5])), flush=True)
""")


def _staging_child(what: str, root: Path, pid: int, host: str, pack_file: Path | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _STAGING_CHILD, what, str(root), str(pid), host,
                          str(pack_file or "")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
    line = p.stdout.readline()
    assert line.strip() == "staged", p.stderr.read()[-3000:]
    return p


@pytest.mark.parametrize("what", ["commit", "unpack"])
@pytest.mark.parametrize("owner", ["another pid namespace", "another host, past the age"])
def test_prune_spares_the_staging_folder_of_a_live_build_whatever_its_name_says(tmp_path, what, owner):
    """Fault: a build (or unpack) runs in another container sharing the cache volume: the pid in its
    staging folder's name is not a live process here (or its host is another one and the folder is
    older than the age rule). Prune must see the staging lock held and keep the folder; the build then
    completes. Once that process is killed, prune removes its leftovers."""
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    store.ensure_root()
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src)
    pack_file = tmp_path / "one.tar"
    pack(src, pack_file)
    host = store_mod._HOST if owner == "another pid namespace" else "otherhost"
    for run in ("finish", "kill"):
        shutil.rmtree(root)
        store.ensure_root()
        p = _staging_child(what, root, _dead_pid(), host, pack_file)
        try:
            (stage,) = [d for d in (root / "tmp").iterdir() if not d.name.startswith(".")]
            if owner.startswith("another host"):
                old = time.time() - 7200
                os.utime(stage, (old, old))
            removed = store.prune()
            assert stage.exists() and str(stage) not in removed, removed
            if run == "finish":
                out, err = p.communicate("\n", timeout=60)
                assert p.returncode == 0 and ("committed" in out or "unpacked 1" in out), err[-3000:]
                (entry,) = list(store.writable.entry_dirs())
                assert check_entry(entry)["key"] == entry.name
            else:
                p.send_signal(signal.SIGKILL)
                p.communicate(timeout=60)
                assert stage.exists()
                assert str(stage) in store.prune() and not stage.exists()
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()


_COMPILE_CHILD = textwrap.dedent("""
    import os, sys
    from dsagen.jit import build
    from dsagen.jit.resolver import compile_entry_files
    from dsagen.spec import CompactifySpec

    os.getpid = lambda: int(sys.argv[1])   # the pid this process has in its own namespace

    def compile_module(spec, source, workdir):
        print("compiling", workdir, flush=True)
        sys.stdin.readline()
        raise SystemExit(0)

    build.compile_module = compile_module
    compile_entry_files(CompactifySpec(arch="sm_90a"), "src", {}, "0" * 64)
""")


def test_prune_spares_the_compile_folder_of_a_live_build_in_another_pid_namespace(tmp_path, monkeypatch):
    """Fault: a build in another container sharing /tmp compiles in `dsagen-build-<pid>-*` where <pid>
    is not a live process here. Prune must see its lock held and keep it; once the build is killed,
    prune removes the folder."""
    import tempfile

    sys_tmp = tmp_path / "systmp"
    sys_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(sys_tmp))
    pid = _dead_pid()
    p = subprocess.Popen([sys.executable, "-c", _COMPILE_CHILD, str(pid)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(CHILD_ENV, TMPDIR=str(sys_tmp)))
    try:
        line = p.stdout.readline()
        assert line.startswith("compiling"), p.stderr.read()[-3000:]
        work = Path(line.split(" ", 1)[1].strip())
        assert work.name.startswith(f"dsagen-build-{pid}-") and work.parent == sys_tmp
        removed = CacheStore(tmp_path / "cache", []).prune()
        assert work.exists() and str(work) not in removed
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        assert str(work) in CacheStore(tmp_path / "cache", []).prune() and not work.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


# ==== folders other users can write, and entries that declare their way to the front ==================
WHERE = {"v1": lambda e: e.path.parents[3], "arch": lambda e: e.path.parents[2], "op": lambda e: e.path.parents[1],
         "shard": lambda e: e.path.parent, "entry": lambda e: e.path}
OTHER_UID = 54321


def _open_up(folder: Path, how: str) -> None:
    if how == "world-writable":
        folder.chmod(folder.stat().st_mode | 0o002)
    elif how == "group-writable":
        folder.chmod(folder.stat().st_mode | 0o020)
    else:
        os.chown(folder, OTHER_UID, -1)


@pytest.mark.skipif(not hasattr(os, "chown"), reason="POSIX ownership")
@pytest.mark.parametrize("how", ["world-writable", "group-writable", "owned by another user"])
@pytest.mark.parametrize("where", sorted(WHERE))
@pytest.mark.parametrize("layer", ["writable", "read-only"])
def test_an_entry_below_a_folder_others_can_write_is_not_served(tmp_path, monkeypatch, how, where, layer):
    """Fault: a folder below the root (v1, v1/<arch>, the op, the shard or the entry itself) is writable
    by others or owned by another user, so someone else could have planted or may swap the entry. The
    entry is skipped with a warning naming the folder (in every layer; it is not moved), and a build
    that must store it says it is not served."""
    if os.geteuid() != 0 and how == "owned by another user":
        pytest.skip("changing a folder's owner needs root")
    monkeypatch.setattr(store_mod, "_warned_roots", set())
    root = tmp_path / "cache"
    e = commit_fake(CacheStore(root, []))
    folder = WHERE[where](e)
    _open_up(folder, how)
    store = CacheStore(root, []) if layer == "writable" else CacheStore(tmp_path / "rw", [root])
    with pytest.warns(UserWarning, match=f"{folder}.*(writable by others|owned by another user)"):
        assert store.lookup_identity("sm_90a", "compactify", IDENT) is None
    assert store.lookup("sm_90a", "compactify", e.key) is None
    with pytest.raises(KernelNotCached):
        resolve(SPEC, store, jit=False)
    assert e.path.exists()                                     # skipped, not quarantined


def test_a_planted_entry_with_a_newer_declared_toolchain_never_wins(tmp_path, monkeypatch):
    """Fault: another user who can write one shard folder plants a valid-looking entry for the same
    spec that declares a far newer toolchain (and has the smaller key, so every tie-break would pick it).
    The user's own entry is served, not the planted one."""
    monkeypatch.setattr(store_mod, "_warned_roots", set())
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    newer = {"nvidia-cutlass-dsl": "99.0"}
    mine = commit_fake(store, source="mine")
    source = next(f"planted {i}" for i in range(256) if fake_entry(SPEC, f"planted {i}", toolchain=newer)[0] < mine.key)
    planted = commit_fake(store, source=source, toolchain=newer)
    planted.path.parent.chmod(0o777)
    with pytest.warns(UserWarning, match="writable by others"):
        assert store.lookup_identity("sm_90a", "compactify", IDENT).key == mine.key


def _keys_in_order(sources: list[str], toolchains: list[dict]) -> list[str]:
    return [fake_entry(SPEC, source=s, toolchain=t)[0] for s, t in zip(sources, toolchains)]


def _pair_where_the_newer_toolchain_has_the_larger_key() -> tuple[str, str]:
    """Two sources: the first built by 4.8.1, the second declaring 99.0, with the second's key larger."""
    for i in range(64):
        a, b = f"mine {i}", f"planted {i}"
        ka, kb = _keys_in_order([a, b], [{"nvidia-cutlass-dsl": "4.8.1"}, {"nvidia-cutlass-dsl": "99.0"}])
        if kb > ka:
            return a, b
    raise AssertionError("no such pair")


def test_a_declared_newer_toolchain_does_not_steer_the_choice_without_an_exact_match(tmp_path, monkeypatch):
    """Fault: no entry matches the installed toolchain (no DSL here); among valid entries, one declares a
    newer toolchain. The choice must not follow that declaration: the smallest key wins."""
    monkeypatch.setattr(toolchain, "toolchain_versions", lambda: {})
    store = CacheStore(tmp_path / "cache", [])
    a, b = _pair_where_the_newer_toolchain_has_the_larger_key()
    mine = commit_fake(store, source=a, toolchain={"nvidia-cutlass-dsl": "4.8.1"})
    commit_fake(store, source=b, toolchain={"nvidia-cutlass-dsl": "99.0"})
    assert store.lookup_identity("sm_90a", "compactify", IDENT).key == mine.key
    assert resolve(SPEC, store, jit=False).key == mine.key


def test_the_installed_toolchain_wins_over_any_declared_one(tmp_path, monkeypatch):
    """Fault: JIT off (DSAGEN_DISABLE_JIT=1) with the DSL installed; next to the entry built by the
    installed toolchain sits one declaring a newer toolchain. The exact toolchain match is served,
    whichever key is smaller."""
    installed = {"nvidia-cutlass-dsl": "4.8.1"}
    monkeypatch.setattr(toolchain, "toolchain_versions", lambda: dict(installed))
    store = CacheStore(tmp_path / "cache", [])
    for i in range(8):     # both orders of keys
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        mine = commit_fake(store, source=f"mine {i}", toolchain=installed)
        commit_fake(store, source=f"planted {i}", toolchain={"nvidia-cutlass-dsl": "99.0"})
        assert resolve(SPEC, store, jit=False).key == mine.key
        assert store.lookup_identity("sm_90a", "compactify", IDENT, prefer_toolchain=installed).key == mine.key


@pytest.mark.parametrize("umask", [0o000, 0o002, 0o022])
def test_folders_are_made_without_group_or_other_write_whatever_the_umask(tmp_path, umask):
    """Fault: a umask of 000 or 002 at build or unpack time. No folder dsagen makes in the cache (root,
    v1, arch, op, shard, entry, tmp, locks, quarantine, pack staging) is group- or other-writable, so the
    store serves its own entries."""
    old = os.umask(umask)
    try:
        src = CacheStore(tmp_path / "src", [])
        commit_fake(src, source="packed")
        pack(src, tmp_path / "p.tar")
        root = tmp_path / "cache"
        store = CacheStore(root, [])
        e = commit_fake(store)
        assert unpack(store, tmp_path / "p.tar") == 1
        store.quarantine(commit_fake(store, source="bad").path, "test")
    finally:
        os.umask(old)
    folders = [root] + [p for p in root.rglob("*") if p.is_dir()]
    loose = [f"{p} {oct(p.stat().st_mode)}" for p in folders if p.stat().st_mode & 0o022]
    assert not loose, loose
    assert store.lookup("sm_90a", "compactify", e.key).key == e.key


def test_a_write_restricts_the_caches_own_folders_left_open_by_an_old_umask(tmp_path, monkeypatch):
    """Fault: a cache written earlier under umask 002 has group-writable folders. Its entries are not
    served; the rebuild of one makes every folder on its path safe again (and moves the old folder to
    quarantine), after which it is served; prune removes the other entries left open."""
    monkeypatch.setattr(store_mod, "_warned_roots", set())
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    e = commit_fake(store)
    other = commit_fake(store, source="another")
    for p in [root / "v1"] + list((root / "v1").rglob("*")):
        if p.is_dir():
            p.chmod(0o775)
    with pytest.warns(UserWarning, match="writable by others"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    assert e.path.exists()
    with pytest.warns(UserWarning, match="quarantined"):
        commit_fake(store)                                     # the rebuild of the same kernel
    assert store.lookup("sm_90a", "compactify", e.key).key == e.key
    assert not any(p.stat().st_mode & 0o022 for p in [e.path, *e.path.parents[:4]])
    if other.path.parent != e.path.parent:
        assert str(other.path) in store.prune() and not other.path.exists()


# ==== manifests of the wrong types, non-finite numbers ================================================
def _edit_manifest_text(path: Path, edit) -> None:
    m = path / "manifest.json"
    m.write_text(edit(m.read_text()))


MANIFEST_FAULTS = {
    "created a number": lambda t: json.dumps(dict(json.loads(t), created=5)),
    "created null": lambda t: json.dumps(dict(json.loads(t), created=None)),
    "created a list": lambda t: json.dumps(dict(json.loads(t), created=["2026"])),
    "compile_seconds NaN": lambda t: json.dumps(dict(json.loads(t), compile_seconds=float("nan"))),
    "compile_seconds Infinity": lambda t: json.dumps(dict(json.loads(t), compile_seconds=float("inf"))),
    "compile_seconds 1e999": lambda t: t.replace('"compile_seconds": 0.0', '"compile_seconds": 1e999'),
    "compile_seconds a string": lambda t: json.dumps(dict(json.loads(t), compile_seconds="fast")),
    "compile_seconds a bool": lambda t: json.dumps(dict(json.loads(t), compile_seconds=True)),
    "NaN in an unknown field": lambda t: json.dumps(dict(json.loads(t), extra={"x": [float("nan")]})),
    "schema a string": lambda t: json.dumps(dict(json.loads(t), schema="1")),
    "kernel_sha256 a number": lambda t: json.dumps(dict(json.loads(t), kernel_sha256=7)),
}


@pytest.mark.parametrize("fault", sorted(MANIFEST_FAULTS))
def test_a_manifest_field_of_the_wrong_type_or_non_finite_is_corruption_and_list_stays_strict(
        cache_env, capsys, fault):
    """Fault: a manifest whose `created` is not a string, whose number is NaN, Infinity or overflows,
    or whose other field has the wrong type. It is corruption for check, lookup and verify, and `dsagen
    list` (table and --json) still works, printing strict JSON."""
    store = CacheStore(cache_env, [])
    good = commit_fake(store, source="good")
    bad = commit_fake(store, source="bad")
    _edit_manifest_text(bad.path, MANIFEST_FAULTS[fault])
    with pytest.raises(CacheCorruption):
        check_entry(bad.path)
    assert main(["list"]) == 0
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    rows = _strict_json(capsys.readouterr().out)
    assert {r["key"] for r in rows if "error" not in r} == {good.key}
    assert main(["verify"]) == 1
    with pytest.warns(UserWarning, match="quarantined"):
        assert store.lookup("sm_90a", "compactify", bad.key) is None


@pytest.mark.parametrize("fault", ["created a number", "compile_seconds NaN", "compile_seconds 1e999"])
def test_a_pack_holding_such_a_manifest_is_refused(tmp_path, fault):
    """Fault: a pack (with correct checksums) whose entry's manifest has a non-string `created` or a
    non-finite number. Unpack refuses it with a PackError and adds nothing."""
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src)
    good = tmp_path / "good.tar"
    pack(src, good)
    members = []
    with tarfile.open(good) as t:
        for m in t.getmembers():
            data = t.extractfile(m).read()
            if m.name.endswith("/manifest.json"):
                data = MANIFEST_FAULTS[fault](data.decode()).encode()
            if m.name != CHECKSUMS:
                members.append((m.name, data))
    sums = json.dumps({n: hashlib.sha256(d).hexdigest() for n, d in members}).encode()
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as t:
        for name, data in members + [(CHECKSUMS, sums)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    root = tmp_path / "cache"
    with pytest.raises(PackError):
        unpack(CacheStore(root, []), bad)
    assert not (root / "v1").exists() or not any((root / "v1").rglob("manifest.json"))


# ==== prune reports what it really did ================================================================
def _read_only(monkeypatch, root: Path) -> None:
    """Make every change under `root` fail with EROFS, as on a read-only mount (root ignores modes)."""
    inside = str(root) + os.sep

    def guard(real):
        def call(path, *a, **k):
            if k.get("dir_fd") is not None or str(os.fspath(path)).startswith(inside):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *a, **k)
        return call

    for name in ("unlink", "rmdir", "mkdir", "remove"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    real_open = os.open

    def open_(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            return guard(real_open)(path, flags, *a, **k)
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", open_)


def test_prune_on_a_read_only_root_counts_only_what_went_and_fails(cache_env, monkeypatch, capsys):
    """Fault: the cache root is on a read-only mount. Prune removes nothing, so it reports nothing as
    removed, names what it could not remove, and the command exits nonzero."""
    root = cache_env
    store = CacheStore(root, [])
    e = commit_fake(store)
    stray = root / "v1" / "README"
    stray.write_text("stray")
    dead = root / "tmp" / f"unpack.{store_mod._HOST}.{_dead_pid()}.abcd0000"
    (dead / "v1").mkdir(parents=True)
    (dead / "v1" / "half").write_text("x")
    _read_only(monkeypatch, root)
    removed = store.prune(everything=True, system_temp=False)
    assert list(removed) == []
    assert {p for p, _ in removed.failed} >= {str(stray), str(dead), str(e.path)}
    assert all(why for _, why in removed.failed)
    capsys.readouterr()
    assert main(["prune", "--all"]) == 1
    out, err = capsys.readouterr()
    assert "removed " not in out and "could not remove" in err and str(stray) in err
    assert stray.exists() and dead.exists() and e.path.exists()


# ==== odd things at a lock path =======================================================================
@pytest.mark.compile
def test_a_folder_at_a_lock_path_is_named_and_pruned(cache_env, monkeypatch):
    """Fault: `locks/<key>.lock` is a folder. The build must say the lock path is not a file, without
    claiming it compiled anything (nothing is compiled for the store), and prune removes the folder."""
    from dsagen.jit import resolver
    from dsagen.jit.keys import key_material, key_of
    from dsagen.jit.render import render

    key = key_of(key_material(SPEC, render(SPEC), toolchain.toolchain_versions()))
    CacheStore(cache_env, []).ensure_root()
    lock = cache_env / "locks" / f"{key}.lock"
    (lock / "inside").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(resolver, "compile_entry_files", lambda *a: calls.append(a) or pytest.fail("compiled"))
    with pytest.raises(CacheNotStored, match="not a file") as exc:
        resolve(SPEC, must_store=True)
    assert "compiled" not in str(exc.value).replace("nothing was compiled", "") and not calls
    assert isinstance(exc.value, DsagenError)
    removed = CacheStore(cache_env, []).prune()
    assert str(lock) in removed and not lock.exists()


def test_prune_removes_non_file_lock_paths_but_never_follows_them(tmp_path):
    """Fault: a folder, a FIFO and a link to a user's folder sit at lock paths. Prune removes each (the
    link as a link: the user's files survive) and keeps regular lock files."""
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    e = commit_fake(store)
    user = tmp_path / "user"
    user.mkdir()
    (user / "precious.txt").write_text("keep me")
    locks = root / "locks"
    (locks / f"{'a' * 64}.lock").mkdir()
    os.mkfifo(locks / f"{'b' * 64}.lock")
    (locks / f"{'c' * 64}.lock").symlink_to(user, target_is_directory=True)
    removed = store.prune()
    for n in "abc":
        assert str(locks / f"{n * 64}.lock") in removed and not os.path.lexists(locks / f"{n * 64}.lock")
    assert (user / "precious.txt").read_text() == "keep me" and (locks / f"{e.key}.lock").exists()
