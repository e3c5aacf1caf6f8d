"""GPU tests of the fused FP8 MLA KV cache writer and reader (`dsagen.quantize_kv_fp8` / `dsagen.dequantize_kv_fp8`
with impl="fused", the sm_90a kernels of KvFp8CodecSpec): byte for byte the references on fresh random rows of many
magnitudes (tiles of zeros, tiles whose amax / 448 is a power of two, huge and tiny values, a single large outlier),
leading dims, strided and misaligned inputs, the float8_e4m3fn view of the cache, a paged cache's rows, no token, the
custom ops, torch.compile and CUDA-graph capture.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.kv_fp8.spec import KvFp8CodecSpec

ARCH = "sm_90a"
DEV = "cuda"
REQUIRED_SPECS = [KvFp8CodecSpec(arch=ARCH, dequantize=d) for d in (False, True)]

pytestmark = pytest.mark.gpu


def rows(n, gen):
    """bf16 [n, 576] rows: per row a random magnitude 2 ** [-20, 20]; tile 1 of row 1 zero; row 2's tiles with
    amax = 448 * 2 ** k exactly (the scale's power-of-two edge); row 3 one outlier of 3e4; row 4 values near
    bf16's smallest normals."""
    x = torch.randn(n, 576, generator=gen) * torch.pow(2.0, torch.randint(-20, 21, (n, 1), generator=gen).float())
    if n > 4:
        x[1, 128:256] = 0
        x[2, :512] = x[2, :512].clamp(-447, 447)
        for t in range(4):
            x[2, 128 * t] = 448.0 * 2.0 ** (t - 2)
        x[3, 7] = 3e4
        x[4] = torch.randn(576, generator=gen) * 1e-38
    return x.bfloat16().to(DEV)


@pytest.mark.parametrize("n", [1, 5, 37, 4096])
def test_quantize_and_dequantize_bytes(n):
    gen = torch.Generator().manual_seed(n)
    kv = rows(n, gen)
    cache = dsagen.quantize_kv_fp8(kv)
    ref = dsagen.quantize_kv_fp8(kv, impl="reference")
    assert cache.dtype == torch.uint8 and cache.shape == (n, 656) and torch.equal(cache, ref)
    back = dsagen.dequantize_kv_fp8(cache)
    assert torch.equal(back.view(torch.int16), dsagen.dequantize_kv_fp8(ref, impl="reference").view(torch.int16))
    assert torch.equal(dsagen.dequantize_kv_fp8(cache.view(torch.float8_e4m3fn)).view(torch.int16),
                       back.view(torch.int16))


def test_layouts():
    gen = torch.Generator().manual_seed(3)
    kv = rows(64, gen)
    lead = kv.view(2, 4, 8, 576)
    assert torch.equal(dsagen.quantize_kv_fp8(lead), dsagen.quantize_kv_fp8(kv).view(2, 4, 8, 656))
    wide = torch.zeros(64, 600, dtype=torch.bfloat16, device=DEV)
    wide[:, 3:579] = kv                                                   # rows 1200 bytes apart, misaligned base
    assert torch.equal(dsagen.quantize_kv_fp8(wide[:, 3:579]), dsagen.quantize_kv_fp8(kv))
    paged = dsagen.quantize_kv_fp8(kv).view(4, 16, 1, 656)                 # a paged cache [blocks, page, 1, 656]
    assert torch.equal(dsagen.dequantize_kv_fp8(paged).view(64, 576).view(torch.int16),
                       dsagen.dequantize_kv_fp8(paged, impl="reference").view(64, 576).view(torch.int16))
    sub = paged[:, ::2]                                                   # every other token: strided rows
    assert torch.equal(dsagen.dequantize_kv_fp8(sub).view(torch.int16),
                       dsagen.dequantize_kv_fp8(sub, impl="reference").view(torch.int16))
    empty = torch.zeros(0, 576, dtype=torch.bfloat16, device=DEV)
    assert dsagen.quantize_kv_fp8(empty).shape == (0, 656)
    assert dsagen.dequantize_kv_fp8(torch.zeros(0, 656, dtype=torch.uint8, device=DEV)).shape == (0, 576)


def test_custom_ops_compile_and_graph():
    gen = torch.Generator().manual_seed(5)
    kv = rows(32, gen)
    want = dsagen.quantize_kv_fp8(kv)
    assert torch.equal(torch.ops.dsagen.quantize_kv_fp8(kv), want)
    out = torch.empty_like(want)
    torch.ops.dsagen.quantize_kv_fp8_out(kv, out_cache=out)
    assert torch.equal(out, want)
    compiled = torch.compile(lambda x: dsagen.dequantize_kv_fp8(dsagen.quantize_kv_fp8(x)), fullgraph=True)
    assert torch.equal(compiled(kv).view(torch.int16), dsagen.dequantize_kv_fp8(want).view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.quantize_kv_fp8(kv)
    kv.copy_(rows(32, gen))
    graph.replay()
    assert torch.equal(captured, dsagen.quantize_kv_fp8(kv, impl="reference"))
