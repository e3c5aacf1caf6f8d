"""The kernel store: content-addressed entries in layered roots, their checks, prune, pack and unpack.

It knows files, manifests and hashes, never a compiler or a template: the compiler layer (dsagen.jit)
hands it finished files and a key, the runtime is handed what it loads. See store.py for the protocol
and notes/design.md for the rules and the threat model.
"""

from .store import (CacheCorruption, CacheLockTimeout, CacheStore, Entry, Layer, check_entry, entry_identities,
                    load_entry)

__all__ = ["CacheCorruption", "CacheLockTimeout", "CacheStore", "Entry", "Layer", "check_entry", "entry_identities",
           "load_entry"]
