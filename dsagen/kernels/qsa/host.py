"""Fused QSA indexed forward (`dsagen.qsa_indexed_forward(impl="fused")` after the public op's checks): the limits
of the kernel, the layouts it reads, the launch. Eager calls launch directly; under torch.compile the forward is the
opaque custom op `dsagen::qsa_indexed_fwd_fused`."""

from __future__ import annotations

import math

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .spec import QSA_HEAD_DIMS, QSA_MAX_GROUP, spec_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1
_kernels: dict[tuple, LoadedKernel] = {}


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernel's limits (ValueError naming the argument and the limit); shapes and dtypes only, so they also hold
    on fake tensors. q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] as the public op checked them."""
    if q.dtype not in _DTYPES:
        raise ValueError(f"the fused qsa_indexed_forward needs q in bfloat16 or float16, got {q.dtype} "
                         f"(use impl='reference')")
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if hq // hkv > QSA_MAX_GROUP:
        raise ValueError(f"the fused qsa_indexed_forward takes at most {QSA_MAX_GROUP} query heads per KV head, "
                         f"got Hq / Hkv = {hq} / {hkv}")
    if d not in QSA_HEAD_DIMS:
        raise ValueError(f"the fused qsa_indexed_forward supports q / k head dim D in {QSA_HEAD_DIMS}, got D={d}")
    if dv not in QSA_HEAD_DIMS:
        raise ValueError(f"the fused qsa_indexed_forward supports v head dim Dv in {QSA_HEAD_DIMS}, got Dv={dv}")
    if t * hkv > _MAX_GRID_X:
        raise ValueError(f"the fused qsa_indexed_forward runs one CTA per (token, KV head): T x Hkv = {t * hkv} "
                         f"exceeds the grid limit {_MAX_GRID_X}")


def _kernel(device: torch.device, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype) -> LoadedKernel:
    """The loaded kernel of (device, G, D, Dv, dtype), memoized; NotImplementedError off sm_90a."""
    index = device_index(device)
    key = (index, hq // hkv, d, dv, dtype)
    k = _kernels.get(key)
    if k is None:
        arch = device_arch(index)
        if arch != "sm_90a":
            raise NotImplementedError(f"the fused qsa_indexed_forward has kernels for sm_90a (Hopper) only; "
                                      f"cuda:{index} is {arch}. Use impl='reference'.")
        k = _kernels[key] = get_kernel(spec_for(hq // hkv, d, dv, _DTYPES[dtype], arch), index)
    return k


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, H, D] as the kernel reads it: unit element stride, heads D apart, a token stride that is a multiple
    of 8 elements and a 16-byte aligned base; otherwise a contiguous copy."""
    st = x.stride()
    if st[2] == 1 and (st[1] == x.shape[2] or x.shape[1] == 1) and st[0] % 8 == 0 and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel (inputs checked by the public op and check_supported). Returns (out [T, Hq, Dv] in q's
    dtype, out_fp32 [T, Hq, Dv] FP32, lse [Hq, T] FP32), new tensors."""
    t, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    out32 = torch.empty((t, hq, dv), dtype=torch.float32, device=q.device)
    lse = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, out32, lse
    kernel = _kernel(q.device, hq, hkv, q.shape[2], dv, q.dtype)
    q, k, v = _rows(q), _rows(k), _rows(v)
    idx = indices if indices.stride(1) == 1 else indices.contiguous()
    kernel.launch(q, k, v, idx, out, out32, lse, t, hkv, idx.shape[1], q.stride(0), k.stride(0), v.stride(0),
                  idx.stride(0), float(scale) * math.log2(math.e))
    return out, out32, lse


@torch.library.custom_op("dsagen::qsa_indexed_fwd_fused", mutates_args=())
def _indexed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indexed_forward as a custom op (opaque to torch.compile)."""
    return indexed_forward(q, k, v, indices, scale)


@_indexed_op.register_fake
def _(q, k, v, indices, scale):
    t, hq = q.shape[:2]
    dv = v.shape[2]
    return (q.new_empty((t, hq, dv)), q.new_empty((t, hq, dv), dtype=torch.float32),
            q.new_empty((hq, t), dtype=torch.float32))


def qsa_indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dsagen.qsa_indexed_forward(impl="fused") after its checks: the kernel's limits (check_supported), then the
    launch, eagerly or, under torch.compile, through the custom op. scale None: 1 / sqrt(D)."""
    check_supported(q, k, v)
    s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return _indexed_op(q, k, v, indices, s)
    return indexed_forward(q, k, v, indices, s)
