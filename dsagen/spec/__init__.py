"""The spec layer: frozen, validated descriptions of every kernel variant dsagen can build.

    from dsagen.spec import CompactifySpec
    spec = CompactifySpec(arch="sm_90a").check()
    spec.name()       # 'compactify_sm_90a'
    spec.canonical()  # {'op': 'compactify', 'fields': {...}}
"""

from .arch import ARCHES, Arch, arch_for_capability, get_arch
from .base import KernelSpec, SpecError, register_spec, spec_types
from .families import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec
from .presets import get_preset, missing_ops, preset_names

__all__ = [
    "ARCHES", "Arch", "arch_for_capability", "get_arch", "KernelSpec", "SpecError", "register_spec",
    "spec_types", "CompactifySpec", "LocalToGlobalSpec", "RuntimeProbeSpec", "get_preset", "missing_ops",
    "preset_names",
]
