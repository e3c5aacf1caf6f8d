"""Fused QSA forward (`dsagen.qsa_indexed_forward` / `dsagen.qsa_bitmap_forward` with impl="fused", after the public
ops' checks): the limits of the kernel, the layouts it reads, the launch. Eager calls launch directly; under
torch.compile the forwards are the opaque custom ops `dsagen::qsa_indexed_fwd_fused` and
`dsagen::qsa_bitmap_fwd_fused`."""

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


def _kernel(device: torch.device, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype,
            bitmap: bool = False) -> LoadedKernel:
    """The loaded kernel of (device, G, D, Dv, dtype, form), memoized; NotImplementedError off sm_90a."""
    index = device_index(device)
    key = (index, hq // hkv, d, dv, dtype, bitmap)
    k = _kernels.get(key)
    if k is None:
        arch = device_arch(index)
        if arch != "sm_90a":
            raise NotImplementedError(f"the fused qsa_indexed_forward has kernels for sm_90a (Hopper) only; "
                                      f"cuda:{index} is {arch}. Use impl='reference'.")
        k = _kernels[key] = get_kernel(spec_for(hq // hkv, d, dv, _DTYPES[dtype], arch, bitmap), index)
    return k


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, H, D] as the kernel reads it: unit element stride, heads D apart, a token stride that is a multiple
    of 8 elements and a 16-byte aligned base; otherwise a contiguous copy."""
    st = x.stride()
    if st[2] == 1 and (st[1] == x.shape[2] or x.shape[1] == 1) and st[0] % 8 == 0 and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New (out [T, Hq, Dv] in q's dtype, out_fp32 [T, Hq, Dv] FP32, lse [Hq, T] FP32)."""
    t, hq = q.shape[:2]
    dv = v.shape[2]
    return (torch.empty((t, hq, dv), dtype=q.dtype, device=q.device),
            torch.empty((t, hq, dv), dtype=torch.float32, device=q.device),
            torch.empty((hq, t), dtype=torch.float32, device=q.device))


def indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel (inputs checked by the public op and check_supported). Returns (out [T, Hq, Dv] in q's
    dtype, out_fp32 [T, Hq, Dv] FP32, lse [Hq, T] FP32), new tensors."""
    t, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out, out32, lse = _outputs(q, v)
    if t == 0:
        return out, out32, lse
    kernel = _kernel(q.device, hq, hkv, q.shape[2], dv, q.dtype)
    q, k, v = _rows(q), _rows(k), _rows(v)
    idx = indices if indices.stride(1) == 1 else indices.contiguous()
    kernel.launch(q, k, v, idx, out, out32, lse, t, hkv, idx.shape[1], idx.stride(0), q.stride(0), k.stride(0),
                  v.stride(0), float(scale) * math.log2(math.e))
    return out, out32, lse


@torch.library.custom_op("dsagen::qsa_indexed_fwd_fused", mutates_args=())
def _indexed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indexed_forward as a custom op (opaque to torch.compile)."""
    return indexed_forward(q, k, v, indices, scale)


@_indexed_op.register_fake
def _(q, k, v, indices, scale):
    return _fake_outputs(q, v)


def _fake_outputs(q, v):
    t, hq = q.shape[:2]
    dv = v.shape[2]
    return (q.new_empty((t, hq, dv)), q.new_empty((t, hq, dv), dtype=torch.float32),
            q.new_empty((hq, t), dtype=torch.float32))


def bitmap_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the bitmap form's kernel (inputs checked by the public op and check_supported; cu_seqlens' values are
    not read on the host: the kernel never reads a bitmap column past NB or a token outside [0, T)). Each
    sequence's first block (the cumulative ceil(len / 4) before it) comes from device ops. Returns as
    indexed_forward."""
    t, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out, out32, lse = _outputs(q, v)
    if t == 0:
        return out, out32, lse
    kernel = _kernel(q.device, hq, hkv, q.shape[2], dv, q.dtype, bitmap=True)
    q, k, v = _rows(q), _rows(k), _rows(v)
    bm = block_bitmap.view(torch.uint8) if block_bitmap.dtype == torch.bool else block_bitmap
    if bm.stride(1) != 1 and bm.shape[1] > 1:
        bm = bm.contiguous()
    if cu_seqlens is None:
        n_docs, cu = 0, torch.zeros(1, dtype=torch.int32, device=q.device)
        blk0 = cu
    else:
        cu = cu_seqlens.contiguous()
        n_docs = cu.numel() - 1
        blocks = torch.cumsum(torch.div(cu[1:] - cu[:-1] + 3, 4, rounding_mode="floor"), 0, dtype=torch.int32)
        blk0 = torch.cat([cu.new_zeros(1), blocks])
    kernel.launch(q, k, v, bm, cu, blk0, out, out32, lse, t, hkv, n_docs, bm.shape[1], bm.stride(0), q.stride(0),
                  k.stride(0), v.stride(0), float(scale) * math.log2(math.e))
    return out, out32, lse


@torch.library.custom_op("dsagen::qsa_bitmap_fwd_fused", mutates_args=())
def _bitmap_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor,
               cu_seqlens: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitmap_forward as a custom op (opaque to torch.compile)."""
    return bitmap_forward(q, k, v, block_bitmap, cu_seqlens, scale)


@_bitmap_op.register_fake
def _(q, k, v, block_bitmap, cu_seqlens, scale):
    return _fake_outputs(q, v)


def qsa_indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dsagen.qsa_indexed_forward(impl="fused") after its checks: the kernel's limits (check_supported), then the
    launch, eagerly or, under torch.compile, through the custom op. scale None: 1 / sqrt(D)."""
    check_supported(q, k, v)
    s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return _indexed_op(q, k, v, indices, s)
    return indexed_forward(q, k, v, indices, s)


def qsa_bitmap_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor, *,
                       cu_seqlens: torch.Tensor | None, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dsagen.qsa_bitmap_forward(impl="fused") after its checks: the kernel's limits (check_supported), then the
    launch, eagerly or, under torch.compile, through the custom op. scale None: 1 / sqrt(D)."""
    check_supported(q, k, v)
    s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return _bitmap_op(q, k, v, block_bitmap, cu_seqlens, s)
    return bitmap_forward(q, k, v, block_bitmap, cu_seqlens, s)
