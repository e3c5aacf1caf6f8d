"""The `dsagen` command line: build, list, show, verify, prune, pack, unpack, env, bench.

    dsagen build --preset deepseek-v3.2 --arch sm_90a     # pre-generate a model's kernels (no GPU needed)
    dsagen list [--json]                                   # what the cache layers hold
    dsagen verify                                          # recompute every hash; non-zero exit on mismatch
    dsagen pack --out kernels.tar / dsagen unpack kernels.tar

Errors: a user's mistake or an environment, cache, pack or spec problem (dsagen.DsagenError, OSError)
prints one line `dsagen: error: ...` on stderr and exits 2; `--debug` or DSAGEN_DEBUG=1 prints the
traceback instead of the one line. `dsagen build` exits 1 when any kernel failed to build or could
not be stored in the writable cache.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import env
from .errors import CacheNotStored, ConfigError, DsagenError

_EPILOG_BUILD = """\
--arch: comma-separated targets (default $DSAGEN_ARCH, else sm_90a) for --preset. With --spec and
--spec-file, each spec is re-targeted to every --arch given (its "arch" field is replaced); without
--arch a spec keeps its own "arch". A preset that has no kernels yet for some of its ops on an arch
names them on stderr and builds the rest. The GPU tests' kernels are the spec file
tests/gpu/required_specs.json (the command line never executes test modules).

The exit status is 0 only when every kernel is on disk in the cache afterwards ("built" into the
writable root, or "cached" in any layer); a kernel compiled but not stored (lock timeout, full or
read-only disk, an entry removed under the build) is FAILED and the exit status is 1.
DSAGEN_CACHE=ro or off is refused up front (exit 2).
"""


def _arches_of(option: str | None) -> list[str] | None:
    """The --arch option as a list of known arch names (None when not given)."""
    from .spec import get_arch

    if option is None:
        return None
    arches = list(dict.fromkeys(a.strip() for a in option.split(",") if a.strip()))
    if not arches:
        raise ConfigError(f"--arch {option!r}: give one or more arch names, e.g. sm_90a")
    for a in arches:
        get_arch(a)
    return arches


def _spec_of(d, where: str, arch: str | None = None):
    """The checked spec of canonical dict `d` (from `where`), re-targeted to `arch` when given."""
    from .spec import KernelSpec, SpecError

    if not isinstance(d, dict) or not isinstance(d.get("fields"), dict):
        raise SpecError(f"{where}: a spec is a JSON object {{\"op\": ..., \"fields\": {{...}}}}, "
                        f"got {json.dumps(d)[:80]}")
    if arch is not None:
        d = copy.deepcopy(d)
        d["fields"]["arch"] = arch
    try:
        return KernelSpec.from_canonical(d).check()
    except TypeError as e:  # missing fields: the dataclass constructor's message names them
        raise SpecError(f"{where}: {e}") from None


def _json_of(text: str, where: str):
    from .spec import SpecError

    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"{where}: not valid JSON ({str(e)[:200]})") from None


def _specs_from_args(args) -> list:
    """Every spec the build options name, in order, without duplicates (see the build help for --arch)."""
    from .spec import get_preset, missing_ops

    arches = _arches_of(args.arch)
    preset_arches = arches or _arches_of(env.ARCH.get() or "sm_90a")
    specs = []
    for arch in preset_arches:
        for name in args.preset or ():
            specs.extend(get_preset(name, arch))
            missing = missing_ops(name, arch)
            if missing:
                print(f"dsagen: preset {name!r} has no {arch} kernels yet for: {', '.join(missing)} "
                      f"(impl='fused' ops needing them raise NotImplementedError there); building the rest",
                      file=sys.stderr)
    for text in args.spec or ():
        d = _json_of(text, f"--spec {text!r}")
        specs.extend(_spec_of(d, f"--spec {text!r}", a) for a in arches or [None])
    for path in args.spec_file or ():
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--spec-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        data = _json_of(text, f"--spec-file {path}")
        for i, d in enumerate(data if isinstance(data, list) else [data]):
            specs.extend(_spec_of(d, f"--spec-file {path} (spec {i})", a) for a in arches or [None])
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _build_one(canonical: dict) -> dict:
    """Worker: resolve (compile if needed) one spec into the cache; returns a summary row.

    Raises CacheNotStored when the kernel is not on disk in a cache layer afterwards (the resolver
    could not commit it, or the entry was removed right after), so a row says "built" or "cached" only
    for a kernel the cache holds.
    """
    from .jit import resolve
    from .store.store import CacheStore
    from .spec import KernelSpec

    spec = KernelSpec.from_canonical(canonical)
    store = CacheStore.from_env()
    t0 = time.perf_counter()
    cached = _is_cached(spec, store)
    entry = resolve(spec, store, jit=True, must_store=True)
    if entry.path is None or not (entry.path / "manifest.json").is_file():
        raise CacheNotStored(f"{spec.name()} was compiled but is not in the cache "
                             f"({entry.where()} is gone); run dsagen build again")
    k = entry.manifest["kernel"]
    return {"name": spec.name(), "op": spec.op, "arch": spec.arch, "key": entry.key,
            "status": "cached" if cached else "built", "seconds": round(time.perf_counter() - t0, 2),
            "regs": k.get("regcount"), "smem": k["launch"]["smem"], "path": entry.where()}


def _is_cached(spec, store) -> bool:
    """Whether resolve() would find `spec` without compiling (the same identity + toolchain lookup)."""
    from .jit.keys import identity_of
    from .jit.toolchain import toolchain_versions

    return store.lookup_identity(spec.arch, spec.op, identity_of(spec), toolchain_versions()) is not None


def _worker_init(parent_pid: int) -> None:
    """Build worker setup: leave Ctrl-C to the parent (which terminates the workers), and exit when
    the parent is gone (killed with SIGKILL, say): a daemon thread watches the parent pid."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="dsagen-parent-watch", daemon=True).start()


class _Terminated(SystemExit):
    """SIGTERM during `dsagen build`: unwinds like Ctrl-C, so that the workers are terminated."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated(128 + signum)


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """Stop every worker process of `pool` now (a compile in flight is abandoned; the cache's commit
    is atomic, so it leaves at most a staging folder that `dsagen prune` removes)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public API before Python 3.14
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def cmd_build(args) -> int:
    """`dsagen build`: render, compile and store the kernels the options name; 1 when any failed."""
    from .store.store import CacheStore
    from .jit.toolchain import dsl_available

    for var in env.ALL:  # a bad value fails here, naming the variable, not in every worker
        var.get()
    mode = env.CACHE_MODE.get()
    if mode != "rw":
        raise ConfigError(f"dsagen build stores kernels in the writable cache, but DSAGEN_CACHE={mode} "
                          f"({'never writes' if mode == 'ro' else 'uses no disk cache'}); "
                          f"unset it or set DSAGEN_CACHE=rw")
    specs = _specs_from_args(args)
    if not specs:
        raise ConfigError("nothing to build: give --preset, --spec or --spec-file")
    if not dsl_available():
        raise ConfigError("dsagen build needs CuTe-DSL: pip install 'dsagen[gen]'")
    CacheStore.from_env().ensure_root()  # refuses an unusable cache root here, once, not in every worker
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(specs)))
    print(f"building {len(specs)} kernel(s) for {', '.join(sorted({s.arch for s in specs}))} into "
          f"{env.CACHE_DIR.get()} with {jobs} job(s)", file=sys.stderr)
    rows, failed, t0 = [], [], time.perf_counter()

    tty = sys.stderr.isatty()

    def progress(i: int, row: dict) -> None:
        bar = "#" * int(24 * i / len(specs))
        line = f"[{bar:<24}] {i}/{len(specs)} {row['name'][:48]:<48} {row['status']:>6} {row['seconds']:6.2f}s"
        if tty:  # redraw one line; a log gets one line per kernel
            print("\r" + line, end="\n" if i == len(specs) else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def outcomes(pool):
        """(spec, a callable returning its summary row) in completion order."""
        if pool is None:
            for spec in specs:
                yield spec, lambda spec=spec: _build_one(spec.canonical())
        else:
            futs = {pool.submit(_build_one, spec.canonical()): spec for spec in specs}
            for fut in as_completed(futs):
                yield futs[fut], fut.result

    import multiprocessing as mp

    pool = (ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                initargs=(os.getpid(),)) if jobs > 1 else None)
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if pool is not None and main_thread else None
    try:
        for i, (spec, row_of) in enumerate(outcomes(pool), 1):
            try:
                rows.append(row_of())
            except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
                failed.append((spec.name(), e))
                rows.append({"name": spec.name(), "op": spec.op, "arch": spec.arch, "status": "FAILED",
                             "seconds": 0})
            progress(i, rows[-1])
    except BaseException:  # Ctrl-C, SIGTERM: stop the workers before unwinding
        if pool is not None:
            _terminate_workers(pool)
        raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    if pool is not None:
        pool.shutdown(wait=True)
    for r in rows:
        r["key"] = r.get("key", "")[:12]
    print(_table(rows, ["name", "op", "arch", "status", "seconds", "regs", "smem", "key"]))
    built = sum(r["status"] == "built" for r in rows)
    print(f"{len(rows)} kernel(s): {built} built, {sum(r['status'] == 'cached' for r in rows)} cached, "
          f"{len(failed)} failed in {time.perf_counter() - t0:.1f}s")
    for name, e in failed:
        print(f"FAILED {name}: {type(e).__name__}: {e}", file=sys.stderr)
    return 1 if failed else 0


def _entry_rows(store) -> list[dict]:
    from .store.store import CacheCorruption, check_entry

    rows = []
    for layer, path in store.entries():
        try:
            m = check_entry(path, verify_hashes=False)
            rows.append({"name": m.get("name"), "op": m.get("op"), "arch": m.get("arch"), "key": m["key"],
                         "identity": m.get("identity"), "created": m.get("created"),
                         "layer": str(layer.root), "writable": layer.writable, "path": str(path),
                         "toolchain": m.get("toolchain"), "spec": m.get("spec")})
        except CacheCorruption as e:
            rows.append({"name": "?", "key": path.name, "layer": str(layer.root), "path": str(path),
                         "error": str(e)})
    return rows


def cmd_list(args) -> int:
    """`dsagen list [--json]`: every entry of every cache layer."""
    from .store.store import CacheStore

    rows = _entry_rows(CacheStore.from_env())
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            r["key"] = r["key"][:12]
        print(_table(rows, ["name", "op", "arch", "key", "created", "layer"]) if rows else "(cache is empty)")
    return 0


def cmd_show(args) -> int:
    """`dsagen show KEY|NAME`: the manifests of the matching entries; 1 when none matches."""
    from .store.store import CacheStore

    store = CacheStore.from_env()
    hits = [r for r in _entry_rows(store) if r["key"].startswith(args.what) or r.get("name") == args.what]
    if not hits:
        print(f"no cache entry whose key starts with or whose name is {args.what!r}", file=sys.stderr)
        return 1
    from .store.store import CacheCorruption, load_entry

    bad = 0
    for r in hits:
        try:  # the checked manifest, read without following links
            print(json.dumps(load_entry(Path(r["path"]), verify_hashes=False, read=())[0], indent=1))
        except CacheCorruption as e:
            bad += 1
            print(f"dsagen: invalid entry: {e}", file=sys.stderr)
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """`dsagen verify`: recompute every artifact hash; 1 on any mismatch."""
    from .store.store import CacheCorruption, CacheStore, check_entry

    store = CacheStore.from_env()
    bad = n = 0
    for _layer, path in store.entries():
        n += 1
        try:
            check_entry(path, verify_hashes=True)
        except CacheCorruption as e:
            bad += 1
            print(f"MISMATCH {e}")
    print(f"verified {n} entr{'y' if n == 1 else 'ies'}: {n - bad} ok, {bad} bad")
    return 1 if bad else 0


def cmd_prune(args) -> int:
    """`dsagen prune [--all]`: remove leftovers, quarantine, stale and corrupt entries."""
    from .store.store import CacheStore
    from .jit.toolchain import GENERATOR_VERSION, dsl_available, toolchain_versions

    store = CacheStore.from_env()
    keep_tc = toolchain_versions() if dsl_available() and not args.all else None
    removed = store.prune(everything=args.all, keep_toolchain=keep_tc,
                          keep_generator=None if args.all else GENERATOR_VERSION)
    for p in removed:
        print(f"removed {p}")
    print(f"pruned {len(removed)} item(s) from {store.writable.root if store.writable else '(none)'}")
    return 0


def cmd_pack(args) -> int:
    """`dsagen pack --out F`: every complete entry into one checksummed tar."""
    from .store.pack import pack
    from .store.store import CacheStore

    out = Path(args.out)
    if not out.name or out.name in (".", "..") or out.is_dir():
        raise ConfigError(f"--out {args.out!r}: give a file name for the pack")
    n = pack(CacheStore.from_env(), out)
    print(f"packed {n} entr{'y' if n == 1 else 'ies'} into {args.out}")
    return 0


def cmd_unpack(args) -> int:
    """`dsagen unpack F`: verify a pack and add its entries to the writable cache."""
    from .store.pack import unpack
    from .store.store import CacheStore

    import tarfile

    try:
        n = unpack(CacheStore.from_env(), Path(args.file))
    except tarfile.TarError as e:
        raise DsagenError(f"{args.file}: not a dsagen pack (not a readable tar file)") from e
    print(f"unpacked {n} entr{'y' if n == 1 else 'ies'} into {env.CACHE_DIR.get()}")
    return 0


def cmd_env(args) -> int:
    """`dsagen env`: every environment variable (raw and effective value) and the toolchain."""
    from .jit.toolchain import toolchain_versions

    rows = []
    for var in env.ALL:
        try:
            value = var.get()
        except ValueError as e:
            value = f"INVALID: {e}"
        rows.append({"variable": var.name, "value": os.environ.get(var.name, "(unset)"), "effective": value,
                     "meaning": var.doc})
    print(_table(rows, ["variable", "value", "effective", "meaning"]))
    print(f"\ntoolchain: {toolchain_versions() or 'CuTe-DSL not installed (runtime only)'}")
    try:
        import torch

        cuda = f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "no"
        print(f"torch {torch.__version__}; CUDA: {cuda}")
    except ImportError:  # pragma: no cover
        pass
    return 0


def cmd_bench(args) -> int:
    """`dsagen bench NAME [ARGS]`: run bench/NAME.py with ARGS."""
    import runpy

    target = Path(__file__).resolve().parent.parent / "bench" / f"{args.which}.py"
    if not target.is_file():
        raise ConfigError(f"no benchmark {args.which!r} (looked for {target})")
    sys.argv = [str(target), *args.rest]
    sys.path.insert(0, str(target.parent))  # as `python bench/<name>.py` would: the benches import `common`
    try:
        runpy.run_path(str(target), run_name="__main__")
    finally:
        sys.path.remove(str(target.parent))
    return 0


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand; `--debug` goes before or after the subcommand."""
    debug_help = "print the traceback of an error instead of one line (also DSAGEN_DEBUG=1)"
    p = argparse.ArgumentParser(prog="dsagen", description=__doc__.split("\n\n")[0])
    p.add_argument("--debug", action="store_true", help=debug_help)
    common = argparse.ArgumentParser(add_help=False)  # SUPPRESS: a subcommand does not reset the flag
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    b = add("build", help="generate and compile kernels into the writable cache",
            epilog=_EPILOG_BUILD, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--preset", action="append", help="a model preset (repeatable)")
    b.add_argument("--spec", action="append", help="one spec as canonical JSON (repeatable)")
    b.add_argument("--spec-file", action="append", help="a JSON file with one spec or a list of specs")
    b.add_argument("--arch", help="comma-separated targets (default $DSAGEN_ARCH or sm_90a); re-targets "
                                  "--spec / --spec-file specs (see below)")
    b.add_argument("--jobs", "-j", type=int, help="parallel compile processes (default: CPU count)")
    b.set_defaults(fn=cmd_build)
    l_ = add("list", help="list cache entries")
    l_.add_argument("--json", action="store_true")
    l_.set_defaults(fn=cmd_list)
    s = add("show", help="print the manifest of an entry (key prefix or name)")
    s.add_argument("what")
    s.set_defaults(fn=cmd_show)
    add("verify", help="recompute every artifact hash; exit 1 on any mismatch").set_defaults(fn=cmd_verify)
    pr = add("prune", help="remove leftovers, quarantine, and stale or corrupt entries")
    pr.add_argument("--all", action="store_true", help="remove every entry of the writable cache")
    pr.set_defaults(fn=cmd_prune)
    pk = add("pack", help="write every cache entry into a checksummed tar file")
    pk.add_argument("--out", required=True)
    pk.set_defaults(fn=cmd_pack)
    up = add("unpack", help="verify a pack and add its entries to the writable cache")
    up.add_argument("file")
    up.set_defaults(fn=cmd_unpack)
    add("env", help="show configuration and toolchain").set_defaults(fn=cmd_env)
    be = add("bench", help="run a benchmark from bench/ (e.g. overhead, indexer)")
    be.add_argument("which")
    be.add_argument("rest", nargs=argparse.REMAINDER)
    be.set_defaults(fn=cmd_bench)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so that the interpreter's final flush cannot
    fail again (the recipe of Python's signal module documentation)."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run the `dsagen` command line on `argv` (default sys.argv[1:]); returns the exit status.

    0 success; 1 a command's own failure (a kernel not built, a hash mismatch, no such entry); 2 a
    usage, configuration, cache, pack or spec error (dsagen.DsagenError, OSError), printed as one line
    `dsagen: error: ...` (with --debug or DSAGEN_DEBUG=1: the traceback); 130 / 143 after Ctrl-C /
    SIGTERM. A closed stdout (`dsagen list | head -1`) ends the command quietly with status 1.
    """
    args = make_parser().parse_args(argv)
    debug = args.debug
    if sys.stdout is None:  # started with stdout closed (`dsagen list >&-`): nowhere to print results
        print("dsagen: error: standard output is closed", file=sys.stderr)
        return 2
    try:
        debug = debug or env.DEBUG.get()
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except KeyboardInterrupt:
        print("dsagen: interrupted", file=sys.stderr)
        return 130
    except (DsagenError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"dsagen: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
