"""Signature-keyed fast path of eager fused calls: validation and launch planning once per argument signature.

A public op's eager call spends most of its host time before the first launch on work that follows from the
arguments' signature alone: the checks of shapes, dtypes, strides, devices and alignment, and the launch plan
(kernels, grid, scalar arguments). On the H200's host that is 50-150 us per call (more right after a sync), which an
isolated call's GPU waits for. An op that reads no argument's values on the host can instead, once a call of a
signature has passed the full path, keep a plan for that signature and run later calls of it by the plan: same
kernels, same arguments, same outputs, only the per-call pointers change.

`call_signature(*args)` is the key: per tensor its type, shape, strides, dtype, device, requires_grad and base
address modulo 16 (the TMA rule), per other argument its type and value; plus whether autograd is recording. A call
whose key matches a stored one therefore passes exactly the checks the stored call passed. `FastPaths` holds an op's
plans (the most recent `capacity` signatures). Only eager calls on real tensors use it (`eager_call`): under
torch.compile, torch.export or fake tensors the ops take their full path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: plans kept per op (a model calls an op with a few signatures: one per layer shape, prefill and decode)
DEFAULT_CAPACITY = 64


_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled


def call_signature(*args: Any) -> tuple | None:
    """A key of `args` for which the public ops' checks give the same answer, or None when a tensor argument has no
    such key (a tensor without strides or storage): such a call takes the full path. The key may be unhashable (an
    argument that is a list, say); FastPaths then keeps and finds no plan for it. One pass, no hashing here: the
    plan table's lookup hashes the key once (this runs on every eager call).

    The key is flat (no tuple per argument; 10% faster to build and hash than nested tuples): per tensor its 7 fields
    starting with its class, per None a None, per other argument its class and value. Each argument's first element
    tells how many follow (a tensor class 6, None 0, any other class 1), so two argument lists of one op never
    share a key."""
    key = [_grad_enabled()]
    append, extend = key.append, key.extend
    try:
        for a in args:
            if a is None:
                append(None)
            elif isinstance(a, _Tensor):
                extend((a.__class__, a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.data_ptr() & 15))
            else:
                extend((a.__class__, a))
    except (RuntimeError, NotImplementedError):
        return None
    return tuple(key)


def eager_call(t: torch.Tensor) -> bool:
    """Whether a call whose first tensor is `t` may use a fast path: a plain tensor (not a fake, functional or other
    subclass) outside torch.compile / export tracing."""
    return type(t) is torch.Tensor and not torch.compiler.is_compiling()


class FastPaths:
    """One op's plans by call signature: `get(key)` the plan or None, `put(key, plan)` after a full-path call
    succeeded (the oldest plan is dropped beyond `capacity`)."""

    def __init__(self, op: str, capacity: int = DEFAULT_CAPACITY):
        self.op = op
        self.capacity = capacity
        self._plans: dict[tuple, Callable] = {}

    def get(self, key: tuple | None) -> Callable | None:
        try:
            return self._plans.get(key)         # None is never stored
        except TypeError:                       # an unhashable key: no plan
            return None

    def put(self, key: tuple | None, plan: Callable) -> None:
        if key is None:
            return
        try:
            if key not in self._plans and len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)), None)
            self._plans[key] = plan
        except TypeError:                       # an unhashable key: nothing kept
            pass

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
