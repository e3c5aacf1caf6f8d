"""GPU tests of the fused standalone indexer top-k (`dsagen.indexer_topk(..., impl="fused")`, the lightning indexer's
radix top-k over matrix rows, IndexerTopkRowsSpec) against the plain-PyTorch reference: the exact selected set of
every row (ties at the k-th value toward the lower index) on random rows, tied plateaus, all-equal rows, rows shorter
than k, empty rows, lengths past the width, one length per group of rows, next_n > 1, widths that are not multiples
of 4, strided FP32 / FP16 / BF16 inputs, every kernel of the plan (4K to 128K columns, rows that do and do not fit one
wave), top_k above 2048, values, torch.compile and CUDA-graph capture.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.indexer_topk.spec import config_for

ARCH = "sm_90a"
REQUIRED_SPECS = list(config_for(ARCH).specs())

pytestmark = pytest.mark.gpu
DEV = "cuda"
BIG = 2**31 - 1


def check(x, lens, k, **kw):
    got = dsagen.indexer_topk(x, lens, k, **kw)
    want = dsagen.indexer_topk(x, lens, k, impl="reference", **kw)
    assert got.indices.shape == want.indices.shape and got.indices.dtype == torch.int32
    # the same set per row: sort both with -1 last
    g = torch.where(got.indices < 0, BIG, got.indices).sort(-1).values
    w = torch.where(want.indices < 0, BIG, want.indices).sort(-1).values
    assert torch.equal(g, w)
    # ascending ids, then -1
    valid = got.indices >= 0
    assert torch.equal(valid, valid.cummin(-1).values)
    assert torch.equal(g, torch.where(valid, got.indices, BIG))
    if kw.get("return_values", True):
        assert got.values.dtype == x.dtype
        ref_vals = x.gather(1, got.indices.clamp_min(0).long())
        assert torch.equal(got.values[valid], ref_vals[valid]) and torch.isneginf(got.values[~valid]).all()
    else:
        assert got.values is None
    return got


def rows(n_rows, n_cols, seed, dtype=torch.float32, levels=None):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if levels is None:
        return torch.randn((n_rows, n_cols), generator=gen, device=DEV).to(dtype)
    return torch.randint(0, levels, (n_rows, n_cols), generator=gen, device=DEV).to(dtype)


@pytest.mark.parametrize("n_cols,n_rows", [(4096, 300), (20000, 300), (32768, 300), (131072, 200), (131072, 40),
                                           (8192, 40)])
def test_every_plan_kernel_matches(n_cols, n_rows):
    x = rows(n_rows, n_cols, n_cols + n_rows)
    lens = torch.full((n_rows,), n_cols, dtype=torch.int32, device=DEV)
    check(x, lens, 2048)


@pytest.mark.parametrize("levels", [2, 7, 1000])
def test_tied_plateaus(levels):
    x = rows(300, 32768, levels, levels=levels)
    check(x, torch.full((300,), 32768, dtype=torch.int32, device=DEV), 2048)
    check(rows(300, 4096, levels + 1, levels=levels), torch.full((300,), 4096, dtype=torch.int32, device=DEV), 64)


def test_lengths_edges_and_groups():
    x = rows(256, 5000, 3)
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(-5, 6000, (256,), generator=gen, dtype=torch.int32)
    lens[:8] = torch.tensor([0, -1, 1, 2047, 2048, 2049, 5000, 10**9], dtype=torch.int32)
    got = check(x, lens.to(DEV), 2048)
    assert (got.indices[:2] == -1).all() and (got.indices[2, 1:] == -1).all()       # empty rows, one column
    check(x, torch.tensor([4000, 17, 0, 4999], dtype=torch.int32, device=DEV), 100)  # 64 rows per length
    check(x, torch.tensor([4000, 3], dtype=torch.int32, device=DEV), 7, next_n=128)  # the speculative stagger


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_and_odd_widths(dtype):
    check(rows(200, 32767, 5, dtype=dtype), torch.full((200,), 32767, dtype=torch.int32, device=DEV), 2048)
    check(rows(200, 4099, 6), torch.full((200,), 4099, dtype=torch.int32, device=DEV), 512, return_values=False)
    strided = rows(200, 8200, 7)[:, 3:4099]                                # unaligned base, row stride 8200
    check(strided, torch.full((200,), 4096, dtype=torch.int32, device=DEV), 256)


def test_wide_top_k_and_all_equal_rows():
    check(rows(150, 40000, 8), torch.full((150,), 40000, dtype=torch.int32, device=DEV), 3000)
    check(torch.ones((150, 9000), device=DEV), torch.full((150,), 9000, dtype=torch.int32, device=DEV), 2048)
    check(rows(150, 100, 9), torch.full((150,), 100, dtype=torch.int32, device=DEV), 2048)   # rows shorter than k


def test_torch_compile_and_cuda_graph():
    x = rows(300, 32768, 10)
    lens = torch.full((300,), 30000, dtype=torch.int32, device=DEV)
    eager = dsagen.indexer_topk(x, lens, 2048)
    compiled = torch.compile(lambda a, b: dsagen.indexer_topk(a, b, 2048), fullgraph=True)
    assert all(torch.equal(p, q) for p, q in zip(compiled(x, lens), eager))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.indexer_topk(x, lens, 2048)
    lens.fill_(20000)                                   # lengths are read on the device
    graph.replay()
    torch.cuda.synchronize()
    want = dsagen.indexer_topk(x, lens, 2048)
    assert torch.equal(captured.indices, want.indices) and torch.equal(captured.values, want.values)
