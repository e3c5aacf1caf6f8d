"""The built-in kernel spec families, one module per op family. Importing this package imports every
module in it, which registers each family (see dsagen.spec.base.register_spec): adding a family is
adding a module here."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

from .indices import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec  # noqa: E402

__all__ = ["CompactifySpec", "LocalToGlobalSpec", "RuntimeProbeSpec"]
