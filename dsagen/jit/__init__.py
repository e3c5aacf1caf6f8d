"""The compiler layer: render a spec's CuTe-DSL module (render.py), cross-compile it and check its ABI
(build.py, abi.py), derive its cache key and identity (keys.py), find or build its store entry (resolver.py)
and load it through the runtime (loader.py: get_kernel). CuTe-DSL and jinja2 are imported only when a
kernel is rendered or compiled, and torch only when a kernel is loaded, so `dsagen build` and a
deployment running a shipped cache import only what they use.
"""

from __future__ import annotations

import importlib

from .keys import identity_of, key_material, key_of
from .resolver import KernelNotCached, build_command, resolve

_LAZY = {"get_kernel": "loader", "loaded_kernels": "loader"}

__all__ = ["identity_of", "key_material", "key_of", "get_kernel", "loaded_kernels", "KernelNotCached",
           "build_command", "resolve"]


def __getattr__(name: str):
    if name in _LAZY:
        value = globals()[name] = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
