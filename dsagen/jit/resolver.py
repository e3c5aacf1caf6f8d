"""From a spec to a cache entry: look it up in the layers, or compile it (JIT) under the per-key lock.

    entry = resolve(spec)          # Entry with manifest["kernel"] and read("kernel.cubin")

Entries are found by identity (see keys.py; computed without rendering). Where kernels may be compiled
(CuTe-DSL installed, JIT allowed) an entry must also have been built by this toolchain, which makes it
the entry of the exact key; a miss renders, compiles under the per-key lock, re-checks and commits.
Where they may not (no DSL: a deployment running a shipped cache; or DSAGEN_DISABLE_JIT=1), an entry
of any toolchain is accepted and a miss raises KernelNotCached naming the spec and the exact
`dsagen build` command.
"""

from __future__ import annotations

import functools
import shlex
import threading
import warnings
from datetime import datetime, timezone

from .. import env
from ..errors import CacheNotStored, CacheRootError, DsagenError
from ..kernel_record import kernel_record_sha256
from ..log import get_logger
from ..spec import KernelSpec
from ..store.store import (CacheCorruption, CacheLockPathError, CacheLockTimeout, CacheStore, Entry, build_dir,
                           entry_identities, load_entry)
from . import toolchain
from .keys import identity_material, identity_of, key_material, key_of
from .render import render

_log = get_logger("jit")
_memory_entries: dict[str, Entry] = {}
_memory_lock = threading.Lock()
# set while a compile runs on behalf of a lookup (get_kernel, an op's first call) rather than `dsagen build`, so
# that the compile's one INFO line says it is a lazy one: a serving process that compiles is worth noticing
_lazy = threading.local()


class KernelNotCached(DsagenError, LookupError):
    """A kernel is not in any cache layer and may not be compiled here."""


@functools.lru_cache(maxsize=4096)
def _render_cached(spec: KernelSpec) -> str:
    return render(spec)


def build_command(spec: KernelSpec) -> str:
    """The exact shell command that builds `spec` into the writable cache."""
    return f"dsagen build --spec {shlex.quote(spec.canonical_json())}"


def _manifest(spec: KernelSpec, material: dict, identity: str, compiled) -> dict:
    return {
        "schema": material["schema"],
        "identity": identity,
        "identity_material": identity_material(spec),
        "key_material": material,
        "op": spec.op,
        "name": spec.name(),
        "spec": spec.canonical(),
        "toolchain": material["toolchain"],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "compile_seconds": round(compiled.compile_seconds, 3),
        "kernel": compiled.record,
        "kernel_sha256": kernel_record_sha256(compiled.record),
    }


def compile_entry_files(spec: KernelSpec, source: str, material: dict, identity: str) -> tuple[dict, dict]:
    """Compile `spec` in a temporary folder: (files, manifest) ready to commit."""
    from .build import compile_module

    # locked while it exists (and named after this process), so that `dsagen prune`, even one in another
    # PID namespace sharing the temp folder, tells a live build's folder from a killed build's leftovers
    if getattr(_lazy, "on", False):
        _log.info("compiling %s (lazy JIT) for %s ...", spec.name(), spec.arch)
    else:
        _log.info("compiling %s for %s", spec.name(), spec.arch)
    with build_dir() as work:
        compiled = compile_module(spec, source, work)
    _log.info("compiled %s in %.2fs", spec.name(), compiled.compile_seconds)
    files = {"kernel.py": source.encode(), "kernel.cubin": compiled.cubin, "kernel.ptx": compiled.ptx.encode()}
    return files, _manifest(spec, material, identity, compiled)


def resolve(spec: KernelSpec, store: CacheStore | None = None, *, jit: bool | None = None,
            must_store: bool = False) -> Entry:
    """The cache entry of `spec`, compiling it on a miss when JIT is allowed (see module docstring).

    A kernel that is compiled but cannot be stored (lock timeout, read-only or full disk, a root that
    is not a dsagen cache, DSAGEN_CACHE=ro|off) is compiled in memory with a warning, or, with
    `must_store=True` (`dsagen build`), raises CacheNotStored. Only entries whose manifest names this
    very spec, op and arch are ever returned."""
    spec.check()
    store = store or CacheStore.from_env()
    identity = identity_of(spec)
    can_compile = toolchain.dsl_available() and (not env.DISABLE_JIT.get() if jit is None else jit)
    # identity + toolchain determine the key, so a hit needs no rendering; a process that cannot
    # compile accepts an entry of any toolchain (a shipped cache), the installed toolchain's first
    installed = toolchain.toolchain_versions()
    wanted_toolchain = installed if can_compile else None
    hit = store.lookup_identity(spec.arch, spec.op, identity, wanted_toolchain, spec=spec.canonical(),
                                prefer_toolchain=installed or None)
    if hit is not None:
        _log.debug("cache hit: %s in %s", spec.name(), hit.layer.origin if hit.layer else "memory")
        return hit
    _log.info("cache miss: %s (%s)", spec.name(), "compiling" if can_compile else "JIT not available")
    if not can_compile:
        why = ("DSAGEN_DISABLE_JIT=1" if toolchain.dsl_available()
               else "CuTe-DSL (the [gen] extra) is not installed")
        layers = ", ".join(f"{layer.root}{'' if layer.writable else ' (read-only)'}" for layer in store.layers)
        raise KernelNotCached(
            f"kernel {spec.name()} ({spec.canonical_json()}) is not in the cache "
            f"[{layers or 'no layers: DSAGEN_CACHE=off'}] and cannot be compiled here ({why}). "
            f"Build it where CuTe-DSL is installed with:\n  {build_command(spec)}\n"
            f"then ship that cache folder and point DSAGEN_CACHE_PATH at it.")
    source = _render_cached(spec)
    material = key_material(spec, source, toolchain.toolchain_versions())
    _lazy.on = not must_store  # `dsagen build` stores what it compiles (must_store); a lookup compiles lazily
    try:
        return _compile_and_commit(spec, source, material, identity, store, must_store)
    finally:
        _lazy.on = False


def _not_stored(spec: KernelSpec, why: str, must_store: bool, compiled: bool = True) -> None:
    """Raise CacheNotStored (must_store) or warn that `spec` is compiled in memory. `compiled` says whether
    the kernel was compiled before storing it failed (a lock or root problem stops the build first)."""
    if must_store:
        done = "compiled but not stored" if compiled else "not built and not stored (nothing was compiled)"
        raise CacheNotStored(f"{spec.name()}: {done}: {why}")
    warnings.warn(f"dsagen: {why}; compiling {spec.name()} in memory", stacklevel=4)


def _compile_and_commit(spec, source, material, identity, store: CacheStore, must_store: bool = False) -> Entry:
    key = key_of(material)
    expect = {"spec": spec.canonical()}
    writable = store.writable is not None and store.writable.writable
    if not writable:  # DSAGEN_CACHE=ro|off: in memory by request, so no warning
        if must_store:
            _not_stored(spec, f"the cache is not writable (DSAGEN_CACHE={store.mode})", must_store)
    else:
        compiled = False
        try:
            with store.lock(key):
                hit = store.lookup(spec.arch, spec.op, key, expect)  # another process may have built it
                if hit is not None and identity in entry_identities(hit.manifest):
                    entry = hit
                elif hit is not None and hit.layer is store.writable:
                    # same rendered source under a new identity (a template edit that changed nothing
                    # for this spec): the entry answers to both, so identity lookups find it
                    entry = store.add_identity(hit, identity)
                else:
                    files, manifest = compile_entry_files(spec, source, material, identity)
                    compiled = True
                    entry = store.commit(spec.arch, spec.op, key, files, manifest)
                if must_store and entry.path is not None:
                    load_entry(entry.path, verify_hashes=True, expect=expect, read=())  # still there, whole
                return entry
        except CacheLockTimeout as e:
            _not_stored(spec, f"timed out waiting for the compile lock ({e})", must_store, compiled)
        except CacheLockPathError as e:
            _not_stored(spec, f"cannot take the compile lock: {e}", must_store, compiled)
        except CacheRootError as e:
            _not_stored(spec, f"cannot use the cache root ({e})", must_store, compiled)
        except PermissionError as e:
            _not_stored(spec, f"cache not writable ({e})", must_store, compiled)
        except OSError as e:  # read-only or full disk
            _not_stored(spec, f"cannot write the cache ({e})", must_store, compiled)
        except CacheCorruption as e:  # the entry vanished or changed right after the commit (a prune)
            _not_stored(spec, f"the stored entry did not survive ({e})", must_store, compiled)
    with _memory_lock:
        hit = _memory_entries.get(key)
        if hit is None:
            files, manifest = compile_entry_files(spec, source, material, identity)
            manifest.update(key=key, arch=spec.arch)
            hit = _memory_entries[key] = Entry(None, manifest, None, files)
        return hit
