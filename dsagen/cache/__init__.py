"""The content-hashed, layered kernel cache (see store.py for the protocol, keys.py for the key)."""

from .keys import identity_of, key_material, key_of
from .resolver import KernelNotCached, build_command, resolve
from .store import CacheCorruption, CacheLockTimeout, CacheStore, Entry, Layer, check_entry, load_entry

__all__ = ["identity_of", "key_material", "key_of", "KernelNotCached", "build_command", "resolve",
           "CacheCorruption", "CacheLockTimeout", "CacheStore", "Entry", "Layer", "check_entry", "load_entry"]
