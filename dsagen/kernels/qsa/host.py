"""Fused QSA (`dsagen.qsa_indexed_forward` / `dsagen.qsa_bitmap_forward` with impl="fused", after the public ops'
checks): the limits of the kernels, the layouts they read, the launches of the forward and of the backward (dq, then
dk / dv). Eager calls without gradients launch the forward directly; under torch.compile, or when q, k or v requires
grad, the forwards are the custom ops `dsagen::qsa_indexed_fwd_fused` / `dsagen::qsa_bitmap_fwd_fused`, whose
registered autograd runs the backward as `dsagen::qsa_indexed_bwd_fused` / `dsagen::qsa_bitmap_bwd_fused` (opaque
nodes of a compiled graph)."""

from __future__ import annotations

import math

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .spec import QSA_HEAD_DIMS, QSA_MAX_GROUP, backward_specs_for, spec_for

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
            bitmap: bool = False, part: str = "fwd") -> LoadedKernel:
    """The loaded kernel of (device, G, D, Dv, dtype, form, part), memoized; part "fwd", "dq" or "dkv";
    NotImplementedError off sm_90a."""
    index = device_index(device)
    key = (index, hq // hkv, d, dv, dtype, bitmap, part)
    k = _kernels.get(key)
    if k is None:
        arch = device_arch(index)
        if arch != "sm_90a":
            raise NotImplementedError(f"the fused qsa_indexed_forward has kernels for sm_90a (Hopper) only; "
                                      f"cuda:{index} is {arch}. Use impl='reference'.")
        g = hq // hkv
        if part == "fwd":
            spec = spec_for(g, d, dv, _DTYPES[dtype], arch, bitmap)
        else:
            spec = backward_specs_for(g, d, dv, _DTYPES[dtype], arch, bitmap)[part == "dkv"]
        k = _kernels[key] = get_kernel(spec, index)
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
    bm, cu, blk0, n_docs = _bitmap_args(q, block_bitmap, cu_seqlens)
    kernel.launch(q, k, v, bm, cu, blk0, out, out32, lse, t, hkv, n_docs, bm.shape[1], bm.stride(0), q.stride(0),
                  k.stride(0), v.stride(0), float(scale) * math.log2(math.e))
    return out, out32, lse


def _bitmap_args(q: torch.Tensor, block_bitmap: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """The bitmap form's selection as its kernels read it: (bm uint8 [T, NB] with unit column stride, cu int32,
    blk0 int32: each sequence's first block, the cumulative ceil(len / 4) before it, by device ops, n_docs; 0 and
    a single zero for one sequence)."""
    bm = block_bitmap.view(torch.uint8) if block_bitmap.dtype == torch.bool else block_bitmap
    if bm.stride(1) != 1 and bm.shape[1] > 1:
        bm = bm.contiguous()
    if cu_seqlens is None:
        cu = torch.zeros(1, dtype=torch.int32, device=q.device)
        return bm, cu, cu, 0
    cu = cu_seqlens.contiguous()
    blocks = torch.cumsum(torch.div(cu[1:] - cu[:-1] + 3, 4, rounding_mode="floor"), 0, dtype=torch.int32)
    return bm, cu, torch.cat([cu.new_zeros(1), blocks]), cu.numel() - 1


@torch.library.custom_op("dsagen::qsa_bitmap_fwd_fused", mutates_args=())
def _bitmap_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor,
               cu_seqlens: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitmap_forward as a custom op (opaque to torch.compile)."""
    return bitmap_forward(q, k, v, block_bitmap, cu_seqlens, scale)


@_bitmap_op.register_fake
def _(q, k, v, block_bitmap, cu_seqlens, scale):
    return _fake_outputs(q, v)


def check_backward(q: torch.Tensor, v: torch.Tensor, out32: torch.Tensor, lse: torch.Tensor,
                   d_out: torch.Tensor | None, d_out32: torch.Tensor | None, d_lse: torch.Tensor | None) -> None:
    """The backward's operands beside q, k, v (ValueError naming the argument), all on q's device: the forward's
    out_fp32 [T, Hq, Dv] and lse [Hq, T] in FP32, and its outputs' gradients (None: no gradient), d_out and
    d_out_fp32 [T, Hq, Dv], d_lse [Hq, T], floating point."""
    t, hq = q.shape[:2]
    rows, stats = (t, hq, v.shape[2]), (hq, t)
    for name, x, shape, fp32 in (("out_fp32", out32, rows, True), ("lse", lse, stats, True),
                                 ("d_out", d_out, rows, False), ("d_out_fp32", d_out32, rows, False),
                                 ("d_lse", d_lse, stats, False)):
        if x is None and not fp32:
            continue
        if (x is None or tuple(x.shape) != shape or x.device != q.device or not x.is_floating_point()
                or (fp32 and x.dtype != torch.float32)):
            got = "None" if x is None else f"{x.dtype} {list(x.shape)} on {x.device}"
            raise ValueError(f"{name} must be {'float32' if fp32 else 'floating point'} {list(shape)} on "
                             f"{q.device}, got {got}")


def backward_inputs(out32: torch.Tensor, d_out: torch.Tensor | None, d_out32: torch.Tensor | None,
                    d_lse: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dout in `dtype`, delta FP32 [Hq, T]) for the backward's kernels from the gradients of the forward's three
    outputs (None: no gradient): out and out_fp32 are the same values, so dO = d_out + d_out32 (summed in FP32);
    delta = sum(dO * out_fp32) per query row, minus d_lse (d lse / d s_j = P_j, so lse's gradient enters
    dS = P (dP - delta) as a shift of delta)."""
    d_o = torch.zeros_like(out32)
    if d_out is not None:
        d_o = d_o + d_out.float()
    if d_out32 is not None:
        d_o = d_o + d_out32.float()
    delta = (d_o * out32).sum(-1).transpose(0, 1)
    if d_lse is not None:
        delta = delta - d_lse.float()
    return d_o.to(dtype), delta.contiguous()


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, select: tuple, out32: torch.Tensor,
             lse: torch.Tensor, d_out: torch.Tensor | None, d_out32: torch.Tensor | None, d_lse: torch.Tensor | None,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's dtype for the forward's out_fp32 and lse and its outputs' gradients (check_backward's
    layouts; backward_inputs makes dO and delta): the dq kernel, then the dk / dv kernel, over the forward's items.
    select: (indices,) for the indexed form, (block_bitmap, cu_seqlens) for the bitmap form, whose producer makes the
    same tiles from the bitmap (no index scratch). dq is bitwise repeatable; dk and dv are summed by FP32 atomics
    into zeroed [T, Hkv, D] buffers (their low bits can change from call to call), then rounded to q's dtype."""
    check_supported(q, k, v)
    check_backward(q, v, out32, lse, d_out, d_out32, d_lse)
    dout, delta = backward_inputs(out32, d_out, d_out32, d_lse, q.dtype)
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk32 = torch.zeros((t, hkv, d), dtype=torch.float32, device=q.device)
    dv32 = torch.zeros((t, hkv, dv), dtype=torch.float32, device=q.device)
    if t:
        bitmap = len(select) == 2
        qq, kk, vv, do = _rows(q), _rows(k), _rows(v), _rows(dout)
        if bitmap:
            bm, cu, blk0, n_docs = _bitmap_args(q, *select)
            ptrs, scalars = (bm, cu, blk0), (n_docs, bm.shape[1], bm.stride(0))
        else:
            idx = select[0] if select[0].stride(1) == 1 else select[0].contiguous()
            ptrs, scalars = (idx,), (idx.shape[1], idx.stride(0))
        tail = (lse.contiguous(), delta.contiguous(), t, hkv, *scalars, qq.stride(0), kk.stride(0), vv.stride(0),
                do.stride(0), float(scale) * math.log2(math.e), float(scale))
        _kernel(q.device, hq, hkv, d, dv, q.dtype, bitmap, "dq").launch(qq, kk, vv, do, *ptrs, dq, *tail)
        _kernel(q.device, hq, hkv, d, dv, q.dtype, bitmap, "dkv").launch(qq, kk, vv, do, *ptrs, dk32, dv32, *tail)
    return dq, dk32.to(q.dtype), dv32.to(q.dtype)


def _fake_grads(q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("dsagen::qsa_indexed_bwd_fused", mutates_args=())
def _indexed_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, out_fp32: torch.Tensor,
                    lse: torch.Tensor, d_out: torch.Tensor | None, d_out_fp32: torch.Tensor | None,
                    d_lse: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexed form's backward as a custom op (the backward of dsagen::qsa_indexed_fwd_fused): (dq, dk, dv) from
    the forward's out_fp32 and lse and its outputs' gradients; dO and delta are formed inside, so a compiled step
    gives the eager bytes."""
    return backward(q, k, v, (indices,), out_fp32, lse, d_out, d_out_fp32, d_lse, scale)


@_indexed_bwd_op.register_fake
def _(q, k, v, indices, out_fp32, lse, d_out, d_out_fp32, d_lse, scale):
    return _fake_grads(q, k, v)


@torch.library.custom_op("dsagen::qsa_bitmap_bwd_fused", mutates_args=())
def _bitmap_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, out_fp32: torch.Tensor, lse: torch.Tensor,
                   d_out: torch.Tensor | None, d_out_fp32: torch.Tensor | None, d_lse: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bitmap form's backward as a custom op (the backward of dsagen::qsa_bitmap_fwd_fused), as the indexed
    form's."""
    return backward(q, k, v, (block_bitmap, cu_seqlens), out_fp32, lse, d_out, d_out_fp32, d_lse, scale)


@_bitmap_bwd_op.register_fake
def _(q, k, v, block_bitmap, cu_seqlens, out_fp32, lse, d_out, d_out_fp32, d_lse, scale):
    return _fake_grads(q, k, v)


def _setup(ctx, inputs, output):
    """Both forms: saves q, k, v, the selection (indices, or the bitmap and cu_seqlens), out_fp32 and lse."""
    ctx.save_for_backward(*inputs[:-1], output[1], output[2])
    ctx.scale = inputs[-1]


def _grad(ctx, d_out, d_out32, d_lse):
    """(dq, dk, dv, None...) through the form's backward custom op."""
    saved = ctx.saved_tensors
    q, k, v, select, out32, lse = saved[0], saved[1], saved[2], saved[3:-2], saved[-2], saved[-1]
    op = _indexed_bwd_op if len(select) == 1 else _bitmap_bwd_op
    dq, dk, dv = op(q, k, v, *select, out32, lse, d_out, d_out32, d_lse, ctx.scale)
    return (dq, dk, dv) + (None,) * (len(select) + 1)


_indexed_op.register_autograd(_grad, setup_context=_setup)
_bitmap_op.register_autograd(_grad, setup_context=_setup)


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def qsa_indexed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dsagen.qsa_indexed_forward(impl="fused") after its checks: the kernel's limits (check_supported), then the
    launch, eagerly or, under torch.compile or with gradients, through the custom op (its autograd: backward).
    scale None: 1 / sqrt(D)."""
    check_supported(q, k, v)
    s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if torch.compiler.is_compiling() or _needs_grad(q, k, v):
        return _indexed_op(q, k, v, indices, s)
    return indexed_forward(q, k, v, indices, s)


def qsa_bitmap_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_bitmap: torch.Tensor, *,
                       cu_seqlens: torch.Tensor | None, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dsagen.qsa_bitmap_forward(impl="fused") after its checks: the kernel's limits (check_supported), then the
    launch, eagerly or, under torch.compile or with gradients, through the custom op (its autograd: backward).
    scale None: 1 / sqrt(D)."""
    check_supported(q, k, v)
    s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if torch.compiler.is_compiling() or _needs_grad(q, k, v):
        return _bitmap_op(q, k, v, block_bitmap, cu_seqlens, s)
    return bitmap_forward(q, k, v, block_bitmap, cu_seqlens, s)
