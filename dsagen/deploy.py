"""Before serving: find (and on a GPU, load) every kernel a model needs, failing once with the whole list.

    dsagen.preload(model="config.json")            # at server start, on the serving GPU
    dsagen.preload(specs=[CompactifySpec(arch="sm_90a")], device="cuda:1")

Without preload, a kernel that is missing from a shipped cache is found missing at the first call of the op that
needs it, mid-request, one kernel at a time. `dsagen build --check` is the same gate on the command line.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from .errors import ConfigError
from .jit.resolver import KernelNotCached, build_command, resolve


class KernelsNotCached(KernelNotCached):
    """Several kernels are missing from the cache (and cannot be compiled here); `missing` holds their specs."""

    def __init__(self, message: str, missing: list):
        super().__init__(message)
        self.missing = missing


def preload(model: str | os.PathLike | dict | None = None, specs: Iterable[Any] | None = None,
            device: Any = None, *, tensor_parallel: int = 1, serving: bool = False) -> list:
    """Resolve and load every kernel of a model (or of a list of specs) before serving.

    `model` is a Hugging Face-style config of a DeepSeek sparse-attention model: the path of its config.json or
    the parsed dict (the fields `dsagen build --model` reads; `tensor_parallel` splits the query heads as
    `--tp` does). Its kernels are those `dsagen build --model` builds, for the arch of `device` (`serving=True`:
    those of `dsagen build --model --serving`, the forward ops' kernels without the training ones). `specs` are
    kernel specs (dsagen.spec), taken as they are (their own arch). Both may be given; duplicates load once.

    With a CUDA device (`device`, default the current one), each kernel is loaded as the ops would load it
    (dsagen.jit.get_kernel: found in a cache layer, or compiled where JIT is allowed), so the first request
    finds them ready. Without one (a CPU-only machine: a deploy check, a build host), nothing is loaded and
    nothing is compiled: each kernel is only looked up, as a process that cannot compile would look it up
    (an entry of any toolchain counts), for the arches of DSAGEN_ARCH (default sm_90a).

    Returns:
        The LoadedKernel of each kernel with a CUDA device; the cache Entry of each without one.

    Raises:
        KernelsNotCached (a dsagen.jit.KernelNotCached, a LookupError): once, after every kernel was tried,
            naming each missing kernel and the `dsagen build` command that builds it.
        ConfigError (a ValueError): neither `model` nor `specs` given, or a model config dsagen cannot read.
        CudaDriverError: the CUDA driver is older than the cubins need (CUDA 13, NVIDIA driver >= 580), or a
            driver call failed while loading. KernelArchMismatch: a spec's arch does not run on the device.
    """
    if model is None and specs is None:
        raise ConfigError("dsagen.preload: give a model config (path or dict) or a list of specs")
    index = _cuda_index(device)
    arches = [_device_arch(index)] if index is not None else _default_arches()
    todo = _unique([*_model_specs(model, arches, tensor_parallel, bool(serving)), *(specs or ())])
    done, missing = [], []
    for spec in todo:
        try:
            done.append(_load(spec, index) if index is not None else _look_up(spec))
        except KernelNotCached:
            missing.append(spec)
    if missing:
        raise KernelsNotCached(_missing_message(missing, len(todo)), missing)
    return done


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index to load on, or None where torch sees no CUDA device (lookups only)."""
    import torch

    if device is not None and not isinstance(device, int) and torch.device(device).type != "cuda":
        raise ConfigError(f"dsagen.preload: device {device} is not a CUDA device")
    if not torch.cuda.is_available():
        return None
    from .runtime import device_index

    return device_index(device)


def _device_arch(index: int) -> str:
    """The arch whose cubins run on CUDA device `index` (e.g. sm_90a)."""
    from .runtime import device_arch

    return device_arch(index)


def _default_arches() -> list[str]:
    """The arches looked up without a CUDA device: DSAGEN_ARCH, else sm_90a (as `dsagen build` defaults)."""
    from . import env

    return (env.ARCH.get() or "sm_90a").split(",")


def _model_specs(model: str | os.PathLike | dict | None, arches: list[str], tensor_parallel: int,
                 serving: bool = False) -> list:
    """The specs `dsagen build --model` (with --serving: `serving`) names for `model` on each arch (none without a
    model)."""
    if model is None:
        return []
    from .spec.model_config import load_model_config, model_from_config, specs_for_model

    if isinstance(model, dict):
        attention = model_from_config(model, "dsagen.preload(model=...)", tensor_parallel)
    else:
        attention = load_model_config(model, tensor_parallel)
    return [s for arch in arches for s in specs_for_model(attention, arch, serving)]


def _unique(specs: list) -> list:
    """`specs` in order, each once."""
    return list(dict.fromkeys(specs))


def _load(spec: Any, index: int):
    """The kernel of `spec` loaded on CUDA device `index`, as the ops load it."""
    from .jit.loader import get_kernel

    return get_kernel(spec, index)


def _look_up(spec: Any):
    """The cache entry of `spec`, found without compiling (KernelNotCached on a miss)."""
    return resolve(spec, jit=False)


def _missing_message(missing: list, total: int) -> str:
    """One message for every missing kernel: its name and the command that builds it."""
    lines = [f"  {s.name()}: {build_command(s)}" for s in missing]
    return (f"{len(missing)} of {total} kernel(s) are not in the cache and cannot be compiled here; build them "
            f"where CuTe-DSL is installed, ship that cache and point DSAGEN_CACHE_PATH at it "
            f"(`dsagen build --check` lists them too):\n" + "\n".join(lines))


__all__ = ["preload", "KernelsNotCached"]
