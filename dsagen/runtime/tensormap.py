"""CUtensorMap encoding for `tensormap` kernel params (cuTensorMapEncodeTiled), cached per tensor view.

A tensormap param's recipe (from the kernel's manifest) fixes dtype, box, element strides, interleave,
swizzle, L2 promotion and OOB fill. The op passes a torch tensor whose dims, innermost first, are the
TMA dims: globalDim = reversed(shape), globalStrides = reversed(stride[:-1]) * element size, stride(-1) == 1.
"""

from __future__ import annotations

import ctypes

import torch

from .driver import check, cu

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "uint8": torch.uint8, "int32": torch.int32}


def _enums(d):
    return {
        "dtype": {"float32": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                  "float16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                  "bfloat16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                  "uint8": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
                  "int32": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT32},
        "interleave": {"NONE": d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE},
        "swizzle": {"NONE": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                    "32B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
                    "64B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
                    "128B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B},
        "l2_promotion": {"NONE": d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
                         "L2_64B": d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
                         "L2_128B": d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                         "L2_256B": d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
        "oob_fill": {"NONE": d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                     "NAN_REQUEST_ZERO_FMA":
                         d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA},
    }


class TensorMapEncoder:
    """Encodes one param's recipe for given tensors; remembers the last 64 encodings (7 us each) and which one
    `write` put at its address last (a launch of the same tensor view copies nothing)."""

    MAX_CACHED = 64

    def __init__(self, name: str, recipe: dict):
        d = cu()
        e = _enums(d)
        self.name = name
        self.dtype = _TORCH_DTYPES[recipe["dtype"]]
        self.box = [int(b) for b in recipe["box"]]
        self.rank = len(self.box)
        self.elem_strides = [int(s) for s in recipe.get("element_strides", [1] * self.rank)]
        self.args = (e["dtype"][recipe["dtype"]], e["interleave"][recipe.get("interleave", "NONE")],
                     e["swizzle"][recipe.get("swizzle", "NONE")],
                     e["l2_promotion"][recipe.get("l2_promotion", "L2_128B")],
                     e["oob_fill"][recipe.get("oob_fill", "NONE")])
        self.cache: dict[tuple, bytes] = {}
        self._written: tuple | None = None

    def write(self, t: torch.Tensor, address: int) -> None:
        """Put `t`'s 128 CUtensorMap bytes at `address` (a launcher's param buffer, which only this encoder writes
        there), unless the last write was of the same view (pointer, shape and strides). The caller serializes."""
        key = (t.data_ptr(), t.shape, t.stride())
        if key != self._written:
            ctypes.memmove(address, self._encode(t, key), 128)
            self._written = key

    def encode(self, t: torch.Tensor) -> bytes:
        """The 128 CUtensorMap bytes for tensor `t` (checked: dtype, rank, unit inner stride, alignment)."""
        return self._encode(t, (t.data_ptr(), t.shape, t.stride()))

    def _encode(self, t: torch.Tensor, key: tuple) -> bytes:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if t.dtype != self.dtype or t.dim() != self.rank:
            raise ValueError(f"tensormap param {self.name}: expected a {self.rank}-D {self.dtype} tensor, "
                             f"got {t.dim()}-D {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"tensormap param {self.name}: the innermost dimension must have stride 1")
        es = t.element_size()
        strides = [s * es for s in reversed(t.stride()[:-1])]
        if t.data_ptr() % 16 or any(s % 16 for s in strides):
            raise ValueError(f"tensormap param {self.name}: base address and strides must be 16-byte aligned "
                             f"(TMA), got address {t.data_ptr():#x} and byte strides {strides}")
        d = cu()
        dt, il, sw, l2, oob = self.args
        tm = check(d.cuTensorMapEncodeTiled(
            dt, self.rank, t.data_ptr(),
            [d.cuuint64_t(int(x)) for x in reversed(t.shape)], [d.cuuint64_t(int(s)) for s in strides],
            [d.cuuint32_t(b) for b in self.box], [d.cuuint32_t(s) for s in self.elem_strides],
            il, sw, l2, oob), f"cuTensorMapEncodeTiled({self.name})")
        blob = ctypes.string_at(tm.getPtr(), 128)
        if len(self.cache) >= self.MAX_CACHED:
            self.cache.pop(next(iter(self.cache)))
        self.cache[key] = blob
        return blob
