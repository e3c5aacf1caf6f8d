"""Fault injection against the cache, one class of fault per section: deletes that could reach outside
the cache, kernels that must not be served, hostile packs, and results that must be honest. Each test
sets up the fault on a private cache and checks that the user's files survive, that no wrong kernel
is served and that the error is the project's own, with a message that says what is wrong."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from dsagen.jit import KernelNotCached, identity_of, resolve

from dsagen.store import CacheStore
from dsagen.store import store as store_mod
from dsagen.store.pack import CHECKSUMS, PackError, pack, unpack
from dsagen.store.store import MARKER, CacheCorruption, check_entry, load_entry
from dsagen.cli import main
from dsagen.errors import CacheNotStored, CacheRootError, DsagenError
from dsagen.spec import CompactifySpec, LocalToGlobalSpec

from cache_util import commit_fake, fake_entry

ROOT = Path(__file__).resolve().parent.parent
SPEC = CompactifySpec(arch="sm_90a")
IDENT = identity_of(SPEC)


def _user_files(tmp_path: Path) -> Path:
    """A folder of the user's own files that no cache command may touch."""
    d = tmp_path / "user"
    (d / "deep").mkdir(parents=True)
    (d / "precious.txt").write_text("keep me")
    (d / "deep" / "also.txt").write_text("keep me too")
    return d


def _intact(d: Path) -> bool:
    return (d / "precious.txt").read_text() == "keep me" and (d / "deep" / "also.txt").read_text() == "keep me too"


def _rewrite_manifest(entry_path: Path, fn) -> None:
    mpath = entry_path / "manifest.json"
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps(fn(m)))


# ==== 1. never delete outside the cache ===============================================================
@pytest.mark.parametrize("where", ["tmp", "quarantine", "arch", "op", "shard", "entry"])
def test_prune_never_walks_into_a_link(tmp_path, where):
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    e = commit_fake(store)
    user = _user_files(tmp_path)
    # a user's folder shaped like the part of the cache it replaces, so a walk that follows the link
    # would find "entries" and "leftovers" in it
    mimic = user / "deep"
    if where in ("tmp", "quarantine"):
        shutil.rmtree(root / where, ignore_errors=True)
        (root / where).symlink_to(user, target_is_directory=True)
    else:
        real = {"arch": e.path.parents[2], "op": e.path.parents[1], "shard": e.path.parent, "entry": e.path}[where]
        shutil.copytree(real, mimic / real.name)
        shutil.rmtree(real)
        real.symlink_to(mimic / real.name, target_is_directory=True)
    before = sorted(p.relative_to(user) for p in user.rglob("*"))
    store.prune(everything=True)
    assert _intact(user) and sorted(p.relative_to(user) for p in user.rglob("*")) == before
    assert not any(p.is_symlink() for p in root.rglob("*"))  # the links themselves are gone


def test_no_command_follows_a_linked_arch_folder(cache_env, tmp_path, capsys):
    root = cache_env
    store = CacheStore(root, [])
    e = commit_fake(store)
    user = _user_files(tmp_path)
    shutil.copytree(root / "v1" / "sm_90a", user / "sm_90a")
    (root / "v1" / "sm_100a").symlink_to(user / "sm_90a", target_is_directory=True)
    for argv in (["list"], ["verify"], ["prune"], ["prune", "--all"]):
        assert main(argv) == 0, argv
    assert _intact(user) and (user / "sm_90a").exists()
    assert not (root / "v1" / "sm_100a").exists() and not e.path.exists()   # prune --all removed ours only
    assert store.lookup_identity("sm_100a", "compactify", IDENT) is None


def test_linked_artifact_is_never_read_or_deleted_through(tmp_path):
    store = CacheStore(tmp_path / "cache", [])
    e = commit_fake(store)
    user = _user_files(tmp_path)
    (e.path / "kernel.cubin").unlink()
    (e.path / "kernel.cubin").symlink_to(user / "precious.txt")
    with pytest.raises(CacheCorruption, match="link"):
        check_entry(e.path)
    with pytest.warns(UserWarning, match="quarantined"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    store.prune(everything=True)
    assert _intact(user)


def test_empty_cache_dir_is_an_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", "")
    with pytest.raises(CacheRootError, match="DSAGEN_CACHE_DIR"):
        CacheStore.from_env()
    monkeypatch.setenv("DSAGEN_CACHE_DIR", "   ")
    with pytest.raises(CacheRootError, match="DSAGEN_CACHE_DIR"):
        CacheStore.from_env()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_a_dsagen_cache_is_refused(tmp_path):
    user = _user_files(tmp_path)
    store = CacheStore(user, [])
    with pytest.raises(CacheRootError, match="not a dsagen cache"):
        commit_fake(store)
    with pytest.raises(CacheRootError, match="not a dsagen cache"):
        store.prune(everything=True)
    assert _intact(user) and not (user / MARKER).exists() and not (user / "v1").exists()
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(CacheRootError, match="not a folder"):
        commit_fake(CacheStore(f, []))


def test_new_empty_and_marker_less_dsagen_roots_are_taken(tmp_path):
    for root in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        if root.name == "empty":
            root.mkdir()
        commit_fake(CacheStore(root, []))
        assert (root / MARKER).read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    unmarked = tmp_path / "unmarked"        # only folders named like dsagen's, no marker: not adopted, a
    commit_fake(CacheStore(unmarked, []))   # user's folder can have those names too
    (unmarked / MARKER).unlink()
    with pytest.raises(CacheRootError, match="not a dsagen cache"):
        CacheStore(unmarked, []).prune()
    assert not (unmarked / MARKER).exists() and any((unmarked / "v1").rglob("manifest.json"))


def test_relative_cache_path_is_made_absolute_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", "rw-cache")
    monkeypatch.setenv("DSAGEN_CACHE_PATH", "shipped")
    with pytest.warns(UserWarning, match="DSAGEN_CACHE_PATH entry 'shipped' is relative"):
        store = CacheStore.from_env()
    assert [layer.root for layer in store.layers] == [tmp_path / "shipped", tmp_path / "rw-cache"]


def test_a_root_other_users_can_write_is_warned_about(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    monkeypatch.setattr(store_mod, "_warned_roots", set())
    with pytest.warns(UserWarning, match="writable by, or owned by, another user"):
        CacheStore.from_env()


def test_prune_spares_live_staging_and_removes_dead_staging(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    commit_fake(store)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = store_mod._HOST
    live = root / "tmp" / f"unpack.{host}.{os.getpid()}.aaaa0000"
    gone = root / "tmp" / f"unpack.{host}.{dead_pid}.bbbb0000"
    other_host_young = root / "tmp" / f"{'ab' * 32}.otherhost.123.cccc0000"
    for d in (live, gone, other_host_young):
        d.mkdir(parents=True)
        (d / "kernel.cubin").write_bytes(b"half-written")
    old = root / "tmp" / f"{'cd' * 32}.otherhost.123.dddd0000"
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    removed = store.prune()
    assert live.exists() and other_host_young.exists()
    assert not gone.exists() and not old.exists() and str(gone) in removed


def test_prune_cleans_killed_builds_compile_folders_in_the_system_temp(tmp_path, monkeypatch):
    import tempfile

    sys_tmp = tmp_path / "systmp"
    sys_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(sys_tmp))
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True).stdout)
    killed = sys_tmp / f"dsagen-build-{dead_pid}-x1"
    running = sys_tmp / f"dsagen-build-{os.getpid()}-x2"
    for d in (killed, running):
        (d / "dump").mkdir(parents=True)
    user = _user_files(tmp_path)
    (sys_tmp / f"dsagen-build-{dead_pid}-link").symlink_to(user, target_is_directory=True)
    CacheStore(tmp_path / "cache", []).prune()
    assert not killed.exists() and running.exists() and _intact(user)


# ==== 2. never serve a wrong or unverified kernel ======================================================
BAD_MANIFESTS = {
    "a list": lambda m: [m],
    "a string": lambda m: "manifest",
    "null": lambda m: None,
    "key not a str": lambda m: dict(m, key=5),
    "artifacts not a dict": lambda m: dict(m, artifacts=["kernel.cubin"]),
    "artifact without sha": lambda m: dict(m, artifacts={"kernel.cubin": {"size": 11}}),
    "artifact size a bool": lambda m: dict(m, artifacts={n: dict(a, size=True) for n, a in m["artifacts"].items()}),
    "no cubin listed": lambda m: dict(m, artifacts={"kernel.py": m["artifacts"]["kernel.py"]}),
    "path outside the entry": lambda m: dict(m, artifacts=dict(m["artifacts"], **{"../../x": m["artifacts"]["kernel.py"]})),
    "path in a sub-folder": lambda m: dict(m, artifacts=dict(m["artifacts"], **{"sub/x": m["artifacts"]["kernel.py"]})),
    "kernel record missing": lambda m: {k: v for k, v in m.items() if k != "kernel"},
    "forged key material": lambda m: dict(m, key_material=dict(m["key_material"], source_sha256="0" * 64)),
    "spec of another kernel": lambda m: dict(m, spec=LocalToGlobalSpec(arch="sm_90a").canonical()),
    "forged identity": lambda m: dict(m, identity="e" * 64),
    "aliases not a list": lambda m: dict(m, aliases="e" * 64),
}


@pytest.mark.parametrize("fault", sorted(BAD_MANIFESTS))
def test_malformed_manifest_is_corruption_everywhere(fault, cache_env, tmp_path, capsys):
    root = cache_env
    store = CacheStore(root, [])
    e = commit_fake(store)
    _rewrite_manifest(e.path, BAD_MANIFESTS[fault])
    with pytest.raises(CacheCorruption):
        check_entry(e.path)
    assert main(["list"]) == 0 and main(["list", "--json"]) == 0
    assert main(["verify"]) == 1 and "1 bad" in capsys.readouterr().out
    # a read-only layer skips it with a warning; the writable one quarantines it; neither serves it
    ro = CacheStore(tmp_path / "other", [root])
    with pytest.warns(UserWarning, match="corrupt entry in read-only"):
        assert ro.lookup("sm_90a", "compactify", e.key) is None
    assert ro.lookup_identity("sm_90a", "compactify", IDENT) is None
    with pytest.warns(UserWarning, match="quarantined"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    commit_fake(store)          # a fresh entry takes its place
    _rewrite_manifest(e.path, BAD_MANIFESTS[fault])
    assert main(["prune"]) == 0 and not e.path.exists()


def test_entry_in_the_wrong_folder_or_for_another_request_is_not_served(tmp_path):
    store = CacheStore(tmp_path / "cache", [])
    e = commit_fake(store)
    moved = e.path.parents[2] / "local_to_global" / e.key[:2] / e.key     # under another op's folder
    moved.parent.mkdir(parents=True)
    shutil.copytree(e.path, moved)
    with pytest.raises(CacheCorruption, match="op"):
        check_entry(moved)
    # a self-consistent entry of one spec that also claims another spec's identity (an alias)
    other = LocalToGlobalSpec(arch="sm_90a")
    _rewrite_manifest(e.path, lambda m: dict(m, aliases=[identity_of(other)]))
    assert store.lookup_identity("sm_90a", "compactify", identity_of(other), spec=other.canonical()) is None
    assert store.lookup("sm_90a", "compactify", e.key, {"spec": other.canonical()}) is None


def test_loaded_bytes_are_the_hashed_bytes(tmp_path):
    store = CacheStore(tmp_path / "cache", [])
    e = commit_fake(store, cubin=b"the-real-kernel")
    hit = store.lookup("sm_90a", "compactify", e.key)
    (e.path / "kernel.cubin").write_bytes(b"swapped-later!!")       # same size, after the check
    assert hit.read("kernel.cubin") == b"the-real-kernel"
    quick = CacheStore(tmp_path / "cache", [], verify_hashes=False)
    (e.path / "kernel.cubin").write_bytes(b"the-real-kernel")
    hit2 = quick.lookup("sm_90a", "compactify", e.key)
    (e.path / "kernel.cubin").write_bytes(b"swapped-later!!")
    assert hit2.read("kernel.cubin") == b"the-real-kernel"         # read once, at the size check


def test_the_choice_among_entries_of_one_identity_ignores_created(tmp_path):
    store = CacheStore(tmp_path / "cache", [])
    a = commit_fake(store, source="build a", created="2020-01-01T00:00:00+00:00")
    b = commit_fake(store, source="build b", created="9999-12-31T23:59:59+00:00")   # a forged, far-future date
    first = min(a.key, b.key)
    assert store.lookup_identity("sm_90a", "compactify", IDENT).key == first
    _rewrite_manifest(a.path if first == a.key else b.path, lambda m: dict(m, created="0000"))
    assert store.lookup_identity("sm_90a", "compactify", IDENT).key == first
    newer = commit_fake(store, source="build c", toolchain={"nvidia-cutlass-dsl": "4.10.0"})
    # a declared newer toolchain wins nothing (an entry can declare any): the smallest key, unless one
    # matches the toolchain installed here
    assert store.lookup_identity("sm_90a", "compactify", IDENT).key == min(first, newer.key)
    assert store.lookup_identity("sm_90a", "compactify", IDENT,
                                 prefer_toolchain={"nvidia-cutlass-dsl": "4.10.0"}).key == newer.key


def test_stray_files_in_the_tree_are_ignored_and_pruned(cache_env, capsys):
    root = cache_env
    store = CacheStore(root, [])
    e = commit_fake(store)
    strays = [root / "v1" / "README", root / "v1" / "sm_90a" / "notes.txt", root / "v1" / "sm_90a" / "compactify" / "x",
              e.path.parent / "not-a-key", root / "v1" / "Not An Arch"]
    for p in strays[:-1]:
        p.write_text("stray")
    strays[-1].mkdir()
    assert main(["list"]) == 0 and main(["verify"]) == 0
    assert store.lookup_identity("sm_90a", "compactify", IDENT).key == e.key
    store.prune()
    assert not any(p.exists() for p in strays) and e.path.exists()


# ==== 3. hostile packs are refused without harm ========================================================
def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _good_pack(tmp_path: Path) -> tuple[Path, list[str]]:
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src, source="one")
    commit_fake(src, source="two")
    f = tmp_path / "good.tar"
    assert pack(src, f) == 2
    with tarfile.open(f) as t:
        return f, t.getnames()


def _rebuild(src: Path, dst: Path, edit) -> Path:
    """Copy the members of pack `src` into `dst`, each through `edit(info, data) -> list of (info, data)`."""
    out = []
    with tarfile.open(src) as t:
        for m in t.getmembers():
            out += edit(m, t.extractfile(m).read())
    return _tar(dst, out)


def _sums(members: list[tuple[tarfile.TarInfo, bytes]]) -> tuple[tarfile.TarInfo, bytes]:
    import hashlib

    return _file(CHECKSUMS, json.dumps({i.name: hashlib.sha256(d).hexdigest() for i, d in members}).encode())


def _assert_untouched(root: Path) -> None:
    assert not (root / "v1").exists() or not any((root / "v1").rglob("*"))
    assert not (root / "tmp").exists() or not any((root / "tmp").iterdir())


def test_not_a_tar_and_missing_packs_are_pack_errors(tmp_path):
    dst = CacheStore(tmp_path / "dst", [])
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file" * 100)
    for f in (junk, tmp_path / "missing.tar"):
        with pytest.raises(PackError):
            unpack(dst, f)
    _assert_untouched(tmp_path / "dst")


def _key_folder(names: list[str]) -> str:
    return next(n for n in names if n.endswith("kernel.cubin")).rsplit("/", 1)[0]


@pytest.mark.parametrize("fault", ["traversal", "absolute", "dotdot-inside", "symlink", "hardlink", "device",
                                   "fifo", "folder", "extra-file", "one-file", "no-manifest", "bad-sums-json",
                                   "sums-not-object", "sums-missing-member", "duplicate", "manifest-mismatch",
                                   "invalid-manifest", "outside-v1"])
def test_bad_pack_is_one_pack_error_and_adds_nothing(tmp_path, fault):
    good, names = _good_pack(tmp_path)
    folder = _key_folder(names)
    dst_root = tmp_path / "dst"
    dst = CacheStore(dst_root, [])

    def special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        return info, None

    members = []
    with tarfile.open(good) as t:
        for m in t.getmembers():
            members.append((m, t.extractfile(m).read()))
    body = [(i, d) for i, d in members if i.name != CHECKSUMS]
    add = {
        "traversal": [_file("../../escape.txt", b"x")],
        "absolute": [_file("/tmp/escape.txt", b"x")],
        "dotdot-inside": [_file(f"{folder}/../../../../../escape", b"x")],
        "symlink": [special(f"{folder}/evil", tarfile.SYMTYPE, "/etc/passwd")],
        "hardlink": [special(f"{folder}/evil", tarfile.LNKTYPE, "/etc/passwd")],
        "device": [special(f"{folder}/evil", tarfile.CHRTYPE)],
        "fifo": [special(f"{folder}/evil", tarfile.FIFOTYPE)],
        "folder": [special(f"{folder}/evil", tarfile.DIRTYPE)],
        "extra-file": [_file(f"{folder}/extra.bin", b"not in the manifest")],
        "outside-v1": [_file("elsewhere/file", b"x")],
    }.get(fault, [])
    if fault == "one-file":
        body = [_file(f"v1/sm_90a/compactify/ee/{'ee' * 32}/kernel.cubin", b"lonely")]
    if fault == "no-manifest":
        body = [(i, d) for i, d in body if not (i.name.startswith(folder) and i.name.endswith("manifest.json"))]
    if fault == "duplicate":
        body = body + [body[0]]
    if fault in ("manifest-mismatch", "invalid-manifest"):
        def edit(i, d):
            if i.name == f"{folder}/manifest.json":
                m = json.loads(d)
                if fault == "manifest-mismatch":
                    m["artifacts"]["kernel.cubin"]["sha256"] = "0" * 64
                else:
                    m["key"] = "f" * 64
                d = json.dumps(m).encode()
                i = _file(i.name, d)[0]
            return i, d
        body = [edit(i, d) for i, d in body]
    members = body + add
    sums = _sums([(i, d) for i, d in members if d is not None])
    if fault == "bad-sums-json":
        sums = _file(CHECKSUMS, b"{not json")
    if fault == "sums-not-object":
        sums = _file(CHECKSUMS, b"[1, 2]")
    if fault == "sums-missing-member":
        s = json.loads(sums[1])
        s.pop(next(iter(s)))
        sums = _file(CHECKSUMS, json.dumps(s).encode())
    bad = _tar(tmp_path / "bad.tar", members + [sums])
    with pytest.raises(PackError):
        unpack(dst, bad)
    _assert_untouched(dst_root)
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/escape.txt").exists()
    assert main_list_ok(dst_root)


def main_list_ok(root: Path) -> bool:
    """list, verify and prune all succeed on `root` (no stray folder broke them)."""
    old = os.environ.get("DSAGEN_CACHE_DIR")
    os.environ["DSAGEN_CACHE_DIR"] = str(root)
    try:
        return main(["list"]) == 0 and main(["verify"]) == 0 and main(["prune"]) == 0
    finally:
        if old is None:
            del os.environ["DSAGEN_CACHE_DIR"]
        else:
            os.environ["DSAGEN_CACHE_DIR"] = old


def _bomb(path: Path, folder: str, members: int, member_bytes: int) -> Path:
    """A small gzip'd tar whose members are zeros: `members` x `member_bytes` once inflated."""
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = b"\0" * (16 << 20)
    with open(path, "wb") as f:
        for i in range(members):
            info = tarfile.TarInfo(f"{folder}/blob{i}.bin")
            info.size = member_bytes
            f.write(c.compress(info.tobuf(format=tarfile.PAX_FORMAT)))
            left = member_bytes
            while left:
                n = min(left, len(zeros))
                f.write(c.compress(zeros[:n]))
                left -= n
            f.write(c.compress(b"\0" * (-member_bytes % 512)))
        f.write(c.compress(b"\0" * 1024))
        f.write(c.flush())
    return path


def test_a_small_pack_that_inflates_to_gigabytes_is_refused_in_little_memory(tmp_path):
    """8 members of 255 MiB of zeros (2 GiB inflated, ~9 MB on disk): each member is under the per-member
    cap, so the first pass streams them all, and refuses the pack (no checksum list) having written
    nothing, in under 200 MB of memory. One 5 GiB member is refused at its header."""
    folder = f"v1/sm_90a/compactify/ab/{'ab' * 32}"
    bomb = _bomb(tmp_path / "bomb.tgz", folder, 8, 255 << 20)
    one = tmp_path / "one.tar"
    info = tarfile.TarInfo(f"{folder}/kernel.cubin")
    info.size = 5 << 30
    one.write_bytes(info.tobuf(format=tarfile.PAX_FORMAT) + b"\0" * 4096)
    assert bomb.stat().st_size < 16 << 20
    root = tmp_path / "dst"
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from dsagen.store import CacheStore
        from dsagen.store.pack import PackError, unpack
        store = CacheStore(Path({str(root)!r}), [])
        for f, want in (({str(bomb)!r}, "no PACK-CHECKSUMS"), ({str(one)!r}, "over the cap")):
            try:
                unpack(store, Path(f))
            except PackError as e:
                assert want in str(e), e
            else:
                sys.exit("accepted " + f)
        # this process's peak resident memory (ru_maxrss would carry the parent's peak across exec)
        print(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) < 200 * 1024          # KiB
    written = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert written < 4096 and (not (root / "tmp").exists() or not any((root / "tmp").iterdir()))


def test_total_size_cap(tmp_path):
    folder = f"v1/sm_90a/compactify/ab/{'ab' * 32}"
    bomb = _bomb(tmp_path / "b.tgz", folder, 4, 1 << 20)
    with pytest.raises(PackError, match="add up to more than the cap"):
        unpack(CacheStore(tmp_path / "dst", []), bomb, max_total_bytes=3 << 20)
    with pytest.raises(PackError, match="over the cap"):
        unpack(CacheStore(tmp_path / "dst", []), bomb, max_member_bytes=1 << 19)
    _assert_untouched(tmp_path / "dst")


def test_unpack_keeps_valid_entries_replaces_corrupt_ones_and_leaves_no_staging(tmp_path):
    good, names = _good_pack(tmp_path)
    dst = CacheStore(tmp_path / "dst", [])
    assert unpack(dst, good) == 2 and unpack(dst, good) == 0
    folder = _key_folder(names)
    (tmp_path / "dst" / folder / "kernel.cubin").write_bytes(b"corrupted!!")
    with pytest.warns(UserWarning, match="quarantined"):
        assert unpack(dst, good) == 1
    check_entry(tmp_path / "dst" / folder)
    assert not any((tmp_path / "dst" / "tmp").iterdir())


def test_pack_never_follows_links_out_of_the_cache(tmp_path):
    src_root = tmp_path / "src"
    src = CacheStore(src_root, [])
    a = commit_fake(src, source="one")
    b = commit_fake(src, source="two")
    user = _user_files(tmp_path)
    (b.path / "kernel.cubin").unlink()
    (b.path / "kernel.cubin").symlink_to(user / "precious.txt")
    (a.path / "sub").mkdir()                                     # an entry with a sub-folder
    c = commit_fake(src, source="three")
    shutil.copytree(c.path, user / "entry")
    shutil.rmtree(c.path)
    c.path.symlink_to(user / "entry", target_is_directory=True)  # a linked entry folder
    f = tmp_path / "out.tar"
    with pytest.warns(UserWarning, match="skipping an invalid entry"):
        assert pack(src, f) == 0
    with tarfile.open(f) as t:
        assert t.getnames() == [CHECKSUMS]
    assert _intact(user)


# ==== 4. honest results ===============================================================================
def _fail_with(err: int):
    def boom(*a, **k):
        raise OSError(err, os.strerror(err))
    return boom


@pytest.mark.compile
@pytest.mark.parametrize("mode", ["ro", "off"])
def test_must_store_refuses_cache_modes_that_do_not_store(cache_env, monkeypatch, mode):
    monkeypatch.setenv("DSAGEN_CACHE", mode)
    with pytest.raises(CacheNotStored, match=f"DSAGEN_CACHE={mode}"):
        resolve(LocalToGlobalSpec(arch="sm_90a", threads=256), must_store=True)
    assert resolve(LocalToGlobalSpec(arch="sm_90a", threads=256)).path is None     # in memory, by request


@pytest.mark.compile
@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_unwritable_disk_is_not_stored(cache_env, monkeypatch, err):
    CacheStore(cache_env, []).ensure_root()
    monkeypatch.setattr(store_mod, "_write_file", _fail_with(err))
    spec = LocalToGlobalSpec(arch="sm_90a", threads=256)
    with pytest.raises(CacheNotStored, match=os.strerror(err)):
        resolve(spec, must_store=True)
    with pytest.warns(UserWarning, match="compiling .* in memory"):
        assert resolve(spec).path is None
    assert not (cache_env / "tmp").exists() or not any((cache_env / "tmp").iterdir())


@pytest.mark.compile
def test_lock_timeout_is_not_stored(cache_env, monkeypatch):
    import filelock

    from dsagen.jit.keys import key_material, key_of
    from dsagen.jit import toolchain
    from dsagen.jit.render import render

    spec = LocalToGlobalSpec(arch="sm_90a", threads=256)
    key = key_of(key_material(spec, render(spec), toolchain.toolchain_versions()))
    CacheStore(cache_env, []).ensure_root()
    (cache_env / "locks").mkdir()
    held = filelock.FileLock(str(cache_env / "locks" / f"{key}.lock"))
    held.acquire()
    try:
        monkeypatch.setenv("DSAGEN_LOCK_TIMEOUT", "0.1")
        with pytest.raises(CacheNotStored, match="timed out"):
            resolve(spec, must_store=True)
    finally:
        held.release()


@pytest.mark.compile
def test_an_entry_pruned_right_after_its_commit_is_not_stored(cache_env, monkeypatch):
    real = CacheStore.commit

    def commit_then_pruned(self, *a, **k):
        e = real(self, *a, **k)
        shutil.rmtree(e.path)          # a concurrent `prune --all` between the commit and the report
        return e

    monkeypatch.setattr(CacheStore, "commit", commit_then_pruned)
    with pytest.raises(CacheNotStored, match="did not survive"):
        resolve(LocalToGlobalSpec(arch="sm_90a", threads=256), must_store=True)


@pytest.mark.compile
def test_corrupt_entry_in_an_unwritable_root_falls_back_without_a_traceback(cache_env, monkeypatch):
    spec = LocalToGlobalSpec(arch="sm_90a", threads=256)

    def corrupt():
        e = resolve(spec)
        (e.path / "kernel.cubin").write_bytes(b"x" * e.manifest["artifacts"]["kernel.cubin"]["size"])

    corrupt()
    with monkeypatch.context() as m:
        m.setattr(store_mod.os, "replace", _fail_with(errno.EROFS))   # quarantine and commit both fail
        with pytest.warns(UserWarning, match="cannot quarantine"):
            got = resolve(spec)
    assert got.path is None and got.read("kernel.cubin")[:4] == b"\x7fELF"
    corrupt()
    monkeypatch.setattr(store_mod.os, "replace", _fail_with(errno.EROFS))
    monkeypatch.setenv("DSAGEN_DISABLE_JIT", "1")
    with pytest.warns(UserWarning, match="cannot quarantine"):
        with pytest.raises(KernelNotCached, match="dsagen build --spec"):
            resolve(spec)


def test_every_cache_error_is_a_dsagen_error():
    from dsagen.store import CacheCorruption, CacheLockTimeout

    for cls in (CacheCorruption, CacheLockTimeout, KernelNotCached, PackError, CacheRootError, CacheNotStored):
        assert issubclass(cls, DsagenError), cls


def test_build_and_prune_commands_refuse_a_folder_that_is_not_a_cache(tmp_path, monkeypatch, capsys):
    user = _user_files(tmp_path)
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(user))
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    monkeypatch.setenv("DSAGEN_CACHE", "rw")
    for argv in (["build", "--spec", SPEC.canonical_json(), "-j", "1"], ["prune", "--all"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "not a dsagen cache" in err and "Traceback" not in err
    assert _intact(user) and sorted(p.name for p in user.iterdir()) == ["deep", "precious.txt"]


def test_processes_marking_one_new_root_at_once_all_take_it(tmp_path):
    """Builders starting together on a new root each see the others' temporary marker or their marker:
    none may take that for a foreign file and refuse the root."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from dsagen.store import CacheStore
        start = float(sys.argv[1])
        while time.time() < start:
            pass
        for i in range(40):
            CacheStore(Path({str(tmp_path)!r}) / f"root{{i}}", []).ensure_root()
    """)
    start = time.time() + 3
    procs = [subprocess.Popen([sys.executable, "-c", code, str(start)], stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(6)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for e in errs if e]


def test_another_tools_cachedir_tag_is_not_dsagens(tmp_path):
    other = tmp_path / "target"            # e.g. a cargo target folder: a CACHEDIR.TAG with the bare signature
    other.mkdir()
    (other / MARKER).write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
    (other / "tmp").mkdir()
    (other / "tmp" / "theirs.txt").write_text("keep")
    with pytest.raises(CacheRootError, match="not dsagen's"):
        CacheStore(other, []).prune()
    assert (other / "tmp" / "theirs.txt").read_text() == "keep"


# ==== writers and readers meeting links, FIFOs and odd names ==========================================
@pytest.mark.parametrize("where", ["v1/sm_90a", "tmp", "quarantine", "locks", "v1"])
def test_writers_never_write_through_a_link(tmp_path, where):
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    store.ensure_root()
    user = _user_files(tmp_path)
    link = root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(user, target_is_directory=True)
    e = commit_fake(store)                                    # lock, stage, place
    e.path.joinpath("kernel.cubin").write_bytes(b"x" * len(b"cubin-bytes"))
    with pytest.warns(UserWarning, match="quarantined"):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    commit_fake(store)
    store.prune(everything=True)
    assert _intact(user) and sorted(p.name for p in user.iterdir()) == ["deep", "precious.txt"]
    assert sorted(p.name for p in (user / "deep").iterdir()) == ["also.txt"]


def test_a_linked_entry_path_is_not_quarantined_through_the_link(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    e = commit_fake(store)
    user = _user_files(tmp_path)
    (user / "thesis").mkdir()
    (user / "thesis" / "manifest.json").write_text("{}")   # looks like a broken entry through the link
    shutil.rmtree(root / "v1" / "sm_90a")
    (root / "v1" / "sm_90a").symlink_to(user, target_is_directory=True)
    (user / "compactify" / e.key[:2]).mkdir(parents=True)
    (user / "compactify" / e.key[:2] / e.key).symlink_to(user / "thesis", target_is_directory=True)
    with pytest.warns(UserWarning):
        assert store.lookup("sm_90a", "compactify", e.key) is None
    commit_fake(store)
    store.prune(everything=True)
    assert _intact(user) and (user / "thesis" / "manifest.json").read_text() == "{}"


def test_fifos_where_files_belong_never_block(tmp_path):
    code = textwrap.dedent(f"""
        import os, warnings
        from pathlib import Path
        warnings.simplefilter("ignore")
        from dsagen.store import CacheStore
        from dsagen.errors import CacheRootError
        from cache_util import commit_fake
        from dsagen.jit.keys import identity_of
        from dsagen.spec import CompactifySpec
        root = Path({str(tmp_path)!r}) / "cache"
        s = CacheStore(root, [])
        e = commit_fake(s)
        (e.path / "kernel.cubin").unlink(); os.mkfifo(e.path / "kernel.cubin")
        assert s.lookup("sm_90a", "compactify", e.key) is None
        e = commit_fake(s)
        (e.path / "manifest.json").unlink(); os.mkfifo(e.path / "manifest.json")
        assert s.lookup_identity("sm_90a", "compactify", identity_of(CompactifySpec(arch="sm_90a"))) is None
        (root / "CACHEDIR.TAG").unlink(); os.mkfifo(root / "CACHEDIR.TAG")
        try:
            s.prune()
        except CacheRootError as err:
            print("refused:", err)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}"))
    assert r.returncode == 0 and "refused:" in r.stdout, r.stderr[-2000:]


def test_odd_owner_names_never_crash_prune(tmp_path, monkeypatch):
    import tempfile

    root = tmp_path / "cache"
    store = CacheStore(root, [])
    commit_fake(store)
    host = store_mod._HOST
    odd = [f"unpack.{host}.99999999999999999999.a", f"unpack.{host}.\u00b2.a", f"unpack.{host}.0.a", "x.h.-1.a"]
    for n in odd:
        (root / "tmp" / n).mkdir()
    sys_tmp = tmp_path / "systmp"
    (sys_tmp / "dsagen-build-99999999999999999999-x").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(sys_tmp))
    store.prune()                               # young folders of unknown owners stay (age rule)
    assert all((root / "tmp" / n).exists() for n in odd)
    old = time.time() - 7200
    for n in odd:
        os.utime(root / "tmp" / n, (old, old))
    store.prune()
    assert not any((root / "tmp" / n).exists() for n in odd)


def test_a_lock_link_does_not_stop_prune(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root, [])
    e = commit_fake(store)
    user = _user_files(tmp_path)
    (root / "locks" / f"{e.key}.lock").unlink(missing_ok=True)
    (root / "locks" / f"{e.key}.lock").symlink_to(user / "precious.txt")
    assert str(e.path) in store.prune(everything=True)
    assert _intact(user)


def test_deeply_nested_or_edited_kernel_records_are_corruption(tmp_path):
    store = CacheStore(tmp_path / "cache", [])
    e = commit_fake(store)
    (e.path / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CacheCorruption, match="nested too deeply|not JSON"):
        check_entry(e.path)
    edits = {
        "block edited, hash kept": lambda m: dict(m, kernel=dict(m["kernel"], launch=dict(m["kernel"]["launch"],
                                                                                          block=[255, 1, 1]))),
        "param name is code": lambda m: _rehash(dict(m, kernel=dict(m["kernel"], params=[
            {"name": "__import__('os').system('x')", "kind": "i32", "offset": 0, "size": 4}]))),
        "smem negative": lambda m: _rehash(dict(m, kernel=dict(m["kernel"], launch=dict(m["kernel"]["launch"], smem=-5)))),
        "smem a bool": lambda m: _rehash(dict(m, kernel=dict(m["kernel"], launch=dict(m["kernel"]["launch"], smem=True)))),
        "grid outside the language": lambda m: _rehash(dict(m, kernel=dict(m["kernel"], launch=dict(
            m["kernel"]["launch"], grid=["__import__('os')", "1", "1"])))),
    }
    for what, edit in edits.items():
        e = commit_fake(store, source=what)
        _rewrite_manifest(e.path, edit)
        with pytest.raises(CacheCorruption, match="kernel"):
            check_entry(e.path)


def _rehash(m: dict) -> dict:
    from dsagen.kernel_record import kernel_record_sha256

    return dict(m, kernel_sha256=kernel_record_sha256(m["kernel"]))


def test_a_killed_marker_write_does_not_block_the_root(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    stale = root / f".{MARKER}.{dead}.deadbeef"
    stale.write_text("half a marker")
    commit_fake(CacheStore(root, []))
    assert str(stale) in CacheStore(root, []).prune() and not stale.exists()


def test_a_read_only_root_that_is_a_file_is_a_warning(tmp_path, monkeypatch, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("DSAGEN_CACHE_PATH", str(f))
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(store_mod, "_warned_roots", set())
    with pytest.warns(UserWarning, match="is not a folder"):
        store = CacheStore.from_env()
    assert store.lookup_identity("sm_90a", "compactify", IDENT) is None
    assert main(["list"]) == 0 and main(["verify"]) == 0


def test_show_never_reads_through_a_link_and_reports_a_corrupt_manifest_in_one_line(cache_env, tmp_path, capsys):
    root = cache_env
    e = commit_fake(CacheStore(root, []))
    user = _user_files(tmp_path)
    (user / "secret.json").write_text('{"secret": "do not print"}')
    (e.path / "manifest.json").unlink()
    (e.path / "manifest.json").symlink_to(user / "secret.json")
    assert main(["show", e.key[:8]]) == 1
    out, err = capsys.readouterr()
    assert "do not print" not in out + err and "Traceback" not in err
    (e.path / "manifest.json").unlink()
    (e.path / "manifest.json").write_text("not json")
    assert main(["show", e.key[:8]]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not JSON" in err


def test_more_user_errors_are_one_line(cache_env, tmp_path, capsys):
    raw = tmp_path / "spec.json"
    raw.write_bytes(b"\xff\xfe{")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    for argv in (["build", "--spec-file", str(raw)], ["build", "--spec-file", str(deep)],
                 ["build", "--spec", "[" * 100000], ["pack", "--out", ""], ["pack", "--out", "."],
                 ["pack", "--out", str(tmp_path)]):
        assert main(argv) == 2, argv[:2]
        err = capsys.readouterr().err
        assert err.startswith("dsagen: error: ") and err.count("\n") == 1 and "Traceback" not in err, err[:300]
    r = subprocess.run([sys.executable, "-m", "dsagen.cli", "list"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), close_fds=True,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and "standard output is closed" in r.stderr and "Traceback" not in r.stderr


def test_a_check_without_hashes_reads_no_artifact(tmp_path, monkeypatch):
    """list and show check entries without hashes: sizes and file types only, no artifact is read."""
    e = commit_fake(CacheStore(tmp_path / "cache", []))

    def no_read(*a, **k):
        raise AssertionError("an artifact was read")

    monkeypatch.setattr(store_mod, "_read_artifact", no_read)
    assert check_entry(e.path, verify_hashes=False)["key"] == e.key
    assert load_entry(e.path, verify_hashes=False, read=())[1] == {}


def test_a_pack_or_wheel_file_is_replaced_whole_or_not_at_all(tmp_path):
    """pack.replacing_file (dsagen pack and pack --wheel write through it): a clean write replaces the old file; an
    error while writing leaves the old file as it was and no temporary file beside it."""
    from dsagen.store.pack import replacing_file

    out = tmp_path / "kernels.tar"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with replacing_file(out) as f:
            f.write(b"half of the new")
            raise RuntimeError("disk full")
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["kernels.tar"]
    with replacing_file(out) as f:
        f.write(b"new")
        f.flush()
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["kernels.tar"]
