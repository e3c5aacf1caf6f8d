"""The spec layer: frozen, validated descriptions of every kernel variant dsagen can build.

    from dsagen.spec import CompactifySpec
    spec = CompactifySpec(arch="sm_90a").check()
    spec.name()       # 'compactify_sm_90a'
    spec.canonical()  # {'op': 'compactify', 'fields': {...}}
"""

from .arch import ARCHES, Arch, arch_for_capability, get_arch
from .base import KernelSpec, SpecError, load_families, register_spec, spec_types

load_families()  # every kernel family's spec module (dsagen/kernels/<family>/spec.py) registers its specs

# Re-exported on first use (PEP 562), not at import: a family's spec.py imports dsagen.spec.base, which runs this
# package first, and an eager `from ..kernels.indices.spec import ...` (or the presets, which import every family)
# would then meet that family's spec module half-initialised when it is the first thing a program imports.
_LAZY = {"CompactifySpec": "..kernels.indices.spec", "LocalToGlobalSpec": "..kernels.indices.spec",
         "RuntimeProbeSpec": "..kernels.testing.spec", "get_preset": ".presets", "missing_ops": ".presets",
         "preset_names": ".presets"}


def __getattr__(name: str):
    """The lazily re-exported names of `_LAZY`."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ARCHES", "Arch", "arch_for_capability", "get_arch", "KernelSpec", "SpecError", "register_spec",
    "spec_types", "CompactifySpec", "LocalToGlobalSpec", "RuntimeProbeSpec", "get_preset", "missing_ops",
    "preset_names",
]
