"""GPU tests of the fused sparse indexer score recompute (`dsagen.sparse_indexer_score_recompute(...,
impl="fused")`, the sm_90a kernel of IndexerScoreRecomputeSpec) against the plain-PyTorch reference in FP64: H 64/128
natively and 16/32/100 padded, D 64/128, top-k widths that are and are not multiples of 64, topk_length shorter than
the width, -1, negative and out-of-range ids, duplicates, all-invalid rows, B > 1 with local and global ids, grids
smaller than the rows, fp16, the DeepSeek-V3.2 shape, torch.compile and CUDA-graph capture.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dsagen
from dsagen.kernels.indexer_score_recompute import host as isr_host
from dsagen.kernels.indexer_score_recompute.spec import config_for
from test_sparse_attention import make_ids

ARCH = "sm_90a"
REQUIRED_SPECS = [config_for(h, d, dt, ARCH, None).spec(h, d, dt, ARCH)
                  for h, d, dt in [(64, 128, "bfloat16"), (128, 128, "bfloat16"), (64, 64, "bfloat16"),
                                   (128, 64, "bfloat16"), (64, 128, "float16")]]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_case(b, s_q, h, d, s_k, k, *, adversarial=False, length=False, seed=0, dtype=torch.bfloat16):
    """Random inputs at the indexer's magnitudes (weights ~ H^-1/2); ids per batch from make_ids."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((b, s_q, h, d), generator=gen).to(dtype).to(DEV)
    kk = torch.randn((b, s_k, d), generator=gen).to(dtype).to(DEV)
    w = (torch.randn((b, s_q, h), generator=gen) * h ** -0.5).to(dtype).to(DEV)
    ids = torch.stack([make_ids(s_q, k, s_k, gen, adversarial=adversarial) for _ in range(b)]).to(DEV)
    lens = torch.randint(0, k + 1, (b, s_q), generator=gen, dtype=torch.int32).to(DEV) if length else None
    return q, kk, w, ids, lens


def check(q, kk, w, ids, lens, *, global_ids=False, config=None, sm_scale=None):
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if global_ids:
        s_k = kk.shape[1]
        batch = torch.arange(q.shape[0], device=DEV, dtype=torch.int32).view(-1, 1, 1)
        ids = torch.where((ids >= 0) & (ids < s_k), ids + batch * s_k, ids)
    kw = dict(topk_length=lens, topk_indices_global=global_ids, sm_scale=sm_scale)
    if config is None:
        got = dsagen.sparse_indexer_score_recompute(q, kk, w, ids, **kw)
    else:
        got = isr_host.sparse_indexer_score_recompute(q, kk, w, ids, **kw, config=config)
    want = dsagen.sparse_indexer_score_recompute(q.double(), kk.double(), w.double(), ids, **kw, impl="reference")
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 2e-3 * max(want.abs().max().item(), 1e-6), err
    assert ((got == 0) == (want == 0)).all()                  # invalid slots and rows are exactly 0
    sums = got.sum(-1)
    live = want.sum(-1) > 0
    assert torch.allclose(sums[live], torch.ones_like(sums[live]), atol=1e-4)
    return got


@pytest.mark.parametrize("h,d", [(64, 128), (128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("k", [64, 200])
def test_matches_reference(h, d, k):
    check(*make_case(1, 23, h, d, 700, k, seed=h + d + k))


@pytest.mark.parametrize("h", [16, 32, 100])
def test_padded_heads(h):
    check(*make_case(1, 9, h, 128, 300, 128, seed=h))


@pytest.mark.parametrize("h", [64, 128])
def test_adversarial_ids_and_lengths(h):
    got = check(*make_case(1, 17, h, 128, 400, 192, adversarial=True, length=True, seed=h + 1))
    assert (got[0, 1] == 0).all()                         # row 1 has no valid id


@pytest.mark.parametrize("global_ids", [False, True])
def test_batches_local_and_global_ids_adversarial(global_ids):
    check(*make_case(3, 7, 64, 128, 150, 130, adversarial=True, length=True, seed=5), global_ids=global_ids)


def test_global_ids_of_another_batch_are_invalid():
    q, kk, w, ids, _ = make_case(2, 5, 64, 128, 100, 64, seed=11)
    ids[0, :, :8] = 100 + torch.arange(8, device=DEV, dtype=torch.int32)   # batch 1's rows, from batch 0
    got = check(q, kk, w, ids, None, global_ids=True)
    assert (got[0, :, :8] == 0).all()


def test_single_row_looping_grid_and_long_rows():
    check(*make_case(1, 1, 64, 128, 100, 64, seed=6))
    op = config_for(64, 128, "bfloat16", ARCH, None)               # the op's kernel on grids of 3 and 2 CTAs
    check(*make_case(2, 11, 64, 128, 300, 256, length=True, seed=7), config=replace(op, grid=3))
    check(*make_case(1, 5, 64, 128, 9000, 5000, seed=8), config=replace(op, grid=2))


def test_float16_and_scales():
    check(*make_case(1, 13, 64, 128, 400, 192, adversarial=True, seed=8, dtype=torch.float16))
    check(*make_case(1, 13, 64, 128, 400, 192, seed=9), sm_scale=1.0)
    check(*make_case(1, 13, 64, 128, 400, 192, seed=10), sm_scale=0.01)


def test_deepseek_v32_shape():
    check(*make_case(1, 64, 64, 128, 8192, 2048, seed=12))


def test_torch_compile_and_cuda_graph():
    q, kk, w, ids, lens = make_case(1, 33, 64, 128, 500, 256, adversarial=True, length=True, seed=13)
    kw = dict(topk_length=lens, sm_scale=0.1)
    eager = dsagen.sparse_indexer_score_recompute(q, kk, w, ids, **kw)
    compiled = torch.compile(lambda *a: dsagen.sparse_indexer_score_recompute(*a, **kw), fullgraph=True)
    assert torch.equal(compiled(q, kk, w, ids), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.sparse_indexer_score_recompute(q, kk, w, ids, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
