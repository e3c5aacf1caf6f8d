"""The spec layer: frozen, validated descriptions of every kernel variant dsagen can build.

    from dsagen.spec import CompactifySpec
    spec = CompactifySpec(arch="sm_90a").check()
    spec.name()       # 'compactify_sm_90a'
    spec.canonical()  # {'op': 'compactify', 'fields': {...}}
"""

from .arch import ARCHES, Arch, arch_for_capability, get_arch
from .base import KernelSpec, SpecError, load_families, register_spec, spec_types

load_families()  # every kernel family's spec module (dsagen/kernels/<family>/spec.py) registers its specs

from ..kernels.indices.spec import CompactifySpec, LocalToGlobalSpec  # noqa: E402
from ..kernels.testing.spec import RuntimeProbeSpec  # noqa: E402
from .presets import get_preset, missing_ops, preset_names  # noqa: E402

__all__ = [
    "ARCHES", "Arch", "arch_for_capability", "get_arch", "KernelSpec", "SpecError", "register_spec",
    "spec_types", "CompactifySpec", "LocalToGlobalSpec", "RuntimeProbeSpec", "get_preset", "missing_ops",
    "preset_names",
]
