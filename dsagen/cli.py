"""The `dsagen` command line: build, list, show, verify, prune, pack, unpack, env, bench.

    dsagen build --preset deepseek-v3.2 --arch sm_90a   # a model's kernels (no GPU needed)
    dsagen build --model config.json [--dry-run]         # the kernels of a Hugging Face config
    dsagen list [--json]                                 # what the cache layers hold, from where
    dsagen verify                                        # recompute every hash; exit 1 on mismatch
    dsagen pack --out kernels.tar / dsagen unpack kernels.tar
    dsagen pack --wheel --out dist/ [--name NAME]        # a pip-installable kernel wheel

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
from typing import Iterable

from . import env
from ._version import __version__
from .errors import CacheNotStored, ConfigError, DsagenError
from .log import get_logger

_log = get_logger("build")
WIDTH = 100  # every table fits this many columns

_SPEC_FORMAT = """\
Spec JSON (--spec, --spec-file; the "spec" that `dsagen show` and `dsagen list --json` print): one kernel
is an object {"op": OP, "fields": {FIELD: VALUE, ...}}; a field left out takes its default, an unknown
op, field or top-level key is an error, and so is a value of another JSON type than the field's (8.0 or
true for an int field, 1 for a bool); a spec file holds one such object or a JSON list of them (16 MiB at
most). Example:
  dsagen build --spec '{"op": "compactify", "fields": {"arch": "sm_90a"}}'
"""

_EPILOG_BUILD_TAIL = """\
Sources (combine any): --preset NAME (a model's kernels; deepseek-v3.2), --model CONFIG.json (a Hugging
Face-style config of a DeepSeek sparse-attention model: num_attention_heads, kv_lora_rank,
qk_rope_head_dim, index_n_heads, index_head_dim, index_topk, torch_dtype; other fields are ignored;
examples/deepseek-v3.2-config.json), --spec JSON, --spec-file FILE (the GPU tests' kernels are
tests/gpu/required_specs.json; the command line never executes test modules).

--arch: comma-separated targets (default $DSAGEN_ARCH, else sm_90a) for --preset and --model. With --spec
and --spec-file, each spec is re-targeted to every --arch given (its "arch" field is replaced); without
--arch a spec keeps its own "arch". A preset or model that has no kernels yet for some of its ops on an
arch names them on stderr and builds the rest.

--dry-run lists every kernel the options name and whether a cache layer already holds it ("cached",
and which layer) or a build would compile it ("to build"); it compiles and writes nothing (exit 0).

--check looks every kernel up as --dry-run does and prints each missing one (MISSING, with the command
that builds it); it compiles and writes nothing and exits 1 when any kernel is missing, 0 when all are
cached: a gate before deploying a cache. Where CuTe-DSL is installed a kernel counts only when built by
its toolchain (as for a build); without it, an entry of any toolchain counts (as for a deployment).

The exit status is 0 only when every kernel is on disk in the cache afterwards ("built" into the
writable root, or "cached" in any layer); a kernel compiled but not stored (lock timeout, full or
read-only disk, an entry removed under the build) is FAILED and the exit status is 1.
DSAGEN_CACHE=ro or off is refused up front (exit 2).
"""


def _refill(text: str, width: int = WIDTH - 2) -> str:
    """`text` with each paragraph refilled to `width` columns; indented lines (examples) are kept as they are."""
    import textwrap

    out, para = [], []

    def flush() -> None:
        if para:
            out.extend(textwrap.wrap(" ".join(para), width, break_on_hyphens=False))
            para.clear()

    for line in text.splitlines():
        if not line.strip() or line.startswith("  "):
            flush()
            out.append(line)
        else:
            para.append(line.strip())
    flush()
    return "\n".join(out) + "\n"


def _ops_help() -> str:
    """Every registered op with its fields and defaults, wrapped to the table width (for --help)."""
    import dataclasses
    import textwrap

    from .spec import spec_types

    lines = ["Ops and their fields (default after '='; arch has none):"]
    for op, cls in sorted(spec_types().items()):
        fields = [f.name if f.default is dataclasses.MISSING else f"{f.name}={json.dumps(f.default)}"
                  for f in dataclasses.fields(cls)]
        lines += textwrap.wrap(f"{op}: {', '.join(fields)}", WIDTH - 2, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines) + "\n"


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
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
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
    from .spec.base import read_capped
    from .spec.model_config import load_model_config, missing_ops_for_model, specs_for_model

    arches = _arches_of(args.arch)
    preset_arches = arches or _arches_of(env.ARCH.get() or "sm_90a")
    models = [(path, load_model_config(path, args.tp)) for path in args.model or ()]
    if args.tp != 1 and not models:
        raise ConfigError(f"--tp {args.tp}: only --model configs are split over GPUs; give --model")
    specs = []

    def say_missing(what: str, arch: str, missing: list[str]) -> None:
        if missing:
            print(f"dsagen: {_printable(what)} has no {arch} kernels yet for: {', '.join(missing)} "
                  f"(impl='fused' ops needing them raise NotImplementedError there); building the rest",
                  file=sys.stderr)

    serving = args.serving
    if serving and not (args.preset or models):
        raise ConfigError("--serving selects among the kernels of a --preset or --model; give one")
    for arch in preset_arches:
        for name in args.preset or ():
            specs.extend(get_preset(name, arch, serving))
            say_missing(f"preset {name!r}", arch, missing_ops(name, arch, serving))
        for path, model in models:
            specs.extend(specs_for_model(model, arch, serving))
            say_missing(f"model {path}", arch, missing_ops_for_model(model, arch, serving))
    for text in args.spec or ():
        d = _json_of(text, f"--spec {text!r}")
        specs.extend(_spec_of(d, f"--spec {text!r}", a) for a in arches or [None])
    for path in args.spec_file or ():
        try:
            text = read_capped(path, f"--spec-file {path}").decode("utf-8")
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
    """SIGTERM during `dsagen build`: unwinds like Ctrl-C, so that the workers are terminated and the compile and
    staging folders of a build in this process are removed by their own cleanup."""


def _raise_terminated(signum, frame) -> None:
    # one unwinding: a second SIGTERM must not interrupt the cleanup the first one started (the build
    # restores the previous handler when it has unwound)
    signal.signal(signum, signal.SIG_IGN)
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


def _printable(text) -> str:
    """`text` (any value, as str()) with every character that is not printable written as an escape: controls as
    `\\x1b`, `\\n`, ..., other non-printables as `\\u200b`, and the surrogate escapes of a file name that is not
    UTF-8 as the byte they stand for (`\\xff`). Names, paths and values from a cache, a spec or the file system
    are printed through this: they cannot move the cursor, retitle the terminal or forge lines, and they encode
    on any stdout."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    """One non-printable character as a Python escape (a surrogate escape as its byte, as the file name has it)."""
    if "\udc80" <= c <= "\udcff":
        return f"\\x{ord(c) - 0xdc00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def _fit(text: str, width: int) -> str:
    """`text` cut to `width` characters: its head and tail around '..' (paths and names keep both ends)."""
    text = str(text)
    if len(text) <= width:
        return text
    if width <= 2:
        return text[:width]
    head = (width - 2 + 1) // 2
    return text[:head] + ".." + text[len(text) - (width - 2 - head):]


def _table(rows: list[dict], cols: list[str], shrink: tuple[str, ...] = (), width: int = WIDTH) -> str:
    """`rows` as a text table of `cols`, at most `width` columns wide: the widest column of `shrink` gives up a
    character at a time (down to its heading's width or 8) and its cells are cut with `_fit`; the last column is
    not padded."""
    text = [{c: _printable("" if r.get(c) is None else r.get(c)) for c in cols} for r in rows]
    widths = {c: max(len(c), *(len(t[c]) for t in text)) for c in cols}
    floor = {c: max(len(c), 8) for c in shrink}
    while sum(widths.values()) + 2 * (len(cols) - 1) > width:
        candidates = [c for c in shrink if widths[c] > floor[c]]
        if not candidates:
            break
        widest = max(candidates, key=lambda c: widths[c])
        widths[widest] -= 1

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(widths[c]) for c, cell in zip(cols, cells)).rstrip()

    out = [line(cols), line(["-" * widths[c] for c in cols])]
    out += [line([_fit(t[c], widths[c]) for c in cols]) for t in text]
    return "\n".join(out)


def cmd_build(args) -> int:
    """`dsagen build`: render, compile and store the kernels the options name; 1 when any failed."""
    from .store.store import CacheStore
    from .jit.toolchain import dsl_available

    for var in env.ALL:  # a bad value fails here, naming the variable, not in every worker
        var.get()
    if args.check and args.dry_run:
        raise ConfigError("--check and --dry-run: give one (--check exits 1 when a kernel is missing)")
    if args.check:
        return _check(args)
    if args.dry_run:
        return _dry_run(args)
    mode = env.CACHE_MODE.get()
    if mode != "rw":
        raise ConfigError(f"dsagen build stores kernels in the writable cache, but DSAGEN_CACHE={mode} "
                          f"({'never writes' if mode == 'ro' else 'uses no disk cache'}); "
                          f"unset it or set DSAGEN_CACHE=rw")
    specs = _specs_from_args(args)
    if not specs:
        raise ConfigError("nothing to build: give --preset, --model, --spec or --spec-file")
    if not dsl_available():
        raise ConfigError("dsagen build needs CuTe-DSL: pip install 'dsagen[gen]'")
    CacheStore.from_env().ensure_root()  # refuses an unusable cache root here, once, not in every worker
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(specs)))  # args.jobs is None or >= 1
    print(f"building {len(specs)} kernel(s) for {', '.join(sorted({s.arch for s in specs}))} into "
          f"{_printable(env.CACHE_DIR.get())} with {jobs} job(s)", file=sys.stderr)
    _log.info("build of %d kernel(s) into %s with %d job(s)", len(specs), env.CACHE_DIR.get(), jobs)
    rows, failed, t0 = [], [], time.perf_counter()

    tty = sys.stderr.isatty()

    def progress(i: int, row: dict) -> None:
        _log.info("%s %s (%.2fs)", row["status"], row["name"], row["seconds"])
        bar = "#" * int(24 * i / len(specs))
        count = f"{i}/{len(specs)}"
        name = _fit(_printable(row["name"]), 56 - len(count))
        line = f"[{bar:<24}] {count} {name:<{56 - len(count)}} {row['status']:>6} {row['seconds']:6.2f}s"
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
    # every build, with workers or not: the default SIGTERM would end this process at once, leaving the
    # compile folder and the cache staging folder of a build running here
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
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
    print(_table(rows, ["name", "arch", "status", "seconds", "regs", "smem", "key"], shrink=("name",)))
    built = sum(r["status"] == "built" for r in rows)
    print(f"{len(rows)} kernel(s): {built} built, {sum(r['status'] == 'cached' for r in rows)} cached, "
          f"{len(failed)} failed in {time.perf_counter() - t0:.1f}s")
    for name, e in failed:
        _log.error("FAILED %s: %s: %s", name, type(e).__name__, e)
        print(_printable(f"FAILED {name}: {type(e).__name__}: {e}"), file=sys.stderr)
    return 1 if failed else 0


def _dry_run(args) -> int:
    """`dsagen build --dry-run`: each kernel the options name, "cached" (and where) or "to build"; compiles
    and writes nothing. Without CuTe-DSL an entry of any toolchain counts (as a deployment would use it)."""
    from .jit.toolchain import dsl_available, toolchain_versions

    specs = _specs_from_args(args)
    if not specs:
        raise ConfigError("nothing to build: give --preset, --model, --spec or --spec-file")
    tc = toolchain_versions() if dsl_available() else None
    rows = []
    for spec, hit in _lookups(specs, tc):
        rows.append({"name": spec.name(), "arch": spec.arch, "status": "cached" if hit else "to build",
                     "key": hit.key[:12] if hit else "", "source": hit.layer.origin if hit else ""})
    print(_table(rows, ["name", "arch", "status", "key", "source"], shrink=("name", "source")))
    todo = sum(r["status"] == "to build" for r in rows)
    print(f"{len(rows)} kernel(s): {len(rows) - todo} cached, {todo} to build (dry run: nothing compiled)")
    if tc is None:
        print("dsagen: CuTe-DSL is not installed here: a real build needs it (pip install 'dsagen[gen]')",
              file=sys.stderr)
    return 0


def _lookups(specs: list, toolchain: dict | None) -> list[tuple]:
    """(spec, the cache entry a build would find for it, or None) for each spec: the identity lookup of
    `dsagen build`, restricted to `toolchain` when given (None: an entry of any toolchain counts)."""
    from .jit.keys import identity_of
    from .store.store import CacheStore

    store = CacheStore.from_env()
    return [(spec, store.lookup_identity(spec.arch, spec.op, identity_of(spec), toolchain, spec=spec.canonical()))
            for spec in specs]


def _check(args) -> int:
    """`dsagen build --check`: the deploy gate. Looks every kernel up as --dry-run does, compiles and writes
    nothing, prints each missing kernel with the command that builds it; 1 when any is missing, else 0."""
    from .jit.resolver import build_command
    from .jit.toolchain import dsl_available, toolchain_versions

    specs = _specs_from_args(args)
    if not specs:
        raise ConfigError("nothing to check: give --preset, --model, --spec or --spec-file")
    missing = [spec for spec, hit in _lookups(specs, toolchain_versions() if dsl_available() else None)
               if hit is None]
    for spec in missing:
        print(_printable(f"MISSING {spec.name()} ({spec.arch}): {build_command(spec)}"))
    print(f"{len(specs)} kernel(s): {len(specs) - len(missing)} cached, {len(missing)} missing "
          f"(check: nothing compiled)")
    return 1 if missing else 0


def _entry_rows(store) -> list[dict]:
    from .store.store import CacheCorruption, check_entry

    rows = []
    for layer, path in store.entries():
        where = {"layer": str(layer.root), "source": layer.origin, "writable": layer.writable, "path": str(path),
                 "bytecode_ok": layer.bytecode_ok}
        try:
            m = check_entry(path, verify_hashes=False, bytecode_ok=layer.bytecode_ok)
            rows.append({"name": m.get("name"), "op": m.get("op"), "arch": m.get("arch"), "key": m["key"],
                         "identity": m.get("identity"), "created": m.get("created"), **where,
                         "toolchain": m.get("toolchain"), "spec": m.get("spec")})
        except CacheCorruption as e:
            rows.append({"name": "?", "key": path.name, **where, "error": str(e)})
    return rows


def cmd_list(args) -> int:
    """`dsagen list [--json]`: every entry of every cache layer."""
    from .store.store import CacheStore

    rows = _entry_rows(CacheStore.from_env())
    if args.json:
        for r in rows:
            r.pop("bytecode_ok", None)
        print(json.dumps(rows, indent=1, allow_nan=False))
    else:
        for r in rows:
            r["key"] = r["key"][:12]
            r["created"] = (r.get("created") or "")[:10]
        print(_table(rows, ["name", "arch", "key", "created", "source"], shrink=("name", "source"))
              if rows else "(cache is empty)")
    return 0


def cmd_show(args) -> int:
    """`dsagen show KEY|NAME|OP`: the manifest of the matching entry (a JSON list of manifests when several match,
    e.g. every entry of an op); 1 when none matches or one is invalid."""
    from .spec import spec_types
    from .store.store import CacheCorruption, CacheStore, check_entry

    what = args.what
    if not what:
        raise ConfigError("dsagen show: give a key prefix, a kernel name or an op name")
    store = CacheStore.from_env()
    hits = [r for r in _entry_rows(store)
            if r["key"].startswith(what) or r.get("name") == what or r.get("op") == what]
    if not hits:
        known = f" ({what!r} is an op; the cache holds none of its kernels)" if what in spec_types() else ""
        print(f"dsagen: no cache entry whose key starts with, or whose name or op is, {what!r}{known}; "
              f"`dsagen list` shows the entries", file=sys.stderr)
        return 1
    manifests, bad = [], 0
    for r in hits:
        try:  # the checked manifest, read without following links
            manifests.append(check_entry(Path(r["path"]), verify_hashes=False, bytecode_ok=r["bytecode_ok"]))
        except CacheCorruption as e:
            bad += 1
            print(f"dsagen: invalid entry: {_printable(e)}", file=sys.stderr)
    if manifests:
        print(json.dumps(manifests[0] if len(hits) == 1 else manifests, indent=1))
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """`dsagen verify`: recompute every artifact hash; 1 on any mismatch."""
    from .store.store import CacheCorruption, CacheStore, check_entry

    from .store.pack import CHECKSUMS, checksums_problems

    store = CacheStore.from_env()
    bad = n = sums_bad = 0
    for layer, path in store.entries():
        n += 1
        try:
            check_entry(path, verify_hashes=True, bytecode_ok=layer.bytecode_ok)
        except CacheCorruption as e:
            bad += 1
            print(f"MISMATCH {_printable(e)}")
    for layer in store.layers:  # a kernel wheel's tree is also exactly its checksum list
        if layer.wheel is None:
            continue
        try:
            sums = json.loads((layer.root / CHECKSUMS).read_bytes())
        except (OSError, ValueError) as e:
            problems = [f"{layer.root / CHECKSUMS}: unreadable ({e})"]
        else:
            problems = checksums_problems(layer.root, sums, bytecode_ok=True)
        for p in problems:
            sums_bad += 1
            print(_printable(f"MISMATCH {layer.origin}: {p}"))
    misfiled = _print_misfiled(store)
    print(f"verified {n} entr{'y' if n == 1 else 'ies'}: {n - bad} ok, {bad} bad"
          + (f"; {sums_bad} kernel-wheel checksum problem(s)" if sums_bad else "")
          + (f"; {misfiled} misfiled folder(s)" if misfiled else ""))
    return 1 if bad or sums_bad or misfiled else 0


def _print_misfiled(store) -> int:
    """Print each folder of every layer that holds an entry where lookups never look (a key under another key's
    shard, an entry below a badly named folder): such a kernel counts as missing, and prune deletes it.
    Returns how many there are."""
    n = 0
    for layer in store.layers:
        for p in layer.misfiled():
            n += 1
            print(_printable(f"MISFILED {layer.origin}: {p} (not where lookups look: "
                             f"v1/<arch>/<op>/<key[:2]>/<key>; dsagen prune removes it)"))
    return n


def cmd_prune(args) -> int:
    """`dsagen prune [--all]`: remove leftovers, quarantine, stale and corrupt entries."""
    from .store.store import CacheStore
    from .jit.toolchain import GENERATOR_VERSION, dsl_available, toolchain_versions

    store = CacheStore.from_env()
    keep_tc = toolchain_versions() if dsl_available() and not args.all else None
    removed = store.prune(everything=args.all, keep_toolchain=keep_tc,
                          keep_generator=None if args.all else GENERATOR_VERSION)
    for p in removed:
        print(f"removed {_printable(p)}")
    for p, why in removed.failed:
        print(_printable(f"dsagen: could not remove {p}: {why}"), file=sys.stderr)
    print(f"pruned {len(removed)} item(s) from {_printable(store.writable.root) if store.writable else '(none)'}"
          + (f"; {len(removed.failed)} could not be removed" if removed.failed else ""))
    return 1 if removed.failed else 0


def _split_arches(values: Iterable[str]) -> list[str]:
    """--arch values (repeatable, each may be comma-separated) as known arch names, in order, without
    duplicates; SpecError naming the known ones for an unknown arch."""
    from .spec import get_arch

    arches = list(dict.fromkeys(a.strip() for v in values for a in v.split(",") if a.strip()))
    for a in arches:
        get_arch(a)
    return arches


def pack_selection(ops: Iterable[str] = (), arches: Iterable[str] = (), presets: Iterable[str] = (),
              models: Iterable[str] = (), tp: int = 1, serving: bool = False):
    """The pack.Selection of `dsagen pack`'s options: --op, --arch, --preset, --model (with --tp and --serving). The
    kernels of a preset or model are those `dsagen build` builds for it (`get_preset`, `specs_for_model`) on every
    given arch, or on every known arch when none is given; the options intersect."""
    from .spec import ARCHES, get_preset
    from .spec.model_config import load_model_config, specs_for_model
    from .store.pack import Selection

    ops, presets, models = list(dict.fromkeys(ops)), list(dict.fromkeys(presets)), list(dict.fromkeys(models))
    arch_list = _split_arches(arches)
    if tp != 1 and not models:
        raise ConfigError(f"--tp {tp}: only --model configs are split over GPUs; give --model")
    if serving and not (presets or models):
        raise ConfigError("--serving selects among the kernels of a --preset or --model; give one")
    spec_set = None
    if presets or models:
        targets = arch_list or sorted(ARCHES)
        loaded = [load_model_config(path, tp) for path in models]
        spec_set = frozenset(s.canonical_json() for a in targets for s in
                             [x for name in presets for x in get_preset(name, a, serving)]
                             + [x for model in loaded for x in specs_for_model(model, a, serving)])
    words = ([f"--preset {n}" for n in presets] + [f"--model {m}" for m in models]
             + ([f"--tp {tp}"] if tp != 1 else []) + (["--serving"] if serving else [])
             + [f"--op {o}" for o in ops] + [f"--arch {a}" for a in arch_list])
    return Selection(frozenset(ops) if ops else None, frozenset(arch_list) if arch_list else None, spec_set,
                     " ".join(words))


def _pack_selection(args):
    """The pack.Selection of `dsagen pack`'s --preset, --model (--tp), --op and --arch options (resolved here, in
    the command line: the store knows entries, never specs or presets)."""
    return pack_selection(ops=args.op or (), arches=args.arch or (), presets=args.preset or (),
                          models=args.model or (), tp=args.tp, serving=args.serving)


def cmd_pack(args) -> int:
    """`dsagen pack --out F`: the selected entries into one checksummed tar, compressed as F's suffix says; with
    --wheel, a kernel wheel in the folder --out."""
    from .store.pack import pack
    from .store.store import CacheStore

    if not args.wheel and (args.name is not None or args.wheel_version is not None):
        raise ConfigError("--name and --wheel-version go with --wheel")
    select = _pack_selection(args)
    if args.wheel:
        from .store.wheel import DEFAULT_NAME, write_wheel

        path, n = write_wheel(CacheStore.from_env(), Path(args.out), args.name or DEFAULT_NAME, args.wheel_version,
                              select=select, keep_ptx=args.keep_ptx)
        print(f"packed {n} entr{'y' if n == 1 else 'ies'} into {_printable(path)}\n"
              f"install it with: pip install {_printable(path)}")
        return 0
    out = Path(args.out)
    if not out.name or out.name in (".", "..") or out.is_dir():
        raise ConfigError(f"--out {args.out!r}: give a file name for the pack")
    n = pack(CacheStore.from_env(), out, select=select, keep_ptx=args.keep_ptx)
    print(f"packed {n} entr{'y' if n == 1 else 'ies'} into {_printable(args.out)}")
    return 0


def cmd_unpack(args) -> int:
    """`dsagen unpack F`: verify a pack and add its entries to the writable cache; entries whose key the cache
    already holds are kept and counted apart."""
    from .store.pack import unpack_report
    from .store.store import CacheStore

    import tarfile

    try:
        added, present = unpack_report(CacheStore.from_env(), Path(args.file))
    except tarfile.TarError as e:
        raise DsagenError(f"{args.file}: not a dsagen pack (not a readable tar file)") from e
    print(f"unpacked {added} entr{'y' if added == 1 else 'ies'} into {_printable(env.CACHE_DIR.get())}"
          f"; {present} already present")
    return 0


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def cmd_env(args) -> int:
    """`dsagen env [--json]`: dsagen's version, every environment variable (raw and effective value), the cache
    layers, the toolchain, torch and CUDA."""
    from .jit.toolchain import toolchain_versions
    from .store.store import CacheStore

    variables = []
    for var in env.ALL:
        try:
            value, valid = _jsonable(var.get()), True
        except ValueError as e:
            value, valid = f"INVALID: {e}", False
        variables.append({"variable": var.name, "value": os.environ.get(var.name), "effective": value,
                          "valid": valid, "meaning": var.doc})
    try:
        layers = [{"root": str(la.root), "source": la.origin, "writable": la.writable}
                  for la in CacheStore.from_env().layers]
    except (DsagenError, OSError) as e:
        layers = [{"root": f"INVALID: {e}", "source": "", "writable": False}]
    info = {"version": __version__, "python": sys.version.split()[0], "variables": variables, "layers": layers,
            "toolchain": toolchain_versions(), "torch": None, "cuda": None, "devices": 0,
            "gpu_status": "no CUDA device", "gpus": [], "driver": None, "driver_version": None, "driver_ok": None}

    def add_torch() -> None:  # imported last: torch is slow to import and may warn on stderr
        import warnings

        try:
            with warnings.catch_warnings():  # torch without numpy warns at import; irrelevant to dsagen
                warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
                import torch
        except ImportError:  # pragma: no cover - torch is a dependency; a broken install still prints the rest
            return
        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
        info["devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info.update(_gpu_info(torch, info["devices"]))

    if args.json:
        add_torch()
        print(json.dumps(info, indent=1))
        return 0
    import textwrap

    rows = [dict(v, value="(unset)" if v["value"] is None else v["value"],
                 effective=v["effective"] if v["valid"] else "INVALID (below)") for v in variables]
    print(f"dsagen {__version__} (Python {info['python']})\n")
    print(_table(rows, ["variable", "value", "effective", "meaning"], shrink=("meaning", "effective", "value")))
    for v in variables:
        if not v["valid"]:
            print(textwrap.fill(_printable(v["effective"]), WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    print()
    print(_table(layers, ["source", "writable", "root"], shrink=("root", "source")))
    tc = ", ".join(f"{d} {v}" for d, v in info["toolchain"].items()) or "CuTe-DSL not installed (runtime only)"
    print("\n" + textwrap.fill(f"toolchain: {tc}", WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    sys.stdout.flush()
    add_torch()
    if info["torch"] is not None:
        cuda = f"{info['cuda']}, {info['devices']} device(s)" if info["devices"] else "no"
        print(f"torch {info['torch']}; CUDA: {cuda}")
        _print_gpus(info)
    return 0


def _gpu_info(torch, count: int) -> dict:
    """`dsagen env`'s GPU fields: each device's name, compute capability and dsagen arch ("gpus"), and the
    driver's CUDA version ("driver", e.g. "13.0", with "driver_ok": whether it loads dsagen's cubins)."""
    from .runtime.driver import MIN_DRIVER_VERSION, CudaDriverError, driver_version, version_text
    from .spec.arch import arch_for_capability

    gpus = []
    for i in range(count):
        cap = tuple(torch.cuda.get_device_capability(i))
        try:
            arch = arch_for_capability(cap).name
        except (DsagenError, LookupError, ValueError):  # a GPU dsagen has no target for
            arch = None
        gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{cap[0]}.{cap[1]}",
                     "arch": arch})
    if not count:
        return {"gpu_status": "no CUDA device", "gpus": gpus, "driver": None, "driver_version": None,
                "driver_ok": None}
    status = f"{count} CUDA device(s)"
    try:
        version = driver_version()
    except (CudaDriverError, ImportError) as e:
        return {"gpu_status": status, "gpus": gpus, "driver": f"unknown ({e})", "driver_version": None,
                "driver_ok": None}
    return {"gpu_status": status, "gpus": gpus, "driver": version_text(version), "driver_version": version,
            "driver_ok": version >= MIN_DRIVER_VERSION}


def _print_gpus(info: dict) -> None:
    """The GPU lines of `dsagen env`: "no CUDA device", or the driver and one line per device."""
    from .runtime.driver import MIN_DRIVER_RELEASE, MIN_DRIVER_VERSION, version_text

    if not info["gpus"]:
        print(f"GPUs: {info['gpu_status']}")
        return
    need = "" if info["driver_ok"] is not False else (
        f" -- TOO OLD: dsagen's cubins need CUDA {version_text(MIN_DRIVER_VERSION)} (NVIDIA driver >= "
        f"{MIN_DRIVER_RELEASE})")
    print(_printable(f"CUDA driver: {info['driver']}{need}"))
    rows = [dict(g, arch=g["arch"] or "(none)") for g in info["gpus"]]
    print(_table(rows, ["index", "name", "capability", "arch"], shrink=("name",)))


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
    except Exception as e:
        _raise_if_no_cuda(args.which, e)
        raise  # with CUDA, a failing benchmark is a bug to see in full
    finally:
        sys.path.remove(str(target.parent))
    return 0


def _raise_if_no_cuda(which: str, e: Exception) -> None:
    """ConfigError (one line; the traceback with --debug) when benchmark `which` failed with `e` on a machine where
    torch sees no CUDA device: most benchmarks time GPU kernels, and the traceback of their first CUDA call says
    less than this. A CPU-only benchmark (cold_jit) runs as usual and never gets here unless it fails."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"benchmark {which!r} needs a CUDA device, and torch sees none "
                          f"(torch {torch.__version__}; it failed with {type(e).__name__}: {e})") from e


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that help, version and usage text that cannot be written is an error: argparse
    ignores a failed write (and sends help to stderr when stdout is closed), so `dsagen --help > /dev/full` would
    exit 0 with its output lost."""

    def _print_message(self, message: str, file=None) -> None:
        if not message:
            return
        if file is None and sys.stdout is None:  # argparse passes sys.stdout, None when it is closed
            raise ConfigError("standard output is closed")
        (file or sys.stderr).write(message)


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand; `--debug` goes before or after the subcommand."""
    debug_help = "print the traceback of an error instead of one line (also DSAGEN_DEBUG=1)"
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="dsagen", formatter_class=raw,
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()),
        epilog=_refill(_SPEC_FORMAT) + "\n`dsagen COMMAND --help` describes a command; python -m dsagen is the same program.\n"
               "Logging: DSAGEN_LOG_LEVEL=INFO (or DEBUG) logs builds, compiles, cache hits and loads to stderr.")
    p.add_argument("--version", action="version", version=f"dsagen {__version__}",
                   help="print dsagen's version and exit")
    p.add_argument("--debug", action="store_true", help=debug_help)
    common = argparse.ArgumentParser(add_help=False)  # SUPPRESS: a subcommand does not reset the flag
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="one of:")

    def add(name: str, help: str, **kw) -> argparse.ArgumentParser:
        if "epilog" in kw:
            kw["epilog"] = _refill(kw["epilog"])
        return sub.add_parser(name, parents=[common], help=help, description=_refill(help[0].upper() + help[1:] + "."),
                              formatter_class=raw, **kw)

    b = add("build", "generate and compile kernels into the writable cache",
            epilog=_refill(_EPILOG_BUILD_TAIL) + "\n" + _refill(_SPEC_FORMAT) + _ops_help())
    b.add_argument("--preset", action="append", metavar="NAME",
                   help="a model preset (repeatable): " + ", ".join(_preset_names()))
    b.add_argument("--model", action="append", metavar="CONFIG.json",
                   help="a Hugging Face-style config.json of a DeepSeek sparse-attention model (repeatable)")
    b.add_argument("--tp", type=int, default=1, metavar="N",
                   help="with --model: N GPUs split the sparse MLA's query heads (default 1)")
    b.add_argument("--serving", action="store_true",
                   help="with --preset / --model: only the kernels a serving deployment runs (the forward ops; no "
                        "backward, score recompute or dense warm-up kernels)")
    b.add_argument("--spec", action="append", metavar="JSON", help="one spec as JSON (repeatable; format below)")
    b.add_argument("--spec-file", action="append", metavar="FILE",
                   help="a JSON file with one spec or a list of specs (repeatable)")
    b.add_argument("--arch", help="comma-separated targets (default $DSAGEN_ARCH or sm_90a); re-targets "
                                  "--spec / --spec-file specs (see below)")
    b.add_argument("--jobs", "-j", type=_positive_int, metavar="N",
                   help="parallel compile processes, >= 1 (default: CPU count)")
    b.add_argument("--dry-run", action="store_true",
                   help="list what would be built and what is already cached; compile nothing")
    b.add_argument("--check", action="store_true",
                   help="a deploy gate: list every kernel the cache lacks and exit 1 if any; compile nothing")
    b.set_defaults(fn=cmd_build)
    l_ = add("list", "list the entries of every cache layer and where each comes from")
    l_.add_argument("--json", action="store_true", help="one JSON object per entry (layer, path, spec, toolchain)")
    l_.set_defaults(fn=cmd_list)
    s = add("show", "print the manifest of an entry, or a JSON list of those of every entry that matches",
            epilog="WHAT is a key prefix, a kernel name (as `dsagen list` prints it) or an op name "
                   "(every entry of that op). Exit 1 when nothing matches.")
    s.add_argument("what", metavar="WHAT", help="a key prefix, a kernel name or an op name")
    s.set_defaults(fn=cmd_show)
    add("verify", "recompute every artifact hash of every layer (and every kernel wheel's checksum list) and "
                  "find entries filed where lookups never look; exit 1 on any mismatch or misfiled entry"
        ).set_defaults(fn=cmd_verify)
    pr = add("prune", "remove leftovers, quarantine, and stale or corrupt entries of the writable cache")
    pr.add_argument("--all", action="store_true", help="remove every entry of the writable cache")
    pr.set_defaults(fn=cmd_prune)
    pk = add("pack", "write the cache's entries into a checksummed tar, or a pip-installable kernel wheel",
             epilog="The entries are every valid entry of DSAGEN_CACHE_DIR and DSAGEN_CACHE_PATH (those of "
                    "installed kernel wheels are not shipped again); --preset, --model, --op and --arch narrow "
                    "them (the options intersect; a selection that matches nothing is an error). kernel.ptx is "
                    "left out unless --keep-ptx (the runtime reads only the cubin).\n\nThe tar's compression "
                    "follows --out's suffix: .tar.gz or .tgz (gzip), .tar.xz (xz), .tar.bz2 (bzip2), .tar "
                    "(none).\n\nWith --wheel, --out is a folder and the "
                    "file is NAME-VERSION-py3-none-any.whl; once it is pip-installed, dsagen finds its\n"
                    "kernels with no environment variable (the dsagen.caches entry point) and `dsagen list` "
                    "shows them (DSAGEN_WHEEL_CACHES=0 ignores them).")
    pk.add_argument("--out", required=True, metavar="PATH",
                    help="the tar file to write (.tar, .tar.gz, .tgz, .tar.xz or .tar.bz2); with --wheel, the "
                         "folder that receives the wheel")
    pk.add_argument("--wheel", action="store_true", help="write a pip-installable wheel instead of a tar")
    pk.add_argument("--preset", action="append", metavar="NAME",
                    help="only the kernels of a model preset (repeatable): " + ", ".join(_preset_names()))
    pk.add_argument("--model", action="append", metavar="CONFIG.json",
                    help="only the kernels `dsagen build --model CONFIG.json` builds (repeatable)")
    pk.add_argument("--tp", type=int, default=1, metavar="N", help="with --model: as dsagen build --tp (default 1)")
    pk.add_argument("--serving", action="store_true",
                    help="with --preset / --model: only the kernels dsagen build --serving builds for them")
    pk.add_argument("--op", action="append", metavar="OP", help="only the entries of this op (repeatable)")
    pk.add_argument("--arch", action="append", metavar="ARCH",
                    help="only the entries for this arch (repeatable, or comma-separated); with --preset or "
                         "--model, the arches whose kernels they select (default: every arch)")
    pk.add_argument("--keep-ptx", action="store_true", help="also ship each entry's kernel.ptx")
    pk.add_argument("--name", metavar="NAME", help="with --wheel: the wheel's distribution name "
                                                  "(default dsagen-kernels; its package is NAME with '_')")
    pk.add_argument("--wheel-version", metavar="VERSION",
                    help="with --wheel: its PEP 440 version (default: dsagen's release + .post and a number "
                         "derived from the kernels' checksums, e.g. 0.1.0.post305419896)")
    pk.set_defaults(fn=cmd_pack)
    up = add("unpack", "verify a pack and add its entries to the writable cache")
    up.add_argument("file", metavar="FILE", help="a pack written by dsagen pack (plain or compressed tar)")
    up.set_defaults(fn=cmd_unpack)
    en = add("env", "show dsagen's version, configuration, cache layers and toolchain")
    en.add_argument("--json", action="store_true", help="the same as one JSON object")
    en.set_defaults(fn=cmd_env)
    be = add("bench", "run a benchmark from bench/ (e.g. overhead, indexer)")
    be.add_argument("which", metavar="NAME", help="the benchmark: bench/NAME.py")
    be.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the benchmark")
    be.set_defaults(fn=cmd_bench)
    return p


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of processes), else a usage error that quotes the value."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (>= 1), got {text}")
    return n


def _preset_names() -> list[str]:
    from .spec import preset_names

    return preset_names()


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so that the interpreter's final flush cannot
    fail again (the recipe of Python's signal module documentation)."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _settle_stdout() -> None:
    """After an error: flush what the command printed; where stdout cannot take it (a full disk, a closed pipe), drop
    it, so that the interpreter's final flush does not fail again (which prints a warning and exits 120)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (OSError, ValueError):
        _quiet_stdout()


@contextlib.contextmanager
def _unencodable_escaped():
    """stdout and stderr write what their encoding cannot (a strict UTF-8 stdout and a path with surrogate escapes,
    say) as backslash escapes instead of raising UnicodeEncodeError after the work is done; restored afterwards,
    for a program that calls main()."""
    saved = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        with contextlib.suppress(Exception):  # not a TextIOWrapper (a test's capture), or a broken stream
            stream.reconfigure(errors="backslashreplace")
            saved.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in saved:
            with contextlib.suppress(Exception):
                stream.reconfigure(errors=errors)


def _parse(argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status where argparse ends the command: 2 after a usage error (printed on
    stderr), 0 after --help or --version, whose output is flushed here so that output that is lost (a closed
    pipe, a full disk) raises OSError instead of exiting 0."""
    try:
        return make_parser().parse_args(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if code == 0 and sys.stdout is not None:
        sys.stdout.flush()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the `dsagen` command line on `argv` (default sys.argv[1:]); returns the exit status.

    0 success; 1 a command's own failure (a kernel not built, a hash mismatch, no such entry); 2 a
    usage, configuration, cache, pack or spec error (dsagen.DsagenError, OSError), printed as one line
    `dsagen: error: ...` (with --debug or DSAGEN_DEBUG=1: the traceback); 130 / 143 after Ctrl-C /
    SIGTERM. A closed stdout (`dsagen list | head -1`, `dsagen --help | true`) ends the command quietly
    with status 1; output that cannot be written otherwise (a full disk) is an error, status 2, --help
    and --version included. Names and paths are printed with non-printable characters escaped (`_printable`).
    """
    with _unencodable_escaped():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    debug = False
    try:
        args = _parse(argv)
        if isinstance(args, int):
            return args
        debug = args.debug
        if sys.stdout is None:  # started with stdout closed (`dsagen list >&-`): nowhere to print results
            raise ConfigError("standard output is closed")
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
    except _Terminated as e:
        print("dsagen: terminated", file=sys.stderr)
        return e.code
    except (DsagenError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"dsagen: error: {_printable(_one_line(e))}", file=sys.stderr)
        _settle_stdout()
        return 2

if __name__ == "__main__":
    sys.exit(main())
