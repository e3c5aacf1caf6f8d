"""Fault injection against pack and wheel files: outputs written through planted links, archives whose
headers make a tar reader allocate far more memory than the archive's size, headers that crash a reader
with a traceback, and wheel names that would replace another installed project. Each test builds the
hostile file in memory (raw tar headers where the standard library would refuse to write them) and
checks that dsagen refuses it with one error of its own, in bounded memory, writing nothing."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from dsagen.errors import ConfigError
from dsagen.store import CacheStore
from dsagen.store.pack import CHECKSUMS, PackError, pack, unpack
from dsagen.store.wheel import package_name, write_wheel

from cache_util import commit_fake

FOLDER = f"v1/sm_90a/compactify/ab/{'ab' * 32}"
MEMORY_CAP = 64 << 20          # what one unpack of a small hostile archive may allocate at its peak


# ---- raw tar building blocks ----------------------------------------------------------------------------
def _header(name: str, size: int, kind: bytes = b"0", *, magic: bytes = b"ustar\x0000", prefix: str = "",
            extra: dict[int, bytes] | None = None) -> bytes:
    """One 512-byte tar header with a correct checksum, whatever its type (tarfile would refuse to write some)."""
    b = bytearray(512)
    b[0:len(name)] = name.encode()
    b[100:108] = b"0000644\0"
    b[108:116] = b[116:124] = b"0000000\0"
    b[124:136] = b"%011o\0" % size
    b[136:148] = b"%011o\0" % 0
    b[156:157] = kind
    b[257:265] = magic
    b[345:345 + len(prefix)] = prefix.encode()
    for offset, data in (extra or {}).items():
        b[offset:offset + len(data)] = data
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def _records(*pairs: tuple[str, str]) -> bytes:
    """PAX records `"%d %s=%s\\n"`, each length counting itself."""
    out = b""
    for key, value in pairs:
        body = f" {key}={value}\n".encode()
        n = len(body) + 1
        while n != len(body) + len(str(n)):
            n = len(body) + len(str(n))
        out += str(n).encode() + body
    return out


def _pax(*pairs: tuple[str, str], kind: bytes = b"x") -> bytes:
    data = _records(*pairs)
    return _header("PaxHeader", len(data), kind) + _pad(data)


def _member(name: str, data: bytes) -> bytes:
    """A regular file, its long name in the ustar prefix field as a POSIX writer may put it."""
    prefix, _, base = name.rpartition("/")
    return _header(base, len(data), prefix=prefix) + _pad(data)


END = b"\0" * 1024
CUBIN = f"{FOLDER}/kernel.cubin"


def _zeros_gz(parts: list[bytes | int]) -> bytes:
    """Gzip of `parts` concatenated, an int standing for that many zero bytes (written in 1 MiB pieces, so a
    few hundred MiB of zeros cost a few hundred KiB and no big buffer)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=1, mtime=0) as g:
        for p in parts:
            if isinstance(p, int):
                zeros = b"\0" * (1 << 20)
                while p:
                    n = min(p, len(zeros))
                    g.write(zeros[:n])
                    p -= n
            else:
                g.write(p)
    return buf.getvalue()


def _refused_in_little_memory(tmp_path: Path, data: bytes, match: str | None = None) -> PackError:
    """Unpack `data` as a pack file into a fresh cache: it must be one PackError, raised with at most
    MEMORY_CAP bytes allocated at the peak, and the cache must hold nothing after it."""
    f = tmp_path / "hostile.tar"
    f.write_bytes(data)
    store = CacheStore(tmp_path / "dst", [])
    store.ensure_root()
    tracemalloc.start()
    try:
        with pytest.raises(PackError) as err:
            unpack(store, f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_CAP, f"{peak >> 20} MiB allocated at the peak"
    assert str(err.value).startswith(str(f)) and "\n" not in str(err.value)
    if match is not None:
        assert match in str(err.value), err.value
    root = tmp_path / "dst"
    assert not any((root / "v1").rglob("*")) if (root / "v1").exists() else True
    assert not any((root / "tmp").iterdir()) if (root / "tmp").exists() else True
    return err.value


# ---- memory: archives that inflate a tar reader's headers ------------------------------------------------
def test_a_pax_size_record_cannot_hide_headers_from_the_checks(tmp_path):
    """Fault: two PAX headers in a row that disagree on a member's size. One reader takes the first, another
    the second, so headers hidden in what one calls member data (here a 150 MiB GNU long name) escape the
    checks and are read whole. A dsagen pack never has two PAX headers in a row, nor a GNU long name."""
    hidden = _header("././@LongLink", 150 << 20, b"L")
    data = _zeros_gz([_pax(("size", "1024")), _pax(("size", "0")), _header("kernel.cubin", 0, prefix=FOLDER),
                      END, hidden, 150 << 20, END])
    assert len(data) < 1 << 20
    _refused_in_little_memory(tmp_path, data)


def test_a_smuggled_pax_keyword_is_refused(tmp_path):
    """Fault: a PAX record whose keyword is not one dsagen writes (here one hiding a `size` record inside its
    value, and a 1 MiB comment): a dsagen pack's PAX headers hold only `path`, and at most 4 KiB."""
    smuggled = _records(("comment", "x\n9 size=1\n"), ("path", CUBIN))
    data = _header("PaxHeader", len(smuggled), b"x") + _pad(smuggled) + _header("k", 0) + END
    _refused_in_little_memory(tmp_path, data, "PAX")
    big = _records(("comment", "y" * (1 << 20)))
    data = _zeros_gz([_header("PaxHeader", len(big), b"x"), _pad(big), _header("kernel.cubin", 0, prefix=FOLDER),
                      END])
    _refused_in_little_memory(tmp_path, data, "PAX")


def test_a_gnu_sparse_map_is_refused_before_it_is_read(tmp_path):
    """Fault: a GNU sparse file (PAX GNU.sparse.major=1) whose sparse map, read from the member's data, is
    millions of numbers: a reader that honours it builds a list as long as the data. dsagen packs hold no
    sparse files."""
    numbers = b"99999999\n" + b"1000\n" * (3 << 20)
    data = _zeros_gz([_pax(("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.name", CUBIN),
                           ("GNU.sparse.realsize", "1")),
                      _header("kernel.cubin", len(numbers), prefix=FOLDER), _pad(numbers), END])
    assert len(data) < 1 << 20
    _refused_in_little_memory(tmp_path, data)


def test_a_solaris_extended_header_is_refused_before_it_is_read(tmp_path):
    """Fault: a Solaris extended header (type X) of 120 MiB, which a reader takes for a PAX header and reads
    whole, while a check that knows only type x took it for a member within the 256 MiB cap."""
    data = _zeros_gz([_header("PaxHeader", 120 << 20, b"X"), 120 << 20, _header("kernel.cubin", 0, prefix=FOLDER),
                      END])
    assert len(data) < 1 << 20
    _refused_in_little_memory(tmp_path, data, "'X'")


def test_old_gnu_sparse_extension_blocks_are_refused(tmp_path):
    """Fault: an old GNU sparse member (type S) whose header says more extension blocks follow, 40000 of them
    holding 21 sparse records each: a reader collects every record in a list before the member's data."""
    n = 40_000
    ext = bytearray(512)
    for i in range(21):
        ext[i * 24:i * 24 + 24] = b"%011o\0%011o\0" % (1000 + i, 1000 + i)
    ext[504] = 1
    head = _header("kernel.cubin", n * 512, b"S", magic=b"ustar  \0", extra={482: b"\1"})
    data = _zeros_gz([head, bytes(ext) * n, END])
    assert len(data) < 1 << 20
    _refused_in_little_memory(tmp_path, data, "'S'")


def test_an_empty_compressed_stream_in_front_of_a_plain_tar_is_not_a_way_around_the_checks(tmp_path):
    """Fault: an empty bzip2 (or gzip, xz) stream followed by a plain tar with a hostile header (a Solaris X
    header of 120 MiB): a check that stops at the end of the first stream sees an empty archive, while a reader
    may read on. What dsagen checks is exactly what it reads: data after a compressed stream that is not
    another stream of the same format is refused."""
    hostile = _header("PaxHeader", 120 << 20, b"X") + b"\0" * (120 << 20) + END
    for empty in (bz2.compress(b""), gzip.compress(b"", mtime=0), lzma.compress(b"")):
        _refused_in_little_memory(tmp_path, empty + hostile)


# ---- tracebacks: headers that crash a reader -------------------------------------------------------------
@pytest.mark.parametrize("kind", [b"x", b"L"])
def test_chained_extended_headers_are_one_pack_error(tmp_path, kind):
    """Fault: 3000 PAX (or GNU long name) headers in a row before one member: a reader that follows them
    recursively hits RecursionError. dsagen allows one PAX header per member and no GNU long names."""
    one = _pax(("path", CUBIN)) if kind == b"x" else _header("././@LongLink", 4, b"L") + _pad(b"abc\0")
    data = one * 3000 + _header("kernel.cubin", 0, prefix=FOLDER) + END
    _refused_in_little_memory(tmp_path, data)


@pytest.mark.parametrize("fault", ["map-not-numbers", "map-0.1-not-numbers", "map-cut-off", "old-sparse-cut-off"])
def test_broken_sparse_headers_are_one_pack_error(tmp_path, fault):
    """Fault: a sparse map that is not numbers (ValueError in a reader that honours it), one cut off inside
    its count line, and an old GNU sparse header announcing an extension block that the archive lacks
    (IndexError): each is one PackError."""
    sparse = _pax(("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.realsize", "1"))
    data = {
        "map-not-numbers": sparse + _header("kernel.cubin", 512, prefix=FOLDER) + _pad(b"2\nnot-a-number\n") + END,
        "map-0.1-not-numbers": _pax(("GNU.sparse.map", "1,x")) + _header("kernel.cubin", 0, prefix=FOLDER) + END,
        "map-cut-off": sparse + _header("kernel.cubin", 512, prefix=FOLDER) + b"1" * 512 + END,
        "old-sparse-cut-off": _header("kernel.cubin", 0, b"S", magic=b"ustar  \0", extra={482: b"\1"}),
    }[fault]
    _refused_in_little_memory(tmp_path, data)


def _pack_with(tmp_path: Path, edit) -> Path:
    """A pack of one real entry, its members passed through `edit({name: bytes}) -> {name: bytes}` and the
    checksum list recomputed: a pack whose checksums hold, whatever it contains."""
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src, source="one")
    good = tmp_path / "good.tar"
    assert pack(src, good) == 1
    with tarfile.open(good) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.name != CHECKSUMS}
    files = edit(files)
    sums = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    files[CHECKSUMS] = json.dumps(sums).encode()
    out = tmp_path / "edited.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out


def test_an_artifact_name_no_file_system_takes_is_one_pack_error(tmp_path):
    """Fault: an entry whose manifest lists an artifact of a 300-character name, with matching checksums:
    no file system stores that name, so writing it would fail with OSError halfway through an unpack."""
    long_name = "a" * 300

    def add_artifact(files):
        (folder,) = {n.rsplit("/", 1)[0] for n in files}
        m = json.loads(files[f"{folder}/manifest.json"])
        blob = b"extra"
        m["artifacts"][long_name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        files[f"{folder}/manifest.json"] = json.dumps(m).encode()
        files[f"{folder}/{long_name}"] = blob
        return files

    err = _refused_in_little_memory(tmp_path, _pack_with(tmp_path, add_artifact).read_bytes())
    assert "a" * 50 in str(err)


# ---- what dsagen writes still unpacks ---------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["plain", "gzip", "bzip2", "xz", "gzip-2-streams", "bzip2-2-streams"])
def test_packs_dsagen_writes_unpack_plain_or_compressed(tmp_path, compression):
    """Not a fault: the reader that refuses all of the above still reads dsagen's own packs, plain, compressed
    with gzip, bzip2 or xz, and as two concatenated compressed streams (pigz, pbzip2), in little memory."""
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src, source="one")
    commit_fake(src, source="two")
    raw = tmp_path / "k.tar"
    assert pack(src, raw) == 2
    tar = raw.read_bytes()
    half = len(tar) // 2
    data = {"plain": lambda: tar, "gzip": lambda: gzip.compress(tar), "bzip2": lambda: bz2.compress(tar),
            "xz": lambda: lzma.compress(tar),
            "gzip-2-streams": lambda: gzip.compress(tar[:half]) + gzip.compress(tar[half:]),
            "bzip2-2-streams": lambda: bz2.compress(tar[:half]) + bz2.compress(tar[half:])}[compression]()
    f = tmp_path / "k.pack"
    f.write_bytes(data)
    assert unpack(CacheStore(tmp_path / "dst", []), f) == 2


def test_a_compressed_pack_with_garbage_after_its_stream_is_refused(tmp_path):
    """Fault: a gzip'd pack cut short inside its compressed stream, and one whose stream is followed by bytes
    that are not another gzip stream, before the tar's end: one PackError each."""
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src, source="one")
    raw = tmp_path / "k.tar"
    pack(src, raw)
    tar = raw.read_bytes()
    packed = gzip.compress(tar)
    assert _refused_in_little_memory(tmp_path, packed[:len(packed) // 2]).args[0].endswith("cut short")
    _refused_in_little_memory(tmp_path, gzip.compress(tar[:2048]) + b"garbage" + tar[2048:])


# ---- outputs: never write through a link -----------------------------------------------------------------
def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("the user's file")
    return v


def _store_with_an_entry(tmp_path: Path) -> CacheStore:
    src = CacheStore(tmp_path / "src", [])
    commit_fake(src, source="one")
    return src


def test_pack_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path):
    """Fault: a link planted at the predictable temporary name `<out>.tmp-<pid>` beside the pack's output,
    pointing at a user's file: pack must write a fresh file of its own, never the file the link points to."""
    victim = _victim(tmp_path)
    out = tmp_path / "k.tar"
    planted = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    planted.symlink_to(victim)
    assert pack(_store_with_an_entry(tmp_path), out) == 1
    assert victim.read_text() == "the user's file"
    assert not out.is_symlink() and tarfile.is_tarfile(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["k.tar", planted.name, "victim.txt", "src"])


def test_pack_wheel_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path):
    """Fault: the same planted link beside the wheel `pack --wheel` writes."""
    victim = _victim(tmp_path)
    dist = tmp_path / "dist"
    dist.mkdir()
    whl = "t_dsagen_kernels-1.0-py3-none-any.whl"
    planted = dist / f"{whl}.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    path, n = write_wheel(_store_with_an_entry(tmp_path), dist, "t-dsagen-kernels", "1.0")
    assert (path.name, n) == (whl, 1)
    assert victim.read_text() == "the user's file"
    assert not path.is_symlink() and path.read_bytes()[:2] == b"PK"
    assert sorted(p.name for p in dist.iterdir()) == sorted([whl, planted.name])


def test_an_output_that_is_a_link_is_refused_naming_out(tmp_path):
    """Fault: the output path itself is a link (to a user's file, or dangling): pack and pack --wheel refuse it
    with an error naming --out and leave both the link and its target as they were."""
    victim = _victim(tmp_path)
    store = _store_with_an_entry(tmp_path)
    for target in (victim, tmp_path / "nowhere"):
        out = tmp_path / "k.tar"
        out.symlink_to(target)
        with pytest.raises(PackError, match="--out"):
            pack(store, out)
        assert out.is_symlink() and os.readlink(out) == str(target)
        out.unlink()
    dist = tmp_path / "dist"
    dist.mkdir()
    whl = dist / "t_dsagen_kernels-1.0-py3-none-any.whl"
    whl.symlink_to(victim)
    with pytest.raises(PackError, match="--out"):
        write_wheel(store, dist, "t-dsagen-kernels", "1.0")
    assert whl.is_symlink() and victim.read_text() == "the user's file"
    assert sorted(p.name for p in dist.iterdir()) == [whl.name]


def test_a_failed_pack_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Fault: an error while the pack is written (disk full): the old output stays as it was and no temporary
    file is left beside it."""
    import dsagen.store.pack as pack_mod

    out = tmp_path / "k.tar"
    out.write_bytes(b"old")
    store = _store_with_an_entry(tmp_path)

    def full(*a, **k):
        yield from ()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pack_mod, "shippable_entries", full)
    with pytest.raises(OSError):
        pack(store, out)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["k.tar", "src"]


# ---- wheel names: never another project's -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["torch", "filelock", "Jinja2", "cuda_bindings", "cuda-python", "numpy", "vllm",
                                  "nvidia-cutlass-dsl", "my-model-kernels", "kernels", "dsagen-kernels-x", "dsagen",
                                  "DSAgen"])
def test_a_wheel_name_that_could_replace_another_project_is_refused(name):
    """Fault: `pack --wheel --name torch` (or another project's name): pip installing that wheel would replace
    the project. A kernel wheel's name is dsagen-kernels or ends with -dsagen-kernels, and dsagen's own name and
    its dependencies are refused by name."""
    with pytest.raises(ConfigError, match="--name") as err:
        package_name(name)
    assert "dsagen-kernels" in str(err.value)


def test_dependencies_of_dsagen_are_refused_whatever_the_name_rule():
    """Every project dsagen's installed metadata requires is refused as a wheel name, in any spelling."""
    import importlib.metadata as md
    import re

    for req in md.requires("dsagen") or []:
        dep = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0)
        for spelling in (dep, dep.upper(), dep.replace("-", "_")):
            with pytest.raises(ConfigError, match="--name"):
                package_name(spelling)


@pytest.mark.parametrize("name,pkg", [("dsagen-kernels", "dsagen_kernels"),
                                      ("my-model-dsagen-kernels", "my_model_dsagen_kernels"),
                                      ("H200.DSAgen_Kernels", "h200_dsagen_kernels")])
def test_kernel_wheel_names_are_taken(name, pkg):
    assert package_name(name) == pkg


def test_the_cli_reports_a_refused_name_in_one_line(cache_env, capsys):
    from dsagen.cli import main

    commit_fake(CacheStore.from_env(), source="one")
    assert main(["pack", "--wheel", "--out", str(cache_env.parent / "dist"), "--name", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsagen: error: ") and err.count("\n") == 1 and "--name" in err
    assert not (cache_env.parent / "dist").exists() or not any((cache_env.parent / "dist").iterdir())
