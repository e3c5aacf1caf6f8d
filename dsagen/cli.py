"""The `dsagen` command line: build, list, show, verify, prune, pack, unpack, env, bench.

    dsagen build --preset deepseek-v3.2 --arch sm_90a     # pre-generate a model's kernels (no GPU needed)
    dsagen list [--json]                                   # what the cache layers hold
    dsagen verify                                          # recompute every hash; non-zero exit on mismatch
    dsagen pack --out kernels.tar / dsagen unpack kernels.tar
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import env


def _specs_from_args(args) -> list:
    from .spec import KernelSpec, get_preset

    specs = []
    arches = [a.strip() for a in (args.arch or env.ARCH.get() or "sm_90a").split(",") if a.strip()]
    for arch in arches:
        for name in args.preset or ():
            specs.extend(get_preset(name, arch))
    for text in args.spec or ():
        specs.append(KernelSpec.from_canonical(json.loads(text)).check())
    for path in args.spec_file or ():
        data = json.loads(Path(path).read_text())
        for d in data if isinstance(data, list) else [data]:
            specs.append(KernelSpec.from_canonical(d).check())
    for path in args.from_tests or ():
        specs.extend(required_specs_of_tests(Path(path)))
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def required_specs_of_tests(path: Path) -> list:
    """The REQUIRED_SPECS of every test module at `path` (a file, or a folder searched for test_*.py)."""
    files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
    out = []
    for f in files:
        mod_name = f"_dsagen_required_specs_{f.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, f)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(f.parent))  # test modules import their sibling helpers, as under pytest
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(f.parent))
        req = getattr(mod, "REQUIRED_SPECS", [])
        out.extend(req() if callable(req) else req)
    return [s.check() for s in out]


def _build_one(canonical: dict) -> dict:
    """Worker: resolve (compile if needed) one spec; returns a summary row."""
    from .cache import resolve
    from .cache.store import CacheStore
    from .spec import KernelSpec

    spec = KernelSpec.from_canonical(canonical)
    store = CacheStore.from_env()
    t0 = time.perf_counter()
    cached = _is_cached(spec, store)
    entry = resolve(spec, store, jit=True)
    k = entry.manifest["kernel"]
    return {"name": spec.name(), "op": spec.op, "arch": spec.arch, "key": entry.key,
            "status": "cached" if cached else "built", "seconds": round(time.perf_counter() - t0, 2),
            "regs": k.get("regcount"), "smem": k["launch"]["smem"], "path": entry.where()}


def _is_cached(spec, store) -> bool:
    """Whether resolve() would find `spec` without compiling (the same identity + toolchain lookup)."""
    from .cache.keys import identity_of
    from .gen.toolchain import toolchain_versions

    return store.lookup_identity(spec.arch, spec.op, identity_of(spec), toolchain_versions()) is not None


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def cmd_build(args) -> int:
    from .gen.toolchain import dsl_available

    if not dsl_available():
        print("dsagen build needs CuTe-DSL: pip install 'dsagen[gen]'", file=sys.stderr)
        return 2
    specs = _specs_from_args(args)
    if not specs:
        print("nothing to build: give --preset, --spec, --spec-file or --from-tests", file=sys.stderr)
        return 2
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

    with (ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) if jobs > 1
          else contextlib.nullcontext()) as pool:
        for i, (spec, row_of) in enumerate(outcomes(pool), 1):
            try:
                rows.append(row_of())
            except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
                failed.append((spec.name(), e))
                rows.append({"name": spec.name(), "op": spec.op, "arch": spec.arch, "status": "FAILED",
                             "seconds": 0})
            progress(i, rows[-1])
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
    from .cache.store import CacheCorruption, check_entry

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
    from .cache.store import CacheStore

    rows = _entry_rows(CacheStore.from_env())
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            r["key"] = r["key"][:12]
        print(_table(rows, ["name", "op", "arch", "key", "created", "layer"]) if rows else "(cache is empty)")
    return 0


def cmd_show(args) -> int:
    from .cache.store import CacheStore

    store = CacheStore.from_env()
    hits = [r for r in _entry_rows(store) if r["key"].startswith(args.what) or r.get("name") == args.what]
    if not hits:
        print(f"no cache entry whose key starts with or whose name is {args.what!r}", file=sys.stderr)
        return 1
    for r in hits:
        print(json.dumps(json.loads((Path(r["path"]) / "manifest.json").read_text()), indent=1))
    return 0


def cmd_verify(args) -> int:
    from .cache.store import CacheCorruption, CacheStore, check_entry

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
    from .cache.store import CacheStore
    from .gen.toolchain import GENERATOR_VERSION, dsl_available, toolchain_versions

    store = CacheStore.from_env()
    keep_tc = toolchain_versions() if dsl_available() and not args.all else None
    removed = store.prune(everything=args.all, keep_toolchain=keep_tc,
                          keep_generator=None if args.all else GENERATOR_VERSION)
    for p in removed:
        print(f"removed {p}")
    print(f"pruned {len(removed)} item(s) from {store.writable.root if store.writable else '(none)'}")
    return 0


def cmd_pack(args) -> int:
    from .cache.pack import pack
    from .cache.store import CacheStore

    n = pack(CacheStore.from_env(), Path(args.out))
    print(f"packed {n} entr{'y' if n == 1 else 'ies'} into {args.out}")
    return 0


def cmd_unpack(args) -> int:
    from .cache.pack import unpack
    from .cache.store import CacheStore

    n = unpack(CacheStore.from_env(), Path(args.file))
    print(f"unpacked {n} entr{'y' if n == 1 else 'ies'} into {env.CACHE_DIR.get()}")
    return 0


def cmd_env(args) -> int:
    from .gen.toolchain import toolchain_versions

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
    import runpy

    target = Path(__file__).resolve().parent.parent / "bench" / f"{args.which}.py"
    if not target.is_file():
        print(f"no benchmark {args.which!r} (looked for {target})", file=sys.stderr)
        return 2
    sys.argv = [str(target), *args.rest]
    sys.path.insert(0, str(target.parent))  # as `python bench/<name>.py` would: the benches import `common`
    try:
        runpy.run_path(str(target), run_name="__main__")
    finally:
        sys.path.remove(str(target.parent))
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsagen", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="generate and compile kernels into the writable cache")
    b.add_argument("--preset", action="append", help="a model preset (repeatable)")
    b.add_argument("--spec", action="append", help="one spec as canonical JSON (repeatable)")
    b.add_argument("--spec-file", action="append", help="a JSON file with one spec or a list of specs")
    b.add_argument("--from-tests", action="append", help="test file or folder: build their REQUIRED_SPECS")
    b.add_argument("--arch", help="comma-separated targets (default $DSAGEN_ARCH or sm_90a)")
    b.add_argument("--jobs", "-j", type=int, help="parallel compile processes (default: CPU count)")
    b.set_defaults(fn=cmd_build)
    l_ = sub.add_parser("list", help="list cache entries")
    l_.add_argument("--json", action="store_true")
    l_.set_defaults(fn=cmd_list)
    s = sub.add_parser("show", help="print the manifest of an entry (key prefix or name)")
    s.add_argument("what")
    s.set_defaults(fn=cmd_show)
    sub.add_parser("verify", help="recompute every artifact hash; exit 1 on any mismatch").set_defaults(fn=cmd_verify)
    pr = sub.add_parser("prune", help="remove leftovers, quarantine, and stale or corrupt entries")
    pr.add_argument("--all", action="store_true", help="remove every entry of the writable cache")
    pr.set_defaults(fn=cmd_prune)
    pk = sub.add_parser("pack", help="write every cache entry into a checksummed tar file")
    pk.add_argument("--out", required=True)
    pk.set_defaults(fn=cmd_pack)
    up = sub.add_parser("unpack", help="verify a pack and add its entries to the writable cache")
    up.add_argument("file")
    up.set_defaults(fn=cmd_unpack)
    sub.add_parser("env", help="show configuration and toolchain").set_defaults(fn=cmd_env)
    be = sub.add_parser("bench", help="run a benchmark from bench/ (e.g. overhead, indexer)")
    be.add_argument("which")
    be.add_argument("rest", nargs=argparse.REMAINDER)
    be.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
