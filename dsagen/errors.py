"""The errors dsagen raises on purpose, under one base class.

Every error that reports a user's mistake or a problem with a cache, a pack, a spec or the
environment derives from `DsagenError`, so that a caller (and the `dsagen` command line) can tell
them from bugs. Each class also derives from the builtin a caller would expect (ValueError for bad
input, LookupError for a missing kernel, ...), so existing `except ValueError` code keeps working.
"""

from __future__ import annotations


class DsagenError(Exception):
    """Base class of every error dsagen raises on purpose (bad input, cache, pack, spec, config)."""


class ConfigError(DsagenError, ValueError):
    """An environment variable or option holds a value dsagen cannot use; the message names it."""


class CacheRootError(DsagenError, ValueError):
    """A cache root that dsagen refuses to use: empty or relative path, not a dsagen cache, unsafe
    permissions."""


class CacheNotStored(DsagenError, RuntimeError):
    """A kernel could not be stored in the writable cache (read-only or full disk, lock timeout, a lock path that
    is not a file, DSAGEN_CACHE=ro|off, an entry removed under the builder), whether or not it was compiled (the
    message says which); raised where storing was required (`dsagen build`)."""
