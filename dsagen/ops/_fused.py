"""Generated-kernel implementations of the public ops (`impl="fused"`).

FUSED maps an op name to "module:function" of its fused implementation. An op without an entry has no
fused kernel yet: `fused_impl` raises NotImplementedError naming the op and the arch, never falling back
to the reference silently.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

FUSED: dict[str, str] = {
    "compactify": "dsagen.kernels.indices.host:compactify",
    "local_to_global": "dsagen.kernels.indices.host:local_to_global",
    "lightning_indexer": "dsagen.kernels.lightning_indexer.host:lightning_indexer",
    "sparse_attention": "dsagen.kernels.sparse_mla.host:sparse_attention",
}


def fused_impl(op: str, device: torch.device) -> Callable:
    """The fused implementation of `op` for tensors on `device`.

    Raises NotImplementedError when no generated kernel exists for the op, ValueError when `device`
    is not a CUDA device.
    """
    if device.type != "cuda":
        raise ValueError(f"{op}: impl='fused' runs generated CUDA kernels; inputs are on {device}. "
                         f"Use impl='reference' on the CPU.")
    fn = _resolved.get(op)
    if fn is not None:
        return fn
    target = FUSED.get(op)
    if target is None:
        from ..runtime.device import device_arch

        raise NotImplementedError(f"{op}: no fused kernel exists yet for {device_arch(device)}; "
                                  f"use impl='reference'")
    mod, name = target.split(":")
    fn = _resolved[op] = getattr(importlib.import_module(mod), name)
    return fn


_resolved: dict[str, Callable] = {}
