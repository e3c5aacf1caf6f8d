"""GPU tests of the fused decode-time indexer (`dsagen.indexer_decode_topk(..., impl="fused")`: the paged score kernel
of IndexerScoreSpec(paged=True) and indexer_forward_topk's top-k kernels) against an FP64 oracle of the dequantized
cache and the reference: FP8 (DeepGEMM's paged layout) and BF16 caches, random page tables, B 1-5 x next_n 1-4,
lengths from next_n to the table's end (a partial last page), top_k below and above the visible keys, the custom op,
torch.compile and CUDA-graph capture with new lengths.

A selection is checked as a set: every id page-encoded, visible and distinct, as many as min(top_k, visible keys),
and no selected key's oracle score below the k-th best by more than the scores' rounding (the fused FP8 path rounds
ReLU(q . k) and the weights to bf16 before its tensor-core head sum; the BF16 path rounds the weights to bf16).

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.lightning_indexer.spec import decode_config_for
from dsagen.reference.kv_cache import dequantize_index_k_fp8

ARCH = "sm_90a"
DEV = "cuda"
H, D, PAGE = 64, 128, 64
REQUIRED_SPECS = [s for dt in ("float8_e4m3fn", "bfloat16") for s in decode_config_for(H, D, dt, ARCH).specs()]

pytestmark = pytest.mark.gpu


def make_case(b, next_n, lens, max_pages, n_pages, fp8, gen):
    """q, weights, the cache, a random page table (distinct pages per sequence) and the lengths."""
    k = torch.randn(n_pages, PAGE, D, generator=gen)
    if fp8:
        cache = dsagen.quantize_index_k_fp8(k, impl="reference")
        q = (torch.randn(b, next_n, H, D, generator=gen) * 2).to(torch.float8_e4m3fn)
    else:
        cache = k.bfloat16()
        q = torch.randn(b, next_n, H, D, generator=gen).bfloat16()
    w = torch.randn(b, next_n, H, generator=gen)
    table = torch.stack([torch.randperm(n_pages, generator=gen)[:max_pages] for _ in range(b)]).int()
    return (q.to(DEV), w.to(DEV), cache.to(DEV), table.to(DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


def oracle_scores(q, w, cache, table, fp8):
    """FP64 scores [B, next_n, max_pages x 64] of every virtual key row (the dequantized cache through the table)."""
    keys = dequantize_index_k_fp8(cache).double() if fp8 else cache.double()        # [n_pages, 64, D]
    kv = keys[table.long()].reshape(table.shape[0], -1, D)                            # [B, S, D]
    dots = torch.einsum("bjhd,bsd->bjhs", q.double(), kv)
    return torch.einsum("bjh,bjhs->bjs", w.double(), torch.relu(dots))


def check_selection(ids, q, w, cache, table, lens, top_k, fp8):
    b, next_n = q.shape[:2]
    scores = oracle_scores(q, w, cache, table, fp8)
    pos_of = {}
    for bi in range(b):
        for p, page in enumerate(table[bi].tolist()):
            pos_of[(bi, page)] = p
    tol = 2e-2 * scores.abs().amax().item()
    for bi in range(b):
        for j in range(next_n):
            visible = int(lens[bi]) - next_n + j + 1
            row = ids[bi, j].tolist()
            sel = [x for x in row if x >= 0]
            assert row[len(sel):] == [-1] * (top_k - len(sel)), "padding after the selected ids"
            assert len(sel) == min(top_k, visible)
            pos = [pos_of[(bi, x // PAGE)] * PAGE + x % PAGE for x in sel]
            assert len(set(pos)) == len(pos) and all(0 <= p < visible for p in pos)
            if sel:
                row_scores = scores[bi, j, :visible]
                kth = row_scores.topk(len(sel)).values[-1].item()
                assert row_scores[pos].min().item() >= kth - tol


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("b,next_n,lens,top_k", [(1, 1, [200], 64), (3, 2, [64, 1000, 130], 128),
                                                 (5, 4, [4, 9, 300, 511, 512], 256), (2, 1, [700, 33], 2048)])
def test_decode_topk(fp8, b, next_n, lens, top_k):
    gen = torch.Generator().manual_seed(sum(lens) + top_k + fp8)
    q, w, cache, table, lens_t = make_case(b, next_n, lens, 16, 40, fp8, gen)
    ids = dsagen.indexer_decode_topk(q, w, cache, table, lens_t, top_k)
    assert ids.shape == (b, next_n, top_k) and ids.dtype == torch.int32
    check_selection(ids, q, w, cache, table, lens_t, top_k, fp8)
    ref = dsagen.indexer_decode_topk(q, w, cache, table, lens_t, top_k, impl="reference")
    same = sum(len(set(a) & set(r)) for a, r in zip(ids.view(-1, top_k).tolist(), ref.view(-1, top_k).tolist()))
    assert same >= 0.97 * (ref >= 0).sum().item()                 # rounding may swap keys at the boundary


def test_custom_op_compile_and_graph():
    gen = torch.Generator().manual_seed(7)
    q, w, cache, table, lens = make_case(4, 2, [100, 257, 64, 900], 16, 40, True, gen)
    want = dsagen.indexer_decode_topk(q, w, cache, table, lens, 128)
    assert torch.equal(torch.ops.dsagen.indexer_decode_topk(q, w, cache, table, lens, 128), want)
    compiled = torch.compile(lambda *a: dsagen.indexer_decode_topk(*a, 128), fullgraph=True)
    assert torch.equal(compiled(q, w, cache, table, lens), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.indexer_decode_topk(q, w, cache, table, lens, 128)
    lens.copy_(torch.tensor([300, 2, 1000, 65], dtype=torch.int32))        # lengths on the device: no recapture
    graph.replay()
    assert torch.equal(captured, dsagen.indexer_decode_topk(q, w, cache, table, lens, 128))
    check_selection(captured, q, w, cache, table, lens, 128, True)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("cache_tokens,b", [(16384, 2), (65536, 1)])
def test_long_rows_eager_side_stream_and_graph(fp8, cache_tokens, b):
    """Long cached rows (bench/indexer_decode.py's shapes: every sequence cache_tokens long in random pages, top_k
    2048) run eagerly, on a side stream and as a CUDA graph of two calls captured there (the benchmark's pattern):
    the same bytes every time, and a valid selection."""
    gen = torch.Generator().manual_seed(cache_tokens + b + fp8)
    pages = cache_tokens // PAGE
    q, w, cache, table, lens = make_case(b, 1, [cache_tokens] * b, pages, b * pages, fp8, gen)
    call = lambda: dsagen.indexer_decode_topk(q, w, cache, table, lens, 2048)      # noqa: E731
    want = call()
    torch.cuda.synchronize()
    check_selection(want, q, w, cache, table, lens, 2048, fp8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(again, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = call(), call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, want) and torch.equal(second, want)


def test_pages_outside_the_cache_read_zeros():
    """A table entry past the cache within a sequence's length: the kernel reads zeros there (no fault) and, with
    top_k above the length, still selects every visible key once (the reference refuses such a table)."""
    gen = torch.Generator().manual_seed(11)
    q, w, cache, table, lens = make_case(2, 1, [200, 150], 4, 10, True, gen)
    table[0, 1] = 1000                                                   # keys 64..127 of sequence 0: no page
    ids = dsagen.indexer_decode_topk(q, w, cache, table, lens, 256)
    for bi, length in enumerate((200, 150)):
        sel = ids[bi, 0][ids[bi, 0] >= 0].tolist()
        assert len(sel) == length
        pos = sorted(table[bi].tolist().index(x // PAGE) * PAGE + x % PAGE for x in sel)
        assert pos == list(range(length))
