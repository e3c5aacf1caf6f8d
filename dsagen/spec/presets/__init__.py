"""Model presets: the set of kernel specs a model needs, one small module per model.

A preset module defines `NAME` (the CLI name), `DESCRIPTION` and `specs(arch: str, serving: bool = False) ->
list[KernelSpec]` (serving: only the forward ops' kernels a serving deployment runs, as
model_config.specs_for_model).
Adding a model is adding a module here; it is found by name, nothing else to register.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..arch import get_arch
from ..base import KernelSpec, SpecError


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


def _module(name: str) -> ModuleType:
    mods = _modules()
    if name not in mods:
        raise SpecError(f"unknown preset {name!r}; known: {', '.join(sorted(mods))}")
    return mods[name]


def get_preset(name: str, arch: str, serving: bool = False) -> list[KernelSpec]:
    """The validated specs of preset `name` for `arch` (serving: only those a serving deployment runs).

    Raises SpecError (a ValueError) for an unknown preset (naming the known ones) or arch. The list
    may lack ops that have no kernel for `arch` yet; `missing_ops` names them.
    """
    mod = _module(name)
    get_arch(arch)
    return [s.check() for s in mod.specs(arch, serving)]


def missing_ops(name: str, arch: str, serving: bool = False) -> list[str]:
    """The ops preset `name` has kernels for on some arch but not on `arch`, sorted ([] when none); `serving` as
    for get_preset."""
    from ..arch import ARCHES

    mod = _module(name)
    get_arch(arch)
    everywhere = {s.op for a in ARCHES for s in mod.specs(a, serving)}
    return sorted(everywhere - {s.op for s in mod.specs(arch, serving)})


def preset_description(name: str) -> str:
    """The one-line description of preset `name`."""
    return _modules()[name].DESCRIPTION
