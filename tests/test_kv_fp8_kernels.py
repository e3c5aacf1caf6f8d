"""CPU tests of the FP8 MLA KV cache codec family (dsagen/kernels/kv_fp8): the spec, the binding, the host's row
views, and the compiled kernels' SASS (one 16-byte store of E4M3 bytes per lane through the saturating conversion,
the IEEE division of amax by 448, no local memory)."""

from __future__ import annotations

import re

import pytest
import torch

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.kv_fp8 import host as kv_host
from dsagen.kernels.kv_fp8.spec import KvFp8CodecSpec
from dsagen.spec import SpecError


def test_spec_and_binding():
    with pytest.raises(SpecError, match="sm_90a only"):
        KvFp8CodecSpec(arch="sm_100a").check()
    for d in (False, True):
        src = render(KvFp8CodecSpec(arch="sm_90a", dequantize=d))
        compile(src, "kernel.py", "exec")
        assert f"build(dequantize={d})" in src and "dsagen.kernels.kv_fp8.codec_sm90" in helper_modules(src)


def test_rows_keep_aligned_layouts_and_copy_others():
    x = torch.zeros(10, 600, dtype=torch.bfloat16)
    assert kv_host._rows(x[:, :576], 576, 8).data_ptr() == x.data_ptr()            # 1200-byte rows: as they are
    y = kv_host._rows(x[:, 3:579], 576, 8)                                          # a misaligned base: a copy
    assert y.is_contiguous() and y.data_ptr() != x.data_ptr()
    c = torch.zeros(4, 8, 1, 656, dtype=torch.uint8)
    assert kv_host._rows(c, 656, 16).data_ptr() == c.data_ptr() and kv_host._rows(c, 656, 16).shape == (32, 656)
    assert kv_host._rows(c[:, ::2], 656, 16).stride(0) == 2 * 656                  # strided rows: no copy


@pytest.mark.compile
@pytest.mark.parametrize("dequantize", [False, True], ids=["writer", "reader"])
def test_codec_sass(dequantize, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = KvFp8CodecSpec(arch="sm_90a", dequantize=dequantize)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [128, 1, 1] and ck.record["launch"]["smem"] == 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    assert not re.findall(r"\b(LDL|STL)\b", sass)
    if dequantize:
        assert len(re.findall(r"F2FP\.F16\.E4M3\.UNPACK_B", sass)) == 8       # 16 E4M3 values a lane
        assert len(re.findall(r"STG\.E\.128", sass)) == 3                   # 32 bf16 bytes, the RoPE bytes
    else:
        assert len(re.findall(r"F2FP\.SATFINITE\.E4M3\.F32", sass)) == 8    # 16 values, two a conversion
        assert len(re.findall(r"SHFL\.BFLY", sass)) == 3                    # the tile's amax over 8 lanes
        assert "MUFU.RCP" in sass                                           # amax / 448: the IEEE division
        assert len(re.findall(r"STG\.E\.128", sass)) == 2 and len(re.findall(r"STG\.E ", sass)) == 1
