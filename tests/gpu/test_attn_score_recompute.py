"""GPU tests of the fused sparse attention score recompute (`dsagen.sparse_attn_score_recompute(...,
impl="fused")`, the sm_90a kernel of AttnScoreRecomputeSpec) against the plain-PyTorch reference in FP64: H 64/128
natively and 16/32 padded, D 512/576, top-k widths that are and are not multiples of 64, topk_length shorter than
the width, -1, negative and out-of-range ids, duplicates, all-invalid rows, B > 1 with local and global ids, grids
smaller than the rows, fp16.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dsagen
from dsagen.kernels.attn_score_recompute import host as rc_host
from dsagen.kernels.attn_score_recompute.spec import config_for
from test_sparse_attention import make_ids

ARCH = "sm_90a"
REQUIRED_SPECS = [config_for(h, d, dt, ARCH, None).spec(h, d, dt, ARCH)
                  for h, d, dt in [(64, 512, "bfloat16"), (64, 576, "bfloat16"), (128, 512, "bfloat16"),
                                   (128, 576, "bfloat16"), (64, 576, "float16")]]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_case(b, s_q, h, d, s_k, k, *, adversarial=False, length=False, seed=0, dtype=torch.bfloat16):
    """Random inputs; lse from the reference forward of each batch so that P is a distribution per head."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn((b, s_q, h, d), generator=gen) * 0.5).to(dtype).to(DEV)
    kv = (torch.randn((b, s_k, d), generator=gen) * 0.5).to(dtype).to(DEV)
    ids = torch.stack([make_ids(s_q, k, s_k, gen, adversarial=adversarial) for _ in range(b)]).to(DEV)
    lens = torch.randint(0, k + 1, (b, s_q), generator=gen, dtype=torch.int32).to(DEV) if length else None
    lse = torch.stack([dsagen.sparse_attention(q[i].float(), kv[i].float(), ids[i], topk_length=None if lens is None
                                               else lens[i], softmax_scale=d ** -0.5, impl="reference")[1]
                       for i in range(b)])
    return q, kv, lse, ids, lens


def check(q, kv, lse, ids, lens, *, global_ids=False, config=None):
    scale = q.shape[-1] ** -0.5
    if global_ids:
        s_k = kv.shape[1]
        batch = torch.arange(q.shape[0], device=DEV, dtype=torch.int32).view(-1, 1, 1)
        ids = torch.where((ids >= 0) & (ids < s_k), ids + batch * s_k, ids)
    if config is None:
        got = dsagen.sparse_attn_score_recompute(q, kv, lse, ids, scale, topk_length=lens,
                                                 topk_indices_global=global_ids)
    else:
        got = rc_host.sparse_attn_score_recompute(q, kv, lse, ids, scale, topk_length=lens,
                                                  topk_indices_global=global_ids, config=config)
    want = dsagen.sparse_attn_score_recompute(q.double(), kv.double(), lse.double(), ids, scale, topk_length=lens,
                                              topk_indices_global=global_ids, impl="reference")
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-2 * max(want.abs().max().item(), 1e-6), err
    sums = got.sum(-1)
    assert torch.allclose(sums[want.sum(-1) > 0], torch.ones_like(sums[want.sum(-1) > 0]), atol=1e-4)
    return got


@pytest.mark.parametrize("h,d", [(64, 512), (64, 576), (128, 512), (128, 576)])
@pytest.mark.parametrize("k", [64, 200])
def test_matches_reference(h, d, k):
    check(*make_case(1, 23, h, d, 700, k, seed=h + d + k))


@pytest.mark.parametrize("h", [16, 32])
def test_padded_heads(h):
    check(*make_case(1, 9, h, 576, 300, 128, seed=h))


@pytest.mark.parametrize("h", [64, 128])
def test_adversarial_ids_and_lengths(h):
    got = check(*make_case(1, 17, h, 576, 400, 192, adversarial=True, length=True, seed=h + 1))
    assert (got[0, 1] == 0).all()                         # row 1 has no valid id


@pytest.mark.parametrize("global_ids", [False, True])
def test_batches_local_and_global_ids_adversarial(global_ids):
    check(*make_case(3, 7, 128, 576, 150, 130, adversarial=True, length=True, seed=5), global_ids=global_ids)


def test_single_row_and_looping_grid():
    check(*make_case(1, 1, 128, 576, 100, 64, seed=6))
    check(*make_case(2, 11, 64, 512, 300, 256, length=True, seed=7),
          config=replace(config_for(64, 512, "bfloat16", ARCH, None), grid=3))      # the op's kernel on 3 CTAs


def test_float16():
    check(*make_case(1, 13, 64, 576, 400, 192, adversarial=True, seed=8, dtype=torch.float16))


def test_torch_compile_and_cuda_graph():
    q, kv, lse, ids, lens = make_case(1, 33, 128, 576, 500, 256, adversarial=True, length=True, seed=9)
    scale = 576 ** -0.5
    eager = dsagen.sparse_attn_score_recompute(q, kv, lse, ids, scale, topk_length=lens)
    compiled = torch.compile(lambda *a: dsagen.sparse_attn_score_recompute(*a, scale, topk_length=lens),
                             fullgraph=True)
    assert torch.equal(compiled(q, kv, lse, ids), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.sparse_attn_score_recompute(q, kv, lse, ids, scale, topk_length=lens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
