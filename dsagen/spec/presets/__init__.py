"""Model presets: the set of kernel specs a model needs, one small module per model.

A preset module defines `NAME` (the CLI name), `DESCRIPTION` and `specs(arch: str) -> list[KernelSpec]`.
Adding a model is adding a module here; it is found by name, nothing else to register.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..base import KernelSpec


def _modules() -> dict[str, ModuleType]:
    out = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "specs"):
            out[mod.NAME] = mod
    return out


def preset_names() -> list[str]:
    """The names of every preset, sorted."""
    return sorted(_modules())


def get_preset(name: str, arch: str) -> list[KernelSpec]:
    """The validated specs of preset `name` for `arch`; ValueError naming the known presets otherwise."""
    mods = _modules()
    if name not in mods:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(mods))}")
    return [s.check() for s in mods[name].specs(arch)]


def preset_description(name: str) -> str:
    """The one-line description of preset `name`."""
    return _modules()[name].DESCRIPTION
