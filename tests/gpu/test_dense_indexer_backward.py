"""GPU tests of the fused dense indexer backward kernel (indexer_bwd.dense_host, the sm_90a kernel of
DenseIndexerBwdSpec) against the plain-PyTorch reference of dsagen.dense_indexer_backward in FP64 on the same
bf16 / fp16 values and FP32 score rows: D 128 / 64, 64 heads and 16 padded, odd lengths, ratio 1 and 4, offsets that
empty rows or pass every key, B > 1, grad_loss on the device, inputs left unmodified.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.attn_score_recompute.spec import dense_config_for as attn_dense_config_for
from dsagen.kernels.indexer_bwd import dense_host, kl_host
from dsagen.kernels.indexer_bwd.spec import DenseIndexerBwdConfig, dense_config_for
from dsagen.kernels.lightning_indexer.spec import scores_config_for

ARCH = "sm_90a"
REQUIRED_SPECS = [dense_config_for(d, dt, ARCH, None).spec(d, dt, ARCH)
                  for d, dt in [(128, "bfloat16"), (64, "bfloat16"), (128, "float16")]] + [
    dense_config_for(128, "bfloat16", ARCH, None).spec(128, "bfloat16", ARCH, deterministic=True),
    dense_config_for(128, "bfloat16", ARCH, None).spec(128, "bfloat16", ARCH, kl_loss=True)] + [
    attn_dense_config_for(64, 512, "bfloat16", ARCH, None).spec(64, 512, "bfloat16", ARCH),
    *scores_config_for(64, 128, "bfloat16", ARCH).specs()]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_case(b, s_q, s_k, h, d, *, ratio=1, offsets=None, seed=0, dtype=torch.bfloat16):
    """Random indexer inputs and dense score rows: attention scores >= 0 with their L1 norms, indexer scores with
    their LSE, both -inf past each row's ratio-causal limit."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn((b, s_q, h, d), generator=gen) * 0.3).to(dtype)
    w = torch.randn((b, s_q, h), generator=gen).to(dtype)
    k = (torch.randn((b, s_k, d), generator=gen) * 0.3).to(dtype)
    offs = [0] * b if offsets is None else offsets
    lim = torch.stack([torch.clamp(torch.div(o + torch.arange(s_q) + 1, ratio, rounding_mode="floor"), 0, s_k)
                       for o in offs])
    vis = torch.arange(s_k)[None, None, :] < lim[..., None]
    attn = torch.rand((b, s_q, s_k), generator=gen).masked_fill(~vis, -math.inf)
    index = (torch.randn((b, s_q, s_k), generator=gen) * 2).masked_fill(~vis, -math.inf)
    norm = torch.where(vis, attn, 0.0).sum(-1)
    lse = torch.logsumexp(index, dim=-1)
    off_t = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    return [t.to(DEV) if t is not None else None for t in (q, w, k, attn, norm, index, lse, off_t)]


def check(q, w, k, attn, norm, index, lse, off, *, ratio=1, grad=None, sm_scale=0.7, loss_coeff=0.9,
          deterministic=False, config=None):
    before = [t.clone() for t in (q, w, k, attn, norm, index, lse)]
    kw = dict(grad_loss=grad, sm_scale=sm_scale, loss_coeff=loss_coeff, ratio=ratio, q_causal_offsets=off)
    got = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, deterministic=deterministic,
                                            config=config, **kw)
    want = dsagen.dense_indexer_backward(q.double(), w.double(), k.double(), attn.double(), norm.double(),
                                         index.double(), lse.double(), impl="reference", **kw)
    for name, g_, w_ in zip(("d_index_q", "d_weights", "d_index_k"), got, want):
        assert g_.shape == w_.shape, name
        err = (g_.double() - w_).abs().max().item()
        assert err <= 1e-2 * max(w_.abs().max().item(), 1e-30), (name, err, w_.abs().max().item())
    assert all(torch.equal(a, b) for a, b in zip(before, (q, w, k, attn, norm, index, lse)))
    return got


@pytest.mark.parametrize("d", [128, 64])
def test_matches_reference(d):
    q, w, k, attn, norm, index, lse, off = make_case(1, 301, 301, 64, d, seed=d)
    check(q, w, k, attn, norm, index, lse, off)


def test_ratio_offsets_batches_and_grad_loss():
    q, w, k, attn, norm, index, lse, off = make_case(3, 97, 150, 64, 128, ratio=4, offsets=[-40, 5000, 7], seed=2)
    check(q, w, k, attn, norm, index, lse, off, ratio=4, grad=torch.tensor([1.3], device=DEV))


def test_padded_heads_short_rows_and_fp16():
    check(*make_case(2, 33, 5, 16, 128, offsets=[-20, 0], seed=3))
    check(*make_case(1, 70, 130, 64, 128, seed=4, dtype=torch.float16))


def test_deterministic_matches_reference_and_reruns_bitwise():
    """deterministic=True: the per-slot kernel in blocks of query rows (the op's 1 GiB, and 7 rows per block),
    ratio 4, offsets, B 2; every gradient bitwise equal across calls and between the two block sizes."""
    q, w, k, attn, norm, index, lse, off = make_case(2, 95, 130, 64, 128, ratio=4, offsets=[5, -20], seed=51)
    a = check(q, w, k, attn, norm, index, lse, off, ratio=4, deterministic=True)
    small = DenseIndexerBwdConfig(slot_bytes=7 * 130 * 128 * 4)
    b = check(q, w, k, attn, norm, index, lse, off, ratio=4, deterministic=True, config=small)
    c = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, sm_scale=0.7, loss_coeff=0.9, ratio=4,
                                          q_causal_offsets=off, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])     # d_index_q, d_weights: per row either way
    assert torch.allclose(a[2].float(), b[2].float(), rtol=1e-5, atol=1e-6)   # other blocks, other sums


@pytest.mark.parametrize("ratio, offsets", [(1, [0, 20]), (4, [-9, 37])])
def test_kl_path_matches_reference(ratio, offsets):
    """kl_host (the three fused launches per block of whole rows; the loss summed by the backward kernel) against
    the reference dense_indexer_kl_backward: B 2, offsets (at ratio 4 the first rows see no key), a scratch that
    forces blocks of 40 rows."""
    gen = torch.Generator().manual_seed(12 + ratio)
    b, s_q, s_k = 2, 150, 150
    q = (torch.randn((b, s_q, 64, 512), generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn((b, s_k, 512), generator=gen) * 0.5).bfloat16().to(DEV)
    iq = (torch.randn((b, s_q, 64, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    w = torch.randn((b, s_q, 64), generator=gen).bfloat16().to(DEV)
    ik = (torch.randn((b, s_k, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    off = torch.tensor(offsets, dtype=torch.int32, device=DEV)
    scale = 512 ** -0.5
    # the true per-head attention LSE over each row's visible keys (0 for rows without keys: never read)
    sc = torch.einsum("bthd,bsd->bths", q.double(), k.double()) * scale
    lim = torch.stack([torch.clamp(torch.div(o + torch.arange(s_q, device=DEV) + 1, ratio, rounding_mode="floor"),
                                   0, s_k) for o in off])
    vis = torch.arange(s_k, device=DEV)[None, None, :] < lim[..., None]
    lse = torch.logsumexp(sc.masked_fill(~vis[:, :, None, :], -math.inf), dim=-1).nan_to_num(0.0, 0.0, 0.0).float()
    kw = dict(softmax_scale=scale, sm_scale=128 ** -0.5, loss_coeff=0.7, grad_loss=torch.tensor(1.2, device=DEV),
              ratio=ratio, q_causal_offsets=off)
    assert kl_host.block_rows(s_q, s_k, 2 * 4 * s_k * 40) == 40
    got = kl_host.dense_indexer_kl_backward(q, k, lse, iq, w, ik, scratch_bytes=2 * 4 * s_k * 40, **kw)
    want = dsagen.dense_indexer_kl_backward(q.double(), k.double(), lse.double(), iq.double(), w.double(),
                                            ik.double(), impl="reference", **kw)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-3 * abs(want.loss.item()) + 1e-6
    for name, g_, w_ in zip(("d_index_q", "d_weights", "d_index_k"), got[1:], want[1:]):
        err = (g_.double() - w_).abs().max().item()
        assert err <= 2e-2 * max(w_.abs().max().item(), 1e-30), (name, err)


def test_public_op_compile_and_graph():
    """dsagen.dense_indexer_backward (impl="fused", the default) runs this kernel: within the atomics' rounding of
    the host's result (d_index_k sums FP32 atomics; the others bitwise), under torch.compile(fullgraph=True) and in
    a captured CUDA graph with grad_loss on the device."""
    q, w, k, attn, norm, index, lse, off = make_case(2, 95, 95, 64, 128, ratio=4, offsets=[5, 40], seed=31)
    kw = dict(grad_loss=torch.tensor([1.3], device=DEV), sm_scale=0.5, loss_coeff=0.8, ratio=4, q_causal_offsets=off)
    want = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw)

    def same(got):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.allclose(got[2].float(), want[2].float(), rtol=1e-2, atol=1e-2 * want[2].float().abs().max())

    same(dsagen.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw))
    same(torch.compile(lambda *a: dsagen.dense_indexer_backward(*a, **kw), fullgraph=True)(
        q, w, k, attn, norm, index, lse))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw)
    graph.replay()
    torch.cuda.synchronize()
    same(captured)


def test_kl_public_op_compile_and_graph():
    """dsagen.dense_indexer_kl_backward (impl="fused") runs kl_host: within the atomics' rounding of kl_host's
    result, under torch.compile(fullgraph=True) and in a captured CUDA graph."""
    gen = torch.Generator().manual_seed(13)
    b, s_q, s_k = 1, 70, 70
    q = (torch.randn((b, s_q, 64, 576), generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn((b, s_k, 576), generator=gen) * 0.5).bfloat16().to(DEV)
    lse = (torch.rand((b, s_q, 64), generator=gen) + 3.0).to(DEV)
    iq = (torch.randn((b, s_q, 64, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    w = torch.randn((b, s_q, 64), generator=gen).bfloat16().to(DEV)
    ik = (torch.randn((b, s_k, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    kw = dict(softmax_scale=576 ** -0.5, sm_scale=128 ** -0.5, grad_loss=torch.tensor(0.9, device=DEV), ratio=1)
    want = kl_host.dense_indexer_kl_backward(q, k, lse, iq, w, ik, **kw)

    def close(got):
        assert torch.allclose(got.loss, want.loss, rtol=1e-5)
        for g_, w_ in zip(got[1:], want[1:]):
            assert torch.allclose(g_.float(), w_.float(), rtol=1e-2, atol=1e-2 * w_.float().abs().max())

    close(dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, **kw))
    close(torch.compile(lambda *a: dsagen.dense_indexer_kl_backward(*a, **kw), fullgraph=True)(q, k, lse, iq, w, ik))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, **kw)
    graph.replay()
    torch.cuda.synchronize()
    close(captured)


def test_packed_segments():
    """The THD layout through dsagen.dense_indexer_backward (one launch per segment on views of the (total_q, W)
    score rows, c over all total_q rows): segments without rows or keys, per-segment offsets, ratio 4, rows after
    the last segment, against the FP64 reference's THD form; inputs left unmodified."""
    gen = torch.Generator().manual_seed(43)
    cq, ck, offs, width = [0, 70, 70, 131, 200], [0, 90, 150, 150, 290], [30, 0, 7, 400], 160
    q = (torch.randn((205, 64, 128), generator=gen) * 0.3).bfloat16()
    w = torch.randn((205, 64), generator=gen).bfloat16()
    k = (torch.randn((290, 128), generator=gen) * 0.3).bfloat16()
    vis = torch.zeros((205, width), dtype=torch.bool)
    for b in range(4):
        for r in range(cq[b], cq[b + 1]):
            vis[r, :min(max((offs[b] + r - cq[b] + 1) // 4, 0), ck[b + 1] - ck[b])] = True
    attn = torch.rand((205, width), generator=gen).masked_fill(~vis, -math.inf)
    index = (torch.randn((205, width), generator=gen) * 2).masked_fill(~vis, -math.inf)
    norm = torch.where(vis, attn, 0.0).sum(-1)
    lse = torch.logsumexp(index, dim=-1)
    args = [t.to(DEV) for t in (q, w, k, attn, norm, index, lse)]
    before = [t.clone() for t in args]
    kw = dict(grad_loss=torch.tensor([1.1], device=DEV), sm_scale=0.6, loss_coeff=0.9, ratio=4,
              q_causal_offsets=torch.tensor(offs, dtype=torch.int32, device=DEV),
              cu_seqlens_q=torch.tensor(cq, dtype=torch.int32, device=DEV),
              cu_seqlens_k=torch.tensor(ck, dtype=torch.int32, device=DEV))
    got = dsagen.dense_indexer_backward(*args, **kw)
    want = dsagen.dense_indexer_backward(*[t.double() for t in args], impl="reference", **kw)
    for name, g_, w_ in zip(("d_index_q", "d_weights", "d_index_k"), got, want):
        assert g_.shape == w_.shape, name
        err = (g_.double() - w_).abs().max().item()
        assert err <= 1e-2 * max(w_.abs().max().item(), 1e-30), (name, err)
    assert all(torch.equal(a, b) for a, b in zip(before, args))
    assert not got.d_index_q[200:].any() and not got.d_weights[200:].any()


def test_kl_path_packed_segments():
    """dsagen.dense_indexer_kl_backward (impl="fused") in the THD layout: each segment through kl_host as a batch of
    one with the loss averaged over all total_q rows; an empty segment and rows after the last one; against the
    FP64 reference's THD form."""
    gen = torch.Generator().manual_seed(17)
    cq, ck = [0, 60, 60, 130], [0, 80, 80, 150]
    q = (torch.randn((134, 64, 512), generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn((150, 512), generator=gen) * 0.5).bfloat16().to(DEV)
    lse = (torch.rand((134, 64), generator=gen) + 3.0).to(DEV)
    iq = (torch.randn((134, 64, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    w = torch.randn((134, 64), generator=gen).bfloat16().to(DEV)
    ik = (torch.randn((150, 128), generator=gen) * 0.3).bfloat16().to(DEV)
    kw = dict(softmax_scale=512 ** -0.5, sm_scale=128 ** -0.5, loss_coeff=0.8, grad_loss=torch.tensor(1.1, device=DEV),
              ratio=1, q_causal_offsets=torch.tensor([5, 0, 40], dtype=torch.int32, device=DEV),
              cu_seqlens_q=torch.tensor(cq, dtype=torch.int32, device=DEV),
              cu_seqlens_k=torch.tensor(ck, dtype=torch.int32, device=DEV))
    got = dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, **kw)
    want = dsagen.dense_indexer_kl_backward(q.double(), k.double(), lse.double(), iq.double(), w.double(),
                                            ik.double(), impl="reference", **kw)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-3 * abs(want.loss.item()) + 1e-6
    for name, g_, w_ in zip(("d_index_q", "d_weights", "d_index_k"), got[1:], want[1:]):
        assert g_.shape == w_.shape, name
        err = (g_.double() - w_).abs().max().item()
        assert err <= 2e-2 * max(w_.abs().max().item(), 1e-30), (name, err)
    assert not got.d_index_q[130:].any()
