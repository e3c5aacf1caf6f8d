"""GPU tests of the fused sparse indexer backward (`dsagen.indexer_backward(..., impl="fused")`, the sm_90a kernel
of IndexerBwdSpec) against the plain-PyTorch reference in FP64: H 64 natively and 16/32 padded, D 64/128, top-k
widths that are and are not multiples of 64, -1, negative and out-of-range ids, duplicates, all-invalid rows, B > 1
with local and global ids, grad_loss / sm_scale / loss_coeff, grids smaller than the rows, fp16, the deterministic
mode (bitwise run to run), ids ordered by key window, inputs left unmodified, torch.compile and CUDA-graph
capture.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.indexer_bwd import host as ib_host
from dsagen.kernels.indexer_bwd.spec import IndexerBwdConfig, config_for
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdOrderSpec
from test_sparse_attention import make_ids

ARCH = "sm_90a"
REQUIRED_SPECS = [config_for(d, dt, ARCH, None).spec(d, dt, ARCH, deterministic=det)
                  for d, dt, det in [(128, "bfloat16", False), (128, "bfloat16", True), (64, "bfloat16", False),
                                     (128, "float16", False)]] + [RowScatterAddSpec(arch=ARCH, width=128),
                                                                  SparseAttnBwdOrderSpec(arch=ARCH)]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def distribution(shape, gen):
    """Random rows that sum to 1 (the scores are softmax-like)."""
    return torch.softmax(torch.randn(shape, generator=gen) * 2, dim=-1).to(DEV)


def make_case(b, s_q, h, d, s_k, k, *, adversarial=False, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((b, s_q, h, d), generator=gen).to(dtype).to(DEV)
    kk = torch.randn((b, s_k, d), generator=gen).to(dtype).to(DEV)
    w = (torch.randn((b, s_q, h), generator=gen) * h ** -0.5).to(dtype).to(DEV)
    ids = torch.stack([make_ids(s_q, k, s_k, gen, adversarial=adversarial) for _ in range(b)]).to(DEV)
    return q, w, kk, distribution((b, s_q, k), gen), distribution((b, s_q, k), gen), ids


def check(q, w, kk, tgt, p, ids, *, global_ids=False, config=None, deterministic=False, **kw):
    if global_ids:
        s_k = kk.shape[1]
        batch = torch.arange(q.shape[0], device=DEV, dtype=torch.int32).view(-1, 1, 1)
        ids = torch.where((ids >= 0) & (ids < s_k), ids + batch * s_k, ids)
    kw = dict(kw, topk_indices_global=global_ids)
    before = [t.clone() for t in (q, w, kk, tgt, p, ids)]
    if config is None:
        got = dsagen.indexer_backward(q, w, kk, tgt, p, ids, deterministic=deterministic, **kw)
    else:
        got = ib_host.indexer_backward(q, w, kk, tgt, p, ids, deterministic=deterministic, config=config, **kw)
    assert all(torch.equal(x, y) for x, y in zip(before, (q, w, kk, tgt, p, ids)))      # inputs not modified
    want = dsagen.indexer_backward(q.double(), w.double(), kk.double(), tgt.double(), p.double(), ids, **kw,
                                   impl="reference")
    for name, g_, w_ in zip(("d_index_q", "d_weights", "d_index_k"), got, want):
        assert g_.dtype == w.dtype if name == "d_weights" else g_.dtype == q.dtype
        assert g_.shape == w_.shape and torch.isfinite(g_).all(), name
        err = (g_.double() - w_).abs().max().item()
        assert err <= 1e-2 * max(w_.abs().max().item(), 1e-30), (name, err, w_.abs().max().item())
    return got


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("k", [64, 200])
def test_matches_reference(d, k):
    check(*make_case(1, 23, 64, d, 700, k, seed=d + k))


@pytest.mark.parametrize("h", [16, 32])
def test_padded_heads(h):
    check(*make_case(1, 9, h, 128, 300, 128, seed=h))


def test_adversarial_ids():
    got = check(*make_case(1, 17, 64, 128, 400, 192, adversarial=True, seed=3))
    assert (got.d_index_q[0, 1] == 0).all() and (got.d_weights[0, 1] == 0).all()     # row 1 has no valid id


@pytest.mark.parametrize("global_ids", [False, True])
def test_batches_local_and_global_ids_adversarial(global_ids):
    check(*make_case(3, 7, 64, 128, 150, 130, adversarial=True, seed=5), global_ids=global_ids)


def test_loss_scales_grid_and_fp16():
    grad_loss = torch.tensor([0.37], device=DEV)
    check(*make_case(2, 11, 64, 128, 300, 256, seed=7), grad_loss=grad_loss, sm_scale=0.088, loss_coeff=3.0,
          config=IndexerBwdConfig(grid=3))
    check(*make_case(1, 13, 64, 128, 400, 192, adversarial=True, seed=8, dtype=torch.float16))


def test_deepseek_v32_shape():
    check(*make_case(1, 64, 64, 128, 4096, 2048, seed=9), sm_scale=128 ** -0.5)


def test_deterministic_is_bitwise_and_matches():
    case = make_case(2, 33, 64, 128, 500, 256, adversarial=True, seed=10)
    a = check(*case, deterministic=True)
    b = check(*case, deterministic=True, config=IndexerBwdConfig(chunk_bytes=1 << 20))   # 8 rows per launch
    c = check(*case)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a.d_index_q, c.d_index_q) and torch.equal(a.d_weights, c.d_weights)


@pytest.mark.parametrize("grid", ["persistent", 3])
def test_ordered_ids(grid):
    """Ids ordered by 64-row key windows (forced: order_min_bytes=0), each slot's dI read through the ordering's
    slot permutation, on adversarial ids over three batches of local and global ids, against the reference."""
    case = make_case(3, 9, 64, 128, 700, 200, adversarial=True, seed=12)
    ordered = IndexerBwdConfig(grid=grid, bucket_rows=64, order_min_bytes=0)
    assert ordered.ordered(700, 128, False)
    check(*case, config=ordered)
    check(*case, global_ids=True, config=ordered, grad_loss=torch.tensor([0.5], device=DEV), sm_scale=0.2)


def test_torch_compile_and_cuda_graph():
    q, w, kk, tgt, p, ids = make_case(1, 33, 64, 128, 500, 256, adversarial=True, seed=11)
    grad_loss = torch.ones((), device=DEV)
    kw = dict(grad_loss=grad_loss, sm_scale=0.1, deterministic=True)
    eager = dsagen.indexer_backward(q, w, kk, tgt, p, ids, **kw)
    compiled = torch.compile(lambda *a: dsagen.indexer_backward(*a, **kw), fullgraph=True)
    assert all(torch.equal(x, y) for x, y in zip(compiled(q, w, kk, tgt, p, ids), eager))
    for det in (False, True):
        kw["deterministic"] = det
        dsagen.indexer_backward(q, w, kk, tgt, p, ids, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = dsagen.indexer_backward(q, w, kk, tgt, p, ids, **kw)
        grad_loss.fill_(2.0)                               # read on the device at replay
        graph.replay()
        torch.cuda.synchronize()
        want = dsagen.indexer_backward(q, w, kk, tgt, p, ids, **kw)
        assert torch.equal(captured.d_index_q, want.d_index_q) and torch.equal(captured.d_weights, want.d_weights)
        if det:
            assert torch.equal(captured.d_index_k, want.d_index_k)
        else:
            torch.testing.assert_close(captured.d_index_k.float(), want.d_index_k.float(), rtol=1e-2, atol=1e-6)
        grad_loss.fill_(1.0)
