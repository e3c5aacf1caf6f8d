"""Fused dsagen.quantize_kv_fp8 / dsagen.dequantize_kv_fp8 (after the public ops' checks): one launch of the codec
kernel (codec_sm90.py) over the tokens, byte for byte the references' result. Under torch.compile each is the opaque
custom op `dsagen::kv_fp8_quantize_fused` / `dsagen::kv_fp8_dequantize_fused`."""

from __future__ import annotations

import torch

from ...jit import get_kernel
from ...reference.kv_cache import KV_DIM, KV_FP8_TOKEN_BYTES
from ...runtime import LoadedKernel, device_arch, device_index
from ..lightning_indexer.host import eager
from .spec import KvFp8CodecSpec

ROW_BYTES = KV_FP8_TOKEN_BYTES
_MAX_GRID_X = 2**31 - 1
_WARPS = 4
_kernels: dict[tuple, LoadedKernel] = {}


def _kernel(device: torch.device, dequantize: bool) -> LoadedKernel:
    """The codec kernel on `device`, memoized; NotImplementedError off sm_90a."""
    index = device_index(device)
    k = _kernels.get((index, dequantize))
    if k is None:
        arch = device_arch(index)
        if arch != "sm_90a":
            raise NotImplementedError(f"the fused FP8 KV cache codec has kernels for sm_90a (Hopper) only; "
                                      f"cuda:{index} is {arch}. Use impl='reference'.")
        k = _kernels[(index, dequantize)] = get_kernel(KvFp8CodecSpec(arch=arch, dequantize=dequantize), index)
    return k


def _rows(x: torch.Tensor, width: int, unit: int) -> torch.Tensor:
    """x [..., width] as [N, width] rows the kernel reads: unit element stride, a row stride that is a multiple of
    `unit` elements (16 bytes) and a 16-byte aligned base; otherwise a contiguous copy."""
    r = x.reshape(-1, width)
    if r.stride(1) == 1 and r.stride(0) % unit == 0 and r.data_ptr() % 16 == 0:
        return r
    return r.clone(memory_format=torch.contiguous_format)


def _check_grid(n: int, op: str) -> None:
    if -(-n // _WARPS) > _MAX_GRID_X:
        raise ValueError(f"the fused {op} takes at most {_MAX_GRID_X * _WARPS} tokens, got {n}")


def _convert(x: torch.Tensor, width: int, unit: int, out_width: int, out_dtype: torch.dtype, dequantize: bool,
             op: str) -> torch.Tensor:
    """One codec launch over x [..., width] (rows as _rows makes them, `unit` elements = 16 bytes) into a new
    contiguous [..., out_width] tensor of out_dtype: the writer (dequantize False) or the reader."""
    lead = tuple(x.shape[:-1])
    rows = _rows(x, width, unit)
    n = rows.shape[0]
    _check_grid(n, op)
    out = torch.empty((n, out_width), dtype=out_dtype, device=x.device)
    if n:
        _kernel(x.device, dequantize).launch(rows, out, n, rows.stride(0))
    return out.view(*lead, out_width)


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """bf16 kv [..., 576] -> the cache bytes [..., 656] (new, contiguous)."""
    return _convert(kv, KV_DIM, 8, ROW_BYTES, torch.uint8, False, "quantize_kv_fp8")


def dequantize(cache: torch.Tensor) -> torch.Tensor:
    """The cache bytes [..., 656] (uint8 or float8_e4m3fn) -> bf16 kv [..., 576] (new, contiguous)."""
    b = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    return _convert(b, ROW_BYTES, 16, KV_DIM, torch.bfloat16, True, "dequantize_kv_fp8")


@torch.library.custom_op("dsagen::kv_fp8_quantize_fused", mutates_args=())
def _quantize_op(kv: torch.Tensor) -> torch.Tensor:
    """quantize as a custom op (opaque to torch.compile)."""
    return quantize(kv)


@_quantize_op.register_fake
def _(kv):
    return kv.new_empty((*kv.shape[:-1], ROW_BYTES), dtype=torch.uint8)


@torch.library.custom_op("dsagen::kv_fp8_dequantize_fused", mutates_args=())
def _dequantize_op(cache: torch.Tensor) -> torch.Tensor:
    """dequantize as a custom op (opaque to torch.compile)."""
    return dequantize(cache)


@_dequantize_op.register_fake
def _(cache):
    return cache.new_empty((*cache.shape[:-1], KV_DIM), dtype=torch.bfloat16)


def quantize_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """dsagen.quantize_kv_fp8(impl="fused") after its checks: eagerly one launch, under torch.compile the custom
    op."""
    return quantize(kv) if eager(kv) else _quantize_op(kv)


def dequantize_kv_fp8(cache: torch.Tensor) -> torch.Tensor:
    """dsagen.dequantize_kv_fp8(impl="fused") after its checks: eagerly one launch, under torch.compile the custom
    op."""
    return dequantize(cache) if eager(cache) else _dequantize_op(cache)
