"""What compiles kernels here: the installed CuTe-DSL distributions (read from package metadata, without
importing the DSL)."""

from __future__ import annotations

import functools
import importlib.metadata as md

GENERATOR_VERSION = "1"  # bump when the generator's output for the same inputs changes


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    """{distribution: version} for every installed `nvidia-cutlass-dsl*` distribution; {} when the DSL
    is not installed (a deployment that only runs a shipped cache)."""
    try:
        md.version("nvidia-cutlass-dsl")  # a name lookup: cheap where hundreds of packages are installed
    except md.PackageNotFoundError:
        return {}
    out = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-cutlass-dsl"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def dsl_available() -> bool:
    """Whether CuTe-DSL is installed (kernels can be compiled in this process)."""
    return "nvidia-cutlass-dsl" in toolchain_versions()
