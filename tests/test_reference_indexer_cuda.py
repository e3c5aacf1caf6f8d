"""The indexer-family references run on CUDA tensors and agree with their CPU runs (device-agnostic code:
no host reads, packed offsets on the device). Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.reference.lightning_indexer import lightning_indexer as reference_lightning_indexer

pytestmark = pytest.mark.gpu
R = dict(impl="reference")
I32 = dict(dtype=torch.int32)


def cuda(*xs):
    return [x.cuda() for x in xs]


def inputs(b=2, t=300, s=300, h=8, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, h, d, generator=g, dtype=torch.float64), torch.randn(b, s, d, generator=g, dtype=torch.float64),
            torch.randn(b, t, h, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("causal,ratio", [(False, 1), (True, 1), (True, 4)])
def test_lightning_indexer_cuda_matches_cpu(causal, ratio):
    q, k, w = inputs(s=300 // ratio)
    cpu = dsagen.lightning_indexer(q, k, w, 16, causal=causal, compress_ratio=ratio, **R)
    gpu = dsagen.lightning_indexer(*cuda(q, k, w), 16, causal=causal, compress_ratio=ratio, **R)
    assert gpu.is_cuda and gpu.dtype == torch.int32 and gpu.is_contiguous()
    assert torch.equal(cpu, gpu.cpu())


def test_lightning_indexer_cuda_packed_and_chunked():
    q, k, w = inputs(b=1, s=75)
    cu, cuk = torch.tensor([0, 100, 100, 250], **I32), torch.tensor([0, 25, 25, 62], **I32)
    cpu = reference_lightning_indexer(q, k, w, 8, causal=True, compress_ratio=4, cu_seqlens=cu, cu_seqlens_k=cuk)
    gpu = reference_lightning_indexer(*cuda(q, k, w), 8, causal=True, compress_ratio=4, cu_seqlens=cu.cuda(),
                                      cu_seqlens_k=cuk.cuda(), score_budget_bytes=1 << 16)
    assert torch.equal(cpu, gpu.cpu())


def test_dsa_ops_cuda_match_cpu():
    q, k, w = inputs(seed=1)
    off = torch.tensor([3, -5], **I32)
    f = dsagen.indexer_forward_topk(q, k, w, 8, return_lse=True, **R)
    g = dsagen.indexer_forward_topk(*cuda(q, k, w), 8, return_lse=True, **R)
    assert torch.equal(f.indices, g.indices.cpu())
    torch.testing.assert_close(g.softmax.cpu(), f.softmax)
    s = dsagen.indexer_scores(q, k, w, ratio=2, q_causal_offsets=off, **R)
    torch.testing.assert_close(dsagen.indexer_scores(*cuda(q, k, w), ratio=2, q_causal_offsets=off.cuda(), **R).cpu(), s)
    lens = torch.full((2,), 200, **I32)
    t = dsagen.indexer_topk(s.reshape(-1, 300), lens, 32, **R)
    t2 = dsagen.indexer_topk(s.cuda().reshape(-1, 300), lens.cuda(), 32, **R)
    assert torch.equal(t.indices, t2.indices.cpu())
    p = dsagen.sparse_indexer_score_recompute(q, k, w, f.indices, topk_indices_global=True, **R)
    args = (q, w, k, f.softmax, p, f.indices)
    r1 = dsagen.indexer_backward(*args, topk_indices_global=True, **R)
    r2 = dsagen.indexer_backward(*cuda(*args), topk_indices_global=True, grad_loss=torch.ones(1, device="cuda"), **R)
    for x, y in zip(r1, r2):
        torch.testing.assert_close(y.cpu(), x)
    d = dsagen.dense_indexer_score_recompute(q, k, w, **R)
    args = (q, w, k, d.out.exp(), d.out.exp().sum(-1), d.out, d.denom)
    for x, y in zip(dsagen.dense_indexer_backward(*args, **R), dsagen.dense_indexer_backward(*cuda(*args), **R)):
        torch.testing.assert_close(y.cpu(), x)
