"""dsagen.dense_indexer_kl_backward, impl="reference": the dense warm-up loss and gradients in row / column blocks
(no [S_q, S_k] tensor) equal the three-op path (dense_attn_score_recompute -> dense_indexer_score_recompute ->
dense_indexer_backward) and autograd of the KL loss written out here; blocks of every size give the same result."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.reference.indexer_training import dense_indexer_kl_backward as reference

F64 = dict(dtype=torch.float64)
I32 = dict(dtype=torch.int32)
REF = dict(impl="reference")


def _inputs(b=2, sq=9, sk=9, h_q=4, h_kv=1, d=8, h_i=3, d_i=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, **F64) * scale).to(dtype)

    q, k = r(b, sq, h_q, d), r(b, sk, h_kv, d)
    lse = r(b, sq, h_q, scale=0.3).double() + 1.0          # any lse: the target normalizes per row
    return dict(q=q, k=k, lse=lse if dtype == torch.float64 else lse.float(),
                index_q=r(b, sq, h_i, d_i), weights=r(b, sq, h_i), index_k=r(b, sk, d_i))


def _three_op(x, *, softmax_scale, sm_scale, loss_coeff, grad_loss, ratio, offsets):
    """The loss and gradients through the materializing ops (FP64 inputs)."""
    attn, l1 = dsagen.dense_attn_score_recompute(x["q"], x["k"], x["lse"], softmax_scale, ratio=ratio,
                                                 q_causal_offsets=offsets, **REF)
    scores = dsagen.dense_indexer_score_recompute(x["index_q"], x["index_k"], x["weights"], ratio=ratio,
                                                  q_causal_offsets=offsets, sm_scale=sm_scale, **REF)
    grads = dsagen.dense_indexer_backward(x["index_q"], x["weights"], x["index_k"], attn, l1, scores.out,
                                          scores.denom, grad_loss=grad_loss, sm_scale=sm_scale,
                                          loss_coeff=loss_coeff, ratio=ratio, q_causal_offsets=offsets, **REF)
    valid = torch.isfinite(scores.out)
    tgt = torch.where(valid & (l1[..., None] > 0), attn / l1.clamp_min(1e-300)[..., None], torch.zeros_like(attn))
    logp = torch.where(valid, scores.out - scores.denom[..., None], torch.zeros_like(attn))
    pos = tgt > 0
    kl = torch.where(pos, tgt * (torch.log(torch.where(pos, tgt, torch.ones_like(tgt))) - logp), 0.0).sum()
    b, sq = x["index_q"].shape[:2]
    return loss_coeff / (b * sq) * kl, grads


@pytest.mark.parametrize("ratio,offsets", [(1, None), (2, [3, -1]), (4, [0, 9])])
@pytest.mark.parametrize("sm_scale,loss_coeff,grad_loss", [(1.0, 1.0, None), (0.6, 2.5, 0.4)])
@pytest.mark.parametrize("blocks", [(64, 1024), (2, 3), (5, 1)])
def test_equals_the_three_op_path(ratio, offsets, sm_scale, loss_coeff, grad_loss, blocks):
    x = _inputs(seed=ratio)
    off = None if offsets is None else torch.tensor(offsets, **I32)
    gl = None if grad_loss is None else torch.tensor([grad_loss], **F64)
    kw = dict(softmax_scale=0.35, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=gl, ratio=ratio)
    want_loss, want = _three_op(x, offsets=off, **kw)
    got = reference(x["q"], x["k"], x["lse"], x["index_q"], x["weights"], x["index_k"], q_causal_offsets=off,
                    row_block=blocks[0], col_block=blocks[1], **kw)
    torch.testing.assert_close(got.loss, want_loss, rtol=1e-10, atol=1e-13)
    for a, b in zip((got.d_index_q, got.d_weights, got.d_index_k), want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_gradients_are_autograd_of_the_loss():
    """grad_loss * loss differentiated by autograd (target constant) gives the returned gradients."""
    x = _inputs(b=1, sq=7, sk=6, seed=11)
    gl = torch.tensor(1.7, **F64)
    res = dsagen.dense_indexer_kl_backward(**x, softmax_scale=0.5, sm_scale=0.8, loss_coeff=1.3, grad_loss=gl,
                                           ratio=1, **REF)
    iq, w, ik = (x[n].detach().clone().requires_grad_() for n in ("index_q", "weights", "index_k"))
    attn, l1 = dsagen.dense_attn_score_recompute(x["q"], x["k"], x["lse"], 0.5, **REF)
    valid = torch.isfinite(attn)
    tgt = torch.where(valid, attn / l1[..., None], torch.zeros_like(attn))
    logits = 0.8 * torch.einsum("bth,bths->bts", w, torch.relu(torch.einsum("bthd,bsd->bths", iq, ik)))
    logp = torch.log_softmax(torch.where(valid, logits, torch.tensor(float("-inf"), **F64)), dim=-1)
    loss = 1.3 / 7 * torch.where(tgt > 0, tgt * (torch.log(tgt.clamp_min(1e-300)) - logp), 0.0).sum()
    torch.testing.assert_close(res.loss, loss.detach(), rtol=1e-10, atol=1e-13)
    auto = torch.autograd.grad(gl * loss, (iq, w, ik))
    for a, b in zip((res.d_index_q, res.d_weights, res.d_index_k), auto):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_empty_rows_and_low_precision():
    """Rows with no column (offsets pushing the limit to 0) add nothing; bf16 inputs give bf16 gradients close to
    the FP64 result and an FP32 loss."""
    x = _inputs(b=2, sq=6, sk=5, seed=3)
    off = torch.tensor([-6, 0], **I32)                      # batch 0: every row empty
    res = dsagen.dense_indexer_kl_backward(**x, ratio=1, q_causal_offsets=off, **REF)
    assert res.d_index_q[0].abs().max() == 0 and res.d_weights[0].abs().max() == 0
    lo = {n: (t.to(torch.bfloat16) if n != "lse" else t.float()) for n, t in x.items()}
    res16 = dsagen.dense_indexer_kl_backward(**lo, ratio=1, q_causal_offsets=off, **REF)
    ref64 = dsagen.dense_indexer_kl_backward(**{n: t.to(torch.bfloat16).double() if n != "lse" else t
                                                for n, t in x.items()}, ratio=1, q_causal_offsets=off, **REF)
    assert res16.loss.dtype == torch.float32 and res16.d_index_q.dtype == torch.bfloat16
    torch.testing.assert_close(res16.loss.double(), ref64.loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(res16[1:], ref64[1:]):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-3)


def test_inputs_are_not_modified():
    x = _inputs(seed=5)
    before = {n: t.clone() for n, t in x.items()}
    dsagen.dense_indexer_kl_backward(**x, ratio=2, **REF)
    for n, t in x.items():
        assert torch.equal(t, before[n]), n


@pytest.mark.parametrize("bad,err", [
    (lambda x: dict(q=x["q"][:, :5], lse=x["lse"][:, :5]), "q must have index_q's B and S_q"),
    (lambda x: dict(k=x["k"][:, :4]), "k must have index_k's S_k"),
    (lambda x: dict(lse=x["lse"][..., :2]), "lse"),
    (lambda x: dict(index_k=x["index_k"][..., :2]), "index_k"),
    (lambda x: dict(weights=x["weights"][..., :1]), "weights"),
    (lambda x: dict(index_q=x["index_q"].float()), "index_q"),
])
def test_bad_inputs_name_the_argument(bad, err):
    x = _inputs(seed=7)
    x.update(bad(x))
    with pytest.raises((TypeError, ValueError), match=err):
        dsagen.dense_indexer_kl_backward(**x, **REF)


def test_fused_refuses_cpu_inputs():
    """impl="fused" (the default) is refused on CPU tensors like every fused op; no silent reference fallback."""
    x = _inputs(seed=8)
    with pytest.raises(ValueError, match="fused"):
        dsagen.dense_indexer_kl_backward(**x)


def test_packed_segments_equal_the_three_op_path():
    """THD: an empty segment, rows after the last segment, offsets; equal to the three-op path in THD."""
    g = torch.Generator().manual_seed(21)
    total_q, total_k, h_q, d, h_i, d_i = 13, 12, 4, 8, 3, 5
    x = dict(q=torch.randn(total_q, h_q, d, generator=g, **F64), k=torch.randn(total_k, 1, d, generator=g, **F64),
             lse=torch.randn(total_q, h_q, generator=g, **F64) * 0.3 + 1.0,
             index_q=torch.randn(total_q, h_i, d_i, generator=g, **F64),
             weights=torch.randn(total_q, h_i, generator=g, **F64),
             index_k=torch.randn(total_k, d_i, generator=g, **F64))
    cu_q, cu_k = torch.tensor([0, 5, 5, 11], **I32), torch.tensor([0, 6, 8, 12], **I32)
    off = torch.tensor([2, 0, -1], **I32)
    thd = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_causal_offsets=off, ratio=2)
    gl = torch.tensor([0.7], **F64)
    got = dsagen.dense_indexer_kl_backward(**x, softmax_scale=0.4, sm_scale=0.9, loss_coeff=1.5, grad_loss=gl, **thd,
                                           **REF)
    attn, l1 = dsagen.dense_attn_score_recompute(x["q"], x["k"], x["lse"], 0.4, **thd, **REF)
    scores = dsagen.dense_indexer_score_recompute(x["index_q"], x["index_k"], x["weights"], sm_scale=0.9, **thd, **REF)
    want = dsagen.dense_indexer_backward(x["index_q"], x["weights"], x["index_k"], attn, l1, scores.out, scores.denom,
                                         grad_loss=gl, sm_scale=0.9, loss_coeff=1.5, **thd, **REF)
    for a, b in zip((got.d_index_q, got.d_weights, got.d_index_k), want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert got.d_index_q[11:].abs().max() == 0                      # rows after the last segment
    valid = torch.isfinite(scores.out)
    tgt = torch.where(valid & (l1[:, None] > 0), attn / l1.clamp_min(1e-300)[:, None], torch.zeros_like(attn))
    logp = torch.where(valid, scores.out - scores.denom[:, None], torch.zeros_like(attn))
    kl = torch.where(tgt > 0, tgt * (torch.log(tgt.clamp_min(1e-300)) - logp), 0.0).sum()
    torch.testing.assert_close(got.loss, 1.5 / total_q * kl, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="q must have index_q's total_q"):
        dsagen.dense_indexer_kl_backward(**dict(x, q=x["q"][:12], lse=x["lse"][:12]), **thd, **REF)
