"""Small shapes of every fused kernel, for compute-sanitizer: each test launches one kernel family on the op's
default kernels (plus every kernel of the indexer's top-k plan) and checks its result against the reference, so
that a run under `compute-sanitizer --tool {memcheck,racecheck,synccheck,initcheck}` covers every fused kernel
(scripts/sanitize.sh runs the four tools on this file; notes/kernels/*.md record what each reported).

Shapes are small because racecheck instruments every shared-memory access: the sparse forward and backward (atomic
and deterministic) at H128 / D576 and H64 / D512 with a sink (3 CTAs looping over the items, tile counts 0..5,
adversarial ids; the backward with its grid barrier and KV-window ordering), the score recompute at the same
shapes, the lightning indexer at
T = 300 / topk 64 (unpacked causal and packed documents), each top-k kernel of the plan on slab rows whose tail
past the row's candidates is left unwritten (as the score kernel leaves it), invalid packed offsets (memcheck: no
access out of bounds whatever the offsets), indexer_scores' dense score and mask / LSE kernels (BSHD with odd
lengths and offsets, packed segments with empty ones), compactify and local_to_global.

Build first (CPU, with CuTe-DSL):  dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dsagen
import dsagen.kernels.sparse_mla.host as fused_sa
from dsagen.reference.indexer import weighted_relu_scores
from dsagen.spec import CompactifySpec, LocalToGlobalSpec
from dsagen.kernels.lightning_indexer.spec import config_for as indexer_config
from dsagen.kernels.lightning_indexer.spec import forward_topk_config_for, scores_config_for
from dsagen.kernels.sparse_mla.spec import FP8_CACHE_CONFIG, SparseAttnCombineSpec, SparseAttnFwdConfig, config_for
from dsagen.kernels.attn_score_recompute import host as rc_host
from dsagen.kernels.attn_score_recompute import dense_host as drc_host
from dsagen.kernels.attn_score_recompute.spec import config_for as rc_config_for
from dsagen.kernels.attn_score_recompute.spec import dense_config_for as drc_config_for
from dsagen.kernels.indexer_bwd import dense_host as dib_host
from dsagen.kernels.indexer_bwd import host as ib_host
from dsagen.kernels.indexer_bwd.spec import IndexerBwdConfig
from dsagen.kernels.indexer_bwd.spec import config_for as ib_config_for
from dsagen.kernels.indexer_bwd.spec import dense_config_for as dib_config_for
from dsagen.kernels.indexer_score_recompute import host as isr_host
from dsagen.kernels.indexer_topk.spec import config_for as topk_rows_plan
from dsagen.kernels.indexer_score_recompute.spec import config_for as isr_config_for
from dsagen.kernels.sparse_mla_bwd import host as bwd_host
from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdConfig
from dsagen.kernels.sparse_mla_bwd.spec import config_for as bwd_config_for
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.kernels.nsa.host import select_forward as nsa_select_forward
from dsagen.kernels.qsa.spec import backward_specs_for as qsa_backward_specs_for
from dsagen.kernels.qsa.spec import spec_for as qsa_spec_for
from dsagen.kernels.lightning_indexer.spec import decode_config_for
from dsagen.kernels.kv_fp8.spec import KvFp8CodecSpec
from dsagen.kernels.nsa.spec import NsaCmpDkvSpec, NsaCmpTopkSpec, NsaSelectDkvSpec
from dsagen.kernels.nsa.spec import cmp_dq_spec_for as nsa_cmp_dq_spec_for
from dsagen.kernels.nsa.spec import cmp_fwd_spec_for as nsa_cmp_fwd_spec_for
from dsagen.kernels.nsa.spec import cmp_importance_spec_for as nsa_cmp_importance_spec_for
from dsagen.kernels.nsa.spec import select_dq_spec_for as nsa_dq_spec_for
from dsagen.kernels.nsa.spec import select_fwd_spec_for as nsa_spec_for

ARCH = "sm_90a"
SPARSE_SHAPES = [(128, 576), (64, 512)]          # (H, D_qk) of the sparse forward, d_v 512
INDEXER_SHAPE = (64, 128)                        # (H, D) of the lightning indexer (DeepSeek-V3.2)
INDEXER_CONFIG = indexer_config(*INDEXER_SHAPE, "bfloat16", ARCH)   # the op's config for that shape
TOPK_SPECS = INDEXER_CONFIG.topk.specs()         # every top-k kernel the fused indexer may pick
REQUIRED_SPECS = [config_for(h, d, "bfloat16", None, ARCH, None).spec(h, d, "bfloat16", ARCH)
                  for h, d in SPARSE_SHAPES] + [FP8_CACHE_CONFIG.spec(128, 576, "bfloat16", ARCH, kv_fp8=True)] + [
    FP8_CACHE_CONFIG.spec(128, 576, "bfloat16", ARCH, kv_fp8=True, split_kv=True), SparseAttnCombineSpec(arch=ARCH)] + [
    *INDEXER_CONFIG.specs(), CompactifySpec(arch=ARCH), LocalToGlobalSpec(arch=ARCH)] + [
    bwd_config_for(h, d, "bfloat16", ARCH, None).spec(h, d, "bfloat16", ARCH, deterministic=det)
    for h, d in SPARSE_SHAPES for det in (False, True)] + [
    rc_config_for(h, d, "bfloat16", ARCH, None).spec(h, d, "bfloat16", ARCH) for h, d in SPARSE_SHAPES] + [
    isr_config_for(*INDEXER_SHAPE, "bfloat16", ARCH, None).spec(*INDEXER_SHAPE, "bfloat16", ARCH)] + [
    ib_config_for(INDEXER_SHAPE[1], "bfloat16", ARCH, None).spec(INDEXER_SHAPE[1], "bfloat16", ARCH,
                                                                 deterministic=det) for det in (False, True)] + [
    *topk_rows_plan(ARCH).specs()] + [
    RowScatterAddSpec(arch=ARCH, width=w) for w in sorted({INDEXER_SHAPE[1], *(d for _, d in SPARSE_SHAPES)})] + [
    *scores_config_for(*INDEXER_SHAPE, "bfloat16", ARCH).specs()] + [
    *forward_topk_config_for(*INDEXER_SHAPE, "bfloat16", ARCH).specs(),
    *forward_topk_config_for(*INDEXER_SHAPE, "float8_e4m3fn", ARCH).specs(),
    *forward_topk_config_for(*INDEXER_SHAPE, "bfloat16", ARCH, finish_in_topk=False).specs()] + [
    drc_config_for(h, d, "bfloat16", ARCH, None).spec(h, d, "bfloat16", ARCH) for h, d in SPARSE_SHAPES] + [
    dib_config_for(INDEXER_SHAPE[1], "bfloat16", ARCH, None).spec(INDEXER_SHAPE[1], "bfloat16", ARCH, deterministic=det)
    for det in (False, True)] + [
    dib_config_for(INDEXER_SHAPE[1], "bfloat16", ARCH, None).spec(INDEXER_SHAPE[1], "bfloat16", ARCH, kl_loss=True)] + [
    nsa_spec_for(g, 128, 128, 64, 16, "bfloat16", ARCH) for g in (1, 16)] + [
    nsa_dq_spec_for(g, 128, 128, 64, 16, "bfloat16", ARCH) for g in (1, 16)] + [
    NsaSelectDkvSpec(arch=ARCH, group=g) for g in (1, 16)] + [
    NsaSelectDkvSpec(arch=ARCH, group=g, stages=3, overlap=True) for g in (1, 16)] + [
    nsa_cmp_fwd_spec_for(g, 128, 128, 1, "bfloat16", ARCH) for g in (1, 16)] + [
    nsa_spec_for(g, 128, 128, 32, 19, "bfloat16", ARCH) for g in (1, 16)] + [
    nsa_cmp_importance_spec_for(g, 128, 1, "bfloat16", ARCH) for g in (1, 16)] + [NsaCmpTopkSpec(arch=ARCH)] + [
    nsa_spec_for(g, 128, 128, 64, 19, "bfloat16", ARCH) for g in (1, 16)] + [
    nsa_dq_spec_for(g, 128, 128, 64, 19, "bfloat16", ARCH) for g in (1, 16)] + [
    nsa_cmp_dq_spec_for(g, 128, 128, 1, "bfloat16", ARCH) for g in (1, 16)] + [
    NsaCmpDkvSpec(arch=ARCH, group=g) for g in (1, 16)] + [
    f(g, 128, 128, bs, 16, "bfloat16", ARCH) for f in (nsa_spec_for, nsa_dq_spec_for)
    for g, bs in ((16, 32), (1, 128))] + [qsa_spec_for(12, 256, 256, "bfloat16", ARCH, bitmap=b)
                                          for b in (False, True)] + [
    s for b in (False, True) for s in qsa_backward_specs_for(12, 256, 256, "bfloat16", ARCH, bitmap=b)] + [
    *decode_config_for(*INDEXER_SHAPE, "float8_e4m3fn", ARCH).specs()] + [
    KvFp8CodecSpec(arch=ARCH, dequantize=d) for d in (False, True)]
FORWARD_TOPK_SPECS = (*forward_topk_config_for(*INDEXER_SHAPE, "bfloat16", ARCH).topk.specs(),
                      *forward_topk_config_for(*INDEXER_SHAPE, "bfloat16", ARCH, finish_in_topk=False).topk.specs())

gpu = pytest.mark.gpu
DEV = "cuda"


# ---------------------------------------------------------------------------------------- sparse forward
def _sparse_inputs(s_q, h, d_qk, k, n_kv, seed):
    """Adversarial ids (-1, other negatives, >= n_kv, duplicates; row 1 all invalid), a sink, topk_length with
    tile counts 0..5 over the rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((s_q, h, d_qk), generator=gen).bfloat16()
    kv = torch.randn((n_kv, d_qk), generator=gen).bfloat16()
    ids = torch.randint(0, n_kv, (s_q, k), generator=gen, dtype=torch.int32)
    u = torch.rand((s_q, k), generator=gen)
    ids = torch.where(u < 0.1, torch.full_like(ids, -1), ids)
    ids = torch.where((u >= 0.1) & (u < 0.15), torch.full_like(ids, n_kv + 3), ids)
    ids = torch.where((u >= 0.15) & (u < 0.2), torch.full_like(ids, -1000), ids)
    ids = torch.where((u >= 0.2) & (u < 0.3), ids[:, :1].expand_as(ids), ids)     # duplicates
    ids[1] = -1
    sink = torch.randn(h, generator=gen) * 2
    tl = torch.tensor([0, 1, 65, 129, 257, k], dtype=torch.int32)[:s_q]
    return [t.to(DEV) for t in (q, kv, ids, sink, tl)]


@gpu
@pytest.mark.parametrize("h,d_qk", SPARSE_SHAPES, ids=[f"h{h}_d{d}" for h, d in SPARSE_SHAPES])
def test_sparse_forward(h, d_qk):
    """The op's kernel, 3 CTAs looping over 6 query rows' items (the barriers' phases and the hand-over between
    items; SparseAttnFwdConfig.grid through the flat entry's config=), against the reference."""
    q, kv, ids, sink, tl = _sparse_inputs(6, h, d_qk, 320, 900, seed=h + d_qk)
    scale = d_qk ** -0.5
    out, lse, m = fused_sa.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, softmax_scale=scale, d_v=512,
                                            config=SparseAttnFwdConfig(grid=3))
    r_out, r_lse, r_m = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, softmax_scale=scale,
                                                impl="reference")
    torch.testing.assert_close(out.float(), r_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, r_lse.float(), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(m, r_m.float(), atol=1e-4, rtol=1e-5)
    assert (out[:2] == 0).all() and torch.isposinf(lse[:2]).all()      # topk_length 0; row 1 without a valid id


@gpu
@pytest.mark.parametrize("shared", [False, True], ids=["one_cta", "shared_dequant"])
@pytest.mark.parametrize("split", [None, (3, 128)], ids=["whole", "split"])
def test_sparse_decode_fp8(split, shared):
    """The FP8 cache kernel (its producer dequantizes the gathered rows), 3 CTAs (shared_dequant: one cluster of
    two) looping over 6 query rows' items (split: 18 items of 128-slot ranges, some empty by the lengths, and the
    combine kernel), adversarial ids and lengths as test_sparse_forward's, against the reference on the
    dequantized rows."""
    q, kv, ids, sink, tl = _sparse_inputs(6, 128, 576, 320, 900, seed=11)
    f = torch.tensor([4.0 ** -(c // 128) if c < 512 else 1.0 for c in range(576)], device=kv.device)
    rows = dsagen.quantize_kv_fp8((kv.float() * f).bfloat16(), impl="reference")   # [900, 656] uint8, 4 scales
    config = replace(FP8_CACHE_CONFIG, grid=3, shared_dequant=shared)
    out, lse, _ = fused_sa._launch(q, rows, ids, sink, tl, 0.05, 512, config, split=split)
    r_out, r_lse, _ = dsagen.sparse_attention(q, dsagen.dequantize_kv_fp8(rows, impl="reference"), ids,
                                              attn_sink=sink, topk_length=tl, softmax_scale=0.05, impl="reference")
    torch.testing.assert_close(out.float(), r_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, r_lse.float(), atol=2e-4, rtol=1e-4)
    assert (out[:2] == 0).all() and torch.isposinf(lse[:2]).all()


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("h,d_qk", SPARSE_SHAPES, ids=[f"h{h}_d{d}" for h, d in SPARSE_SHAPES])
def test_sparse_backward(h, d_qk, deterministic):
    """The backward's kernel, 3 CTAs looping over 6 query rows' items with the grid barrier and ids ordered by
    256-row KV windows (SparseAttnBwdConfig through the flat entry's config=), adversarial ids and lengths, against
    the reference backward on the reference forward's out / lse."""
    q, kv, ids, sink, tl = _sparse_inputs(6, h, d_qk, 320, 900, seed=h + d_qk + 1)
    scale = d_qk ** -0.5
    out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, softmax_scale=scale,
                                          impl="reference")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    out = out.bfloat16()
    dq, dkv, d_sink = bwd_host.sparse_attention_backward(
        q, kv, out, dout, lse.float(), ids, attn_sink=sink, topk_length=tl, softmax_scale=scale, d_v=512,
        deterministic=deterministic, config=SparseAttnBwdConfig(grid=3, bucket_rows=256))
    r_dq, r_dkv, r_sink = dsagen.sparse_attention_backward(q, kv, out, dout, lse, ids, attn_sink=sink, topk_length=tl,
                                                           softmax_scale=scale, impl="reference")
    for got, want in ((dq, r_dq), (dkv, r_dkv), (d_sink, r_sink)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 1e-2 * max(want.float().abs().max().item(), 1e-6)
    assert (dq[:2] == 0).all()                       # topk_length 0; row 1 without a valid id


@gpu
@pytest.mark.parametrize("h,d_qk", SPARSE_SHAPES, ids=[f"h{h}_d{d}" for h, d in SPARSE_SHAPES])
def test_attn_score_recompute(h, d_qk):
    """The score recompute's kernel, 3 CTAs looping over 6 query rows, adversarial ids and lengths, against the
    reference."""
    q, kv, ids, sink, tl = _sparse_inputs(6, h, d_qk, 320, 900, seed=h + d_qk + 2)
    scale = d_qk ** -0.5
    _, lse, _ = dsagen.sparse_attention(q, kv, ids, topk_length=tl, softmax_scale=scale, impl="reference")
    args = (q[None], kv[None], lse[None].float(), ids[None], scale)
    op = rc_config_for(h, d_qk, "bfloat16", ARCH, None)             # the op's kernel on 3 CTAs
    got = rc_host.sparse_attn_score_recompute(*args, topk_length=tl[None], config=replace(op, grid=3))
    want = dsagen.sparse_attn_score_recompute(*args, topk_length=tl[None], impl="reference")
    assert (got - want).abs().max().item() <= 1e-2 * max(want.abs().max().item(), 1e-6)
    assert (got[0, :2] == 0).all()                   # topk_length 0; row 1 without a valid id


DENSE_ATTN_CASES = [(h, d, False) for h, d in SPARSE_SHAPES] + [(64, 512, True)]


@gpu
@pytest.mark.parametrize("h,d_qk,row_pairs", DENSE_ATTN_CASES,
                         ids=[f"h{h}_d{d}" + ("_pairs" if p else "") for h, d, p in DENSE_ATTN_CASES])
def test_dense_attn_score_recompute(h, d_qk, row_pairs):
    """The dense score recompute's kernel, 3 CTAs looping over 2 x 5 query rows, ratio 4, offsets that empty rows
    (-9) and reach past the keys (400), unaligned row ends (S_k 131), against the reference; row_pairs: the 64-head
    kernel with two rows per item (T 5 odd: a last row alone)."""
    gen = torch.Generator().manual_seed(h + d_qk + 3 + int(row_pairs))
    q = (torch.randn((2, 5, h, d_qk), generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn((2, 131, d_qk), generator=gen) * 0.5).bfloat16().to(DEV)
    lse = (torch.rand((2, 5, h), generator=gen) * 4 + 2).to(DEV)
    off = torch.tensor([-9, 400], dtype=torch.int32, device=DEV)
    scale = d_qk ** -0.5
    op = drc_config_for(h, d_qk, "bfloat16", ARCH, None)             # the op's kernel on 3 CTAs
    got, den = drc_host.dense_attn_score_recompute(q, k, lse, scale, ratio=4, q_causal_offsets=off,
                                                   config=replace(op, grid=3, row_pairs=row_pairs))
    want, want_den = dsagen.dense_attn_score_recompute(q, k, lse, scale, ratio=4, q_causal_offsets=off,
                                                       impl="reference")
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = ~torch.isneginf(want)
    assert (got[fin] - want[fin]).abs().max().item() <= 1e-2 * max(want[fin].abs().max().item(), 1e-6)
    assert (den - want_den).abs().max().item() <= 1e-2 * max(want_den.abs().max().item(), 1e-6)


@gpu
@pytest.mark.parametrize("mode", ["atomic", "deterministic", "kl"])
def test_dense_indexer_backward(mode):
    """The dense indexer backward's kernel at the DeepSeek-V3.2 indexer shape, 3 CTAs looping over 2 x 5 query rows,
    ratio 4, offsets that empty rows (-9) and pass every key (400), S_k 131 (a partial last tile), against the
    reference; deterministic: the per-slot rows in blocks of 2 query rows; kl: the atomic kernel with the KL loss
    partials (the fused loss path's launch, kl_block_backward), its KL sum against the reference's."""
    import math

    gen = torch.Generator().manual_seed(11)
    h, d = INDEXER_SHAPE
    q = (torch.randn((2, 5, h, d), generator=gen) * 0.3).bfloat16().to(DEV)
    w = torch.randn((2, 5, h), generator=gen).bfloat16().to(DEV)
    k = (torch.randn((2, 131, d), generator=gen) * 0.3).bfloat16().to(DEV)
    lim = torch.stack([torch.clamp(torch.div(o + torch.arange(5) + 1, 4, rounding_mode="floor"), 0, 131)
                       for o in (-9, 400)])
    vis = (torch.arange(131)[None, None, :] < lim[..., None]).to(DEV)
    attn = torch.rand((2, 5, 131), generator=gen).to(DEV).masked_fill(~vis, -math.inf)
    index = torch.randn((2, 5, 131), generator=gen).to(DEV).masked_fill(~vis, -math.inf)
    norm, lse = torch.where(vis, attn, 0.0).sum(-1), torch.logsumexp(index, dim=-1)
    off = torch.tensor([-9, 400], dtype=torch.int32, device=DEV)
    args = (q, w, k, attn, norm, index, lse)
    kw = dict(sm_scale=0.5, ratio=4, q_causal_offsets=off)
    cfg = replace(dib_config_for(d, "bfloat16", ARCH, None), grid=3, slot_bytes=2 * 131 * d * 4)
    want = dsagen.dense_indexer_backward(*args, impl="reference", **kw)
    if mode == "kl":
        *got, kl = dib_host.kl_block_backward(*args, **kw)
        tgt = torch.where(vis, attn, 0.0).double() / torch.where(norm > 0, norm, math.inf).double()[..., None]
        terms = tgt * (torch.log(tgt) - (index.double() - lse.double()[..., None]))
        terms = terms[tgt > 0]
        assert abs(kl.item() - terms.sum().item()) <= 1e-4 * terms.abs().sum().item()
    else:
        got = dib_host.dense_indexer_backward(*args, config=cfg, deterministic=mode == "deterministic", **kw)
    for g_, w_ in zip(got, want):
        assert (g_.float() - w_.float()).abs().max().item() <= 2e-2 * max(w_.float().abs().max().item(), 1e-6)


@gpu
def test_indexer_score_recompute():
    """The indexer score recompute's kernel at the DeepSeek-V3.2 indexer shape, 3 CTAs looping over 6 query rows,
    adversarial ids (-1, other negatives, >= S_k, duplicates; row 1 all invalid) and lengths, against the
    reference."""
    h, d = INDEXER_SHAPE
    gen = torch.Generator().manual_seed(17)
    _, _, ids, _, tl = _sparse_inputs(6, 64, 512, 320, 900, seed=19)
    q = torch.randn((1, 6, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((1, 900, d), generator=gen).bfloat16().to(DEV)
    w = (torch.randn((1, 6, h), generator=gen) * h ** -0.5).bfloat16().to(DEV)
    args = (q, k, w, ids[None])
    kw = dict(topk_length=tl[None], sm_scale=d ** -0.5)
    op = isr_config_for(h, d, "bfloat16", ARCH, None)                # the op's kernel on 3 CTAs
    got = isr_host.sparse_indexer_score_recompute(*args, **kw, config=replace(op, grid=3))
    want = dsagen.sparse_indexer_score_recompute(*args, **kw, impl="reference")
    assert (got - want).abs().max().item() <= 2e-3 * max(want.abs().max().item(), 1e-6)
    assert (got[0, :2] == 0).all()                   # topk_length 0; row 1 without a valid id


@gpu
@pytest.mark.parametrize("deterministic,ordered", [(False, False), (False, True), (True, False)],
                         ids=["atomic", "atomic-ordered", "deterministic"])
def test_indexer_backward(deterministic, ordered):
    """The indexer backward's kernel at the DeepSeek-V3.2 indexer shape, 3 CTAs looping over 6 query rows,
    adversarial ids (-1, other negatives, >= S_k, duplicates; row 1 all invalid), against the reference; ordered:
    the ids ordered by 64-row key windows (the ordering kernel with its slot permutation)."""
    h, d = INDEXER_SHAPE
    gen = torch.Generator().manual_seed(23)
    _, _, ids, _, _ = _sparse_inputs(6, 64, 512, 320, 900, seed=29)
    q = torch.randn((1, 6, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((1, 900, d), generator=gen).bfloat16().to(DEV)
    w = (torch.randn((1, 6, h), generator=gen) * h ** -0.5).bfloat16().to(DEV)
    tgt = torch.softmax(torch.randn((1, 6, 320), generator=gen), -1).to(DEV)
    p = torch.softmax(torch.randn((1, 6, 320), generator=gen), -1).to(DEV)
    args = (q, w, k, tgt, p, ids[None])
    order = dict(bucket_rows=64, order_min_bytes=0) if ordered else dict(bucket_rows=None)
    got = ib_host.indexer_backward(*args, sm_scale=0.1, deterministic=deterministic,
                                   config=IndexerBwdConfig(grid=3, chunk_bytes=1 << 20, **order))
    want = dsagen.indexer_backward(*args, sm_scale=0.1, impl="reference")
    for g_, w_ in zip(got, want):
        assert (g_.float() - w_.float()).abs().max().item() <= 1e-2 * max(w_.float().abs().max().item(), 1e-30)
    assert (got[0][0, 1] == 0).all()                   # d_index_q of row 1, which has no valid id


@gpu
@pytest.mark.parametrize("n_cols", [301, 5000, 20000, 70000])
def test_indexer_topk(n_cols):
    """Every kernel of the standalone top-k's plan (3 rows: one wave, so the wide entries; and 140 rows past one
    wave for the narrow ones), ties, lengths 0 / short / past the width, a width that is not a multiple of 4,
    against the reference's sets."""
    gen = torch.Generator().manual_seed(n_cols)
    for n_rows in (3, 140):
        x = torch.randint(0, 50, (n_rows, n_cols), generator=gen).float().to(DEV)
        lens = torch.randint(0, n_cols + 10, (n_rows,), generator=gen, dtype=torch.int32)
        lens[0] = 0
        got = dsagen.indexer_topk(x, lens.to(DEV), 2048)
        # The reference runs on the CPU: torch.topk's multi-block CUDA kernel reads its own unwritten scratch,
        # which initcheck would report next to (and, by their number, instead of) the fused kernel's reads.
        want = dsagen.indexer_topk(x.cpu(), lens, 2048, impl="reference")
        big = 2**31 - 1
        assert torch.equal(torch.where(got.indices < 0, big, got.indices).sort(-1).values.cpu(),
                           torch.where(want.indices < 0, big, want.indices).sort(-1).values)


# ---------------------------------------------------------------------------------------- lightning indexer
def _indexer_inputs(t, s, gen):
    h, d = INDEXER_SHAPE
    q = torch.randn((1, t, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((1, s, d), generator=gen).bfloat16().to(DEV)
    w = torch.randn((1, t, h), generator=gen).bfloat16().to(DEV)
    return q, k, w


def _check_selection(out, q, k, w, lo, hi, topk):
    """Every row: ascending distinct ids in [0, hi - lo), -1 padding exactly past min(n, topk), and no unselected
    candidate scoring above a selected one (within one bf16 ulp of the row's largest |score|)."""
    h, d = INDEXER_SHAPE
    scores = (weighted_relu_scores(q.float(), k.float(), w.float()) / (h * d) ** 0.5)[0].cpu()
    out = out[0].cpu().long()
    for r in range(out.shape[0]):
        a, z = int(lo[r]), int(hi[r])
        n = z - a
        want = min(n, topk)
        sel = out[r, :want]
        assert (out[r, want:] == -1).all(), f"row {r}: -1 padding must start at {want}"
        assert ((sel >= 0) & (sel < n)).all() and (sel[1:] > sel[:-1]).all(), f"row {r}: bad ids {sel.tolist()}"
        if n > topk:
            sc = scores[r, a:z]
            mask = torch.zeros(n, dtype=torch.bool)
            mask[sel] = True
            assert float(sc[mask].min()) >= float(sc[~mask].max()) - 2.0 ** -8 * float(sc.abs().max()), f"row {r}"


@gpu
@pytest.mark.parametrize("t", [300, 1100])
def test_lightning_indexer_causal(t):
    """topk 64, causal: the score kernel and the 128-thread top-k (rows of 1..T candidates); T = 1100 gives the
    persistent score CTAs 4-5 work items each (the header ring's slots reused)."""
    gen = torch.Generator().manual_seed(t)
    topk = 64
    q, k, w = _indexer_inputs(t, t, gen)
    out = dsagen.lightning_indexer(q, k, w, topk, causal=True, impl="fused")
    torch.cuda.synchronize()
    _check_selection(out, q, k, w, torch.zeros(t), torch.arange(1, t + 1), topk)


@gpu
def test_lightning_indexer_packed():
    """Packed documents (empty ones, a 1-token one, rows past the last offset, inactive pool capacity)."""
    gen = torch.Generator().manual_seed(301)
    lens = [1, 0, 150, 0, 97, 9]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t, s, topk = int(cu[-1]) + 11, int(cu[-1]) + 5, 64
    q, k, w = _indexer_inputs(t, s, gen)
    out = dsagen.lightning_indexer(q, k, w, topk, causal=True, cu_seqlens=cu.to(DEV), cu_seqlens_k=cu.to(DEV),
                                   impl="fused")
    torch.cuda.synchronize()
    lo = torch.zeros(t, dtype=torch.int64)
    hi = torch.zeros(t, dtype=torch.int64)
    for d_ in range(len(lens)):
        for tt in range(int(cu[d_]), int(cu[d_ + 1])):
            lo[tt], hi[tt] = int(cu[d_]), tt + 1
    _check_selection(out, q, k, w, lo, hi, topk)


def _scores_check(got, lse, q, k, w, **kw):
    """indexer_scores' fused result against the FP64 reference: the same -inf mask, values and LSE close."""
    qd, kd, wd = q.double(), k.double(), w.double()
    ref = dsagen.indexer_scores(qd, kd, wd, impl="reference", **kw)
    mag = dsagen.indexer_scores(qd, kd, wd.abs(), impl="reference", **kw)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    valid = ~torch.isneginf(ref)
    assert ((got.double()[valid] - ref[valid]).abs() <= 3e-5 * mag[valid] + 1e-5).all()
    lse_ref = ref.logsumexp(dim=-1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    full = ~torch.isneginf(lse_ref)
    assert ((lse.double()[full] - lse_ref[full]).abs() <= 1e-3 + 1e-5 * lse_ref[full].abs()).all()


@gpu
def test_indexer_scores_bshd():
    """indexer_scores, B = 2, odd S_q (per-batch score launches), ratio 4, one negative offset (empty rows) and one
    past the KV prefix, with the LSE: the dense_scores score kernel and the mask / LSE kernel."""
    gen = torch.Generator().manual_seed(311)
    h, d = INDEXER_SHAPE
    q = torch.randn((2, 151, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((2, 70, d), generator=gen).bfloat16().to(DEV)
    w = torch.randn((2, 151, h), generator=gen).bfloat16().to(DEV)
    off = torch.tensor([-40, 300], dtype=torch.int32, device=DEV)
    got, lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, impl="fused")
    torch.cuda.synchronize()
    _scores_check(got, lse, q, k, w, ratio=4, q_causal_offsets=off)


@gpu
def test_indexer_scores_packed():
    """indexer_scores THD: empty segments on either side, rows after the last offset, key rows in no segment."""
    gen = torch.Generator().manual_seed(312)
    h, d = INDEXER_SHAPE
    cu_q = torch.tensor([0, 3, 3, 120, 121, 200], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 2, 9, 9, 40, 90], dtype=torch.int32, device=DEV)
    q = torch.randn((205, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((93, d), generator=gen).bfloat16().to(DEV)
    w = torch.randn((205, h), generator=gen).bfloat16().to(DEV)
    kw = dict(ratio=1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got, lse = dsagen.indexer_scores(q, k, w, return_lse=True, impl="fused", **kw)
    torch.cuda.synchronize()
    _scores_check(got, lse, q, k, w, **kw)


#: packed offsets that break the documented invariants: (cu_seqlens, cu_seqlens_k) for T = 64 rows, S = 48
INVALID_OFFSETS = {
    "decreasing": ([0, 40, 20, 64], [0, 30, 10, 48]),
    "negative": ([0, -5, 30, 64], [0, -100, 20, 48]),
    "past_end": ([0, 30, 5000, 2**31 - 1], [0, 40, 900, 2**31 - 1]),
    "huge_negative": ([0, 20, 40, 64], [-2**31, 2**31 - 1, -2**31, 2**31 - 1]),
    "span_mismatch": ([0, 10, 40, 64], [0, 30, 31, 48]),
    "nonzero_start": ([7, 20, 40, 64], [5, 10, 30, 48]),
}


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", list(INVALID_OFFSETS))
def test_indexer_invalid_offsets_stay_in_bounds(case, causal):
    """Offsets the fused path never reads on the host (check_offsets off): the kernels must still only touch their
    buffers (memcheck) and write every output element, each an id in [-1, S) (the result is otherwise
    unspecified)."""
    cu, cu_k = (torch.tensor(v, dtype=torch.int32, device=DEV) for v in INVALID_OFFSETS[case])
    gen = torch.Generator().manual_seed(302)
    q, k, w = _indexer_inputs(64, 48, gen)
    out = torch.full((1, 64, 16), -7, dtype=torch.int32, device=DEV)
    out = dsagen.lightning_indexer(q, k, w, 16, causal=causal, cu_seqlens=cu, cu_seqlens_k=cu_k, impl="fused",
                                   check_offsets=False)
    torch.cuda.synchronize()
    assert out.shape == (1, 64, 16)
    assert ((out >= -1) & (out < 48)).all()
    with pytest.raises(ValueError):
        dsagen.lightning_indexer(q, k, w, 16, causal=causal, cu_seqlens=cu, cu_seqlens_k=cu_k, impl="fused",
                                 check_offsets=True)


@gpu
@pytest.mark.parametrize("spec", TOPK_SPECS, ids=[s.name() for s in TOPK_SPECS])
def test_topk_kernel(spec):
    """Each top-k kernel of the plan alone, on slab rows written only over their candidates (the score kernel
    leaves a row's tail up to the next 16-byte boundary unwritten): rows with n <= topk, short rows, rows long
    enough for the sampled threshold and the compacted entries; exact against a sort of the keys."""
    from dsagen.jit import get_kernel

    kern = get_kernel(spec, 0)
    gen = torch.Generator().manual_seed(303)
    lens, topk = [5, 64, 65, 301, 1027, 4099, 13001], 64
    rows = len(lens)
    ld = -(-max(lens) // 4) * 4
    slab = torch.empty((rows, ld), dtype=torch.float32, device=DEV)
    vals = [torch.randn(n, generator=gen) for n in lens]
    for r, n in enumerate(lens):
        slab[r, :n].copy_(vals[r])
    cu_q = torch.arange(rows + 1, dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEV)
    out = torch.empty((1, rows, topk), dtype=torch.int32, device=DEV)
    # args: slab, out, cu_q, cu_k, n_docs, T, S, n_tblk, blk0, qc, nrows, topk, causal, ratio, ld_slab
    kern.launch(slab, out, cu_q, cu_k, rows, rows, int(cu_k[-1]), rows, 0, 1, rows, topk, 0, 1, ld)
    torch.cuda.synchronize()
    got = out[0].cpu().long()
    for r, n in enumerate(lens):
        if n <= topk:
            want = torch.where(torch.arange(topk) < n, torch.arange(topk), -1)
        else:
            want = torch.sort(torch.sort(vals[r], descending=True, stable=True).indices[:topk]).values
        assert torch.equal(got[r], want), f"n={n}: {got[r][:16].tolist()} vs {want[:16].tolist()}"


@gpu
@pytest.mark.parametrize("spec", FORWARD_TOPK_SPECS, ids=[s.name() for s in FORWARD_TOPK_SPECS])
def test_forward_topk_kernel(spec):
    """Each forward top-k kernel (indexer_forward_topk's plan) alone on slab rows written only over their valid
    columns, one row per batch element with causal offsets that give n <= topk, short rows and rows long enough for
    the sampled threshold: ids exact against a sort, values the selected scores, -1 / -inf padding; the finishing
    form's softmax, LSE and global ids too."""
    from dsagen.jit import get_kernel

    kern = get_kernel(spec, 0)
    gen = torch.Generator().manual_seed(304)
    lens, topk, s_k = [5, 64, 65, 301, 1027, 4099, 13001], 64, 13001
    rows = len(lens)
    ld = -(-s_k // 4) * 4
    slab = torch.empty((rows, ld), dtype=torch.float32, device=DEV)
    vals = [torch.randn(n, generator=gen) for n in lens]
    for r, n in enumerate(lens):
        slab[r, :n].copy_(vals[r])
    dummy = torch.zeros(4, dtype=torch.int32, device=DEV)
    off = torch.tensor(lens, dtype=torch.int32, device=DEV) - 1          # row t = 0 of batch b sees lens[b] keys
    out = torch.empty((rows, 1, topk), dtype=torch.int32, device=DEV)
    val = torch.empty((rows, 1, topk), dtype=torch.float32, device=DEV)
    # args: slab, out, values, cu_q, cu_k, q_off, n_docs, T, S, n_tblk, blk0, qc, nrows, topk, ratio, has_off, ld
    args = (slab, out, val, dummy, dummy, off, 0, 1, s_k, 1, 0, 1, rows, topk, 1, 1, ld)
    soft = torch.empty((rows, 1, topk), dtype=torch.float32, device=DEV)
    lse = torch.empty((rows, 1), dtype=torch.float32, device=DEV)
    if spec.softmax:              # the finishing form: + softmax, lse, want_soft, want_lse, global_ids
        kern.launch(*args, soft, lse, 1, 1, 1)
    else:
        kern.launch(*args)
    torch.cuda.synchronize()
    got, got_v = out[:, 0].cpu().long(), val[:, 0].cpu()
    for r, n in enumerate(lens):
        if n <= topk:
            want = torch.where(torch.arange(topk) < n, torch.arange(topk), -1)
        else:
            want = torch.sort(torch.sort(vals[r], descending=True, stable=True).indices[:topk]).values
        want_v = torch.where(want >= 0, vals[r][want.clamp(min=0)], float("-inf"))
        assert torch.equal(got_v[r], want_v)
        if spec.softmax:          # row r is batch element r: global ids r * S + local
            want = torch.where(want >= 0, want + r * s_k, want)
            p = torch.softmax(want_v.double(), -1)
            assert (soft[r, 0].cpu().double() - p).abs().max() <= 1e-6
            assert abs(lse[r, 0].item() - torch.logsumexp(want_v.double(), -1).item()) <= 1e-5
        assert torch.equal(got[r], want), f"n={n}: {got[r][:16].tolist()} vs {want[:16].tolist()}"


def _forward_topk_check(res, q, k, w, top_k, **kw):
    """indexer_forward_topk's fused result: the ids are the top-k of the fused indexer_scores rows (exact), the
    logits those scores, the softmax sums to 1 on rows with a valid slot."""
    scores = dsagen.indexer_scores(q, k, w, impl="fused", **kw)
    packed = "cu_seqlens_q" in kw
    flat = scores.reshape(-1, scores.shape[-1])
    ids = res.indices.reshape(flat.shape[0], top_k).long()
    valid = ids >= 0
    if not packed:
        ids = torch.where(valid, ids - (torch.arange(flat.shape[0], device=DEV) // q.shape[1])[:, None]
                          * k.shape[1], ids)
    else:
        cu_q, cu_k = kw["cu_seqlens_q"].long(), kw["cu_seqlens_k"].long()
        seg = (torch.searchsorted(cu_q, torch.arange(flat.shape[0], device=DEV), right=True) - 1).clamp(
            max=len(cu_q) - 2)
        ids = torch.where(valid, ids - cu_k[seg][:, None], ids)
    n = (~torch.isneginf(flat)).sum(-1).clamp(max=top_k)
    assert torch.equal(valid.sum(-1), n)
    picked = torch.where(valid, flat.gather(-1, ids.clamp(min=0)), float("-inf"))
    assert torch.equal(picked, res.logits.reshape(picked.shape))
    total = res.softmax.reshape(picked.shape).double().sum(-1)
    assert ((total - (n > 0).double()).abs() <= 1e-5).all()


@gpu
def test_indexer_forward_topk_bshd():
    """indexer_forward_topk, B = 2, odd S_q, ratio 4, one negative offset (empty rows) and one past the KV prefix:
    the dense_scores score kernel into the slab, the forward top-k, the softmax / LSE / global-id pass."""
    gen = torch.Generator().manual_seed(314)
    h, d = INDEXER_SHAPE
    q = torch.randn((2, 151, h, d), generator=gen).bfloat16().to(DEV)
    k = torch.randn((2, 70, d), generator=gen).bfloat16().to(DEV)
    w = torch.randn((2, 151, h), generator=gen).bfloat16().to(DEV)
    kw = dict(ratio=4, q_causal_offsets=torch.tensor([-40, 300], dtype=torch.int32, device=DEV))
    res = dsagen.indexer_forward_topk(q, k, w, 16, return_lse=True, impl="fused", **kw)
    torch.cuda.synchronize()
    _forward_topk_check(res, q, k, w, 16, **kw)


@gpu
def test_indexer_forward_topk_packed_fp8():
    """indexer_forward_topk THD in FP8: empty segments, rows after the last offset, key rows in no segment."""
    gen = torch.Generator().manual_seed(315)
    h, d = INDEXER_SHAPE
    cu_q = torch.tensor([0, 3, 3, 120, 121, 200], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 2, 9, 9, 40, 90], dtype=torch.int32, device=DEV)
    q = (torch.randn((205, h, d), generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    k = (torch.randn((93, d), generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    w = torch.randn((205, h), generator=gen).bfloat16().to(DEV)
    kw = dict(ratio=1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, precision="fp8",
              q_scale=(torch.rand((205, h), generator=gen) + 0.05).to(DEV),
              k_scale=(torch.rand((93,), generator=gen) + 0.05).to(DEV))
    res = dsagen.indexer_forward_topk(q, k, w, 8, return_lse=True, impl="fused", **kw)
    torch.cuda.synchronize()
    _forward_topk_check(res, q, k, w, 8, **kw)


# ---------------------------------------------------------------------------------------- sanitizer probes
@gpu
def test_split_halves_smem_prefix():
    """(jinja2 only: runs in scripts/sanitize.sh's steps) sanitizer_probes.SPLIT_HALVES_PAIR_MAX (the smem window of
    sMax[:, 1] whose racecheck hazards are explained) assumes these leading Smem fields of the kernel module
    (dsagen/kernels/sparse_mla/fwd_sm90.py) at every shape of the op's kernel: 8 + 3 mbarriers, valid[2 * 64],
    mx[2 * 64]."""
    from pathlib import Path

    import dsagen.kernels.sparse_mla as sparse_mla
    from dsagen.jit.render import render
    from sanitizer_probes import SPLIT_HALVES_PAIR_MAX

    want = ["half_mbar: cute.struct.MemRange[Int64, 8]", "q_mbar: cute.struct.MemRange[Int64, 1]",
            "q_free_mbar: cute.struct.MemRange[Int64, 1]", "mask_mbar: cute.struct.MemRange[Int64, 1]",
            "valid: cute.struct.MemRange[Int8, 2 * BN]", "mx: cute.struct.MemRange[Float32, 2 * M]"]
    text = (Path(sparse_mla.__file__).parent / "fwd_sm90.py").read_text()
    fields = text.split("class Smem:")[1].strip().splitlines()
    assert [f.split("#")[0].strip() for f in fields[:len(want)]] == want
    assert "\n    M = 64 " in text and "self.BN = block_n " in text
    for spec in REQUIRED_SPECS[:len(SPARSE_SHAPES)]:
        assert spec.block_n == 64 and "from dsagen.kernels.sparse_mla.fwd_sm90 import build" in render(spec)
    assert SPLIT_HALVES_PAIR_MAX == (0x400 + 8 * 8 + 3 * 8 + 2 * 64 + 64 * 4, 0x400 + 8 * 8 + 3 * 8 + 2 * 64 + 128 * 4)

@gpu
def test_probe_handoff():
    """tests/gpu/sanitizer_probes.py "handoff" (split_halves' max exchange over named barriers, correct by
    construction): the exact sums (racecheck's report on it is the point; see the module)."""
    from sanitizer_probes import handoff_expected, load

    kern = load("handoff")
    if kern is None:
        pytest.skip("SANITIZER_PROBES is not a built probe folder (python tests/gpu/sanitizer_probes.py DIR)")
    out = torch.zeros(128, dtype=torch.float32, device=DEV)
    kern.launch(out)
    torch.cuda.synchronize()
    assert out.cpu().tolist() == handoff_expected()


# ---------------------------------------------------------------------------------------- index helpers
@gpu
def test_compactify():
    gen = torch.Generator().manual_seed(304)
    ids = torch.randint(0, 1 << 20, (37, 300), generator=gen, dtype=torch.int32)
    ids = torch.where(torch.rand((37, 300), generator=gen) < 0.3, -1, ids)
    ids[1] = -1
    length = torch.randint(-3, 305, (37,), generator=gen, dtype=torch.int32)
    for ln in (None, length):
        out, lengths = dsagen.compactify(ids.to(DEV), None if ln is None else ln.to(DEV), impl="fused")
        ref_out, ref_len = dsagen.compactify(ids, ln, impl="reference")
        assert torch.equal(out.cpu(), ref_out) and torch.equal(lengths.cpu(), ref_len)


@gpu
def test_local_to_global():
    gen = torch.Generator().manual_seed(305)
    ids = torch.randint(-3, 103, (3, 17, 33), generator=gen, dtype=torch.int32)
    out = dsagen.local_to_global(ids.to(DEV), 100, impl="fused")
    assert torch.equal(out.cpu(), dsagen.local_to_global(ids, 100, impl="reference"))


@gpu
@pytest.mark.parametrize("h", [16, 32, 64, 128])
def test_indexer_scores_fp8(h):
    """indexer_scores(precision="fp8"): the FP8 score kernel (uint8 TMA boxes, QGMMA, descale loads, four consumer
    warpgroups) under the sanitizer, BSHD with odd S_q and one negative offset; the mask matches the reference's."""
    gen = torch.Generator().manual_seed(313)
    q = (torch.randn((2, 151, h, 128), generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    k = (torch.randn((2, 70, 128), generator=gen) * 4).to(torch.float8_e4m3fn).to(DEV)
    w = torch.randn((2, 151, h), generator=gen).bfloat16().to(DEV)
    qs = (torch.rand((2, 151, h), generator=gen) + 0.05).to(DEV)
    ks = (torch.rand((2, 70), generator=gen) + 0.05).to(DEV)
    kw = dict(ratio=4, q_causal_offsets=torch.tensor([-40, 300], dtype=torch.int32, device=DEV), precision="fp8",
              q_scale=qs, k_scale=ks)
    got = dsagen.indexer_scores(q, k, w, impl="fused", **kw)
    torch.cuda.synchronize()
    ref = dsagen.indexer_scores(q, k, w, impl="reference", **kw)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))


NSA_BLOCK = 64


def _nsa_inputs(hq, packed, gen):
    """The NSA cases' inputs: q / k / v bf16 (4 KV heads, D 128), adversarial ids (-1, negative, past the sequence's
    blocks, future blocks, repeats) for 16 slots, per-token counts 0..19, and BSHD B 2 with odd T or packed sequences
    with empty and one-token ones (cu_seqlens)."""
    h, s = 4, 16
    b, t = (1, 200) if packed else (2, 133)
    q = torch.randn((b, t, hq, 128), generator=gen).bfloat16().to(DEV)
    k = torch.randn((b, t, h, 128), generator=gen).bfloat16().to(DEV)
    v = torch.randn((b, t, h, 128), generator=gen).bfloat16().to(DEV)
    ids = torch.randint(-3, 6, (b, t, h, s), generator=gen)
    ids = torch.where(torch.rand((b, t, h, s), generator=gen) < 0.1, ids.roll(1, dims=-1), ids).to(DEV)
    counts = torch.randint(0, s + 4, (b, t, h), generator=gen, dtype=torch.int32).to(DEV)
    cu = torch.tensor([0, 0, 1, 70, 70, 200], dtype=torch.int32, device=DEV) if packed else None
    return q, k, v, ids, counts, cu


@gpu
@pytest.mark.parametrize("hq,packed", [(64, False), (4, True)])
def test_nsa_select_forward(hq, packed):
    """The NSA selected-branch forward (G 16: 4 tokens per CTA; G 1: 16 tokens, padded rows) on adversarial ids
    (-1, negative, past the sequence's blocks, future blocks, repeats) and per-token counts 0..S+3, BSHD B 2 with
    odd T or packed sequences with empty and one-token ones; checked against the reference."""
    gen = torch.Generator().manual_seed(320 + hq)
    q, k, v, ids, counts, cu = _nsa_inputs(hq, packed, gen)
    o, lse = nsa_select_forward(q, k, v, ids, counts, cu, 0.1, NSA_BLOCK)
    torch.cuda.synchronize()
    ref = dsagen.native_sparse_attention(q, k, v, block_indices=ids, block_counts=counts, cu_seqlens=cu,
                                         softmax_scale=0.1, block_size=NSA_BLOCK, impl="reference")
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert not torch.isnan(lse).any()


@gpu
@pytest.mark.parametrize("hq,packed,bs", [(64, False, 64), (4, True, 64), (64, False, 32), (4, True, 128)])
def test_nsa_select_backward(hq, packed, bs):
    """The NSA backward's dq kernel and dk / dv kernel (and the inverse index feeding it) on the forward case's
    adversarial inputs, blocks of 64, 32 (the dk / dv kernel's 64-row tile cut after 32) and 128 (two tiles a
    block); dq, dk, dv against autograd of the reference."""
    gen = torch.Generator().manual_seed(330 + hq + bs)
    q, k, v, ids, counts, cu = _nsa_inputs(hq, packed, gen)
    dout = torch.randn(q.shape, generator=gen).bfloat16().to(DEV)
    grads = []
    for impl in ("fused", "reference"):
        leaves = [x.detach().float().requires_grad_() if impl == "reference" else x.detach().requires_grad_()
                  for x in (q, k, v)]
        out = dsagen.native_sparse_attention(*leaves, block_indices=ids, block_counts=counts, cu_seqlens=cu,
                                             softmax_scale=0.1, block_size=bs, impl=impl)
        grads.append(torch.autograd.grad(out, leaves, dout.to(out.dtype)))
        torch.cuda.synchronize()
    for got, want in zip(*grads):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


@gpu
@pytest.mark.parametrize("hq,packed", [(64, False), (4, True)])
def test_nsa_select_backward_overlap(hq, packed):
    """The overlapped dk / dv kernel (NsaSelectDkvSpec overlap, 3 stages) on the forward case's adversarial inputs:
    dk and dv the bytes of the one-chunk-at-a-time kernel's."""
    from dsagen.kernels.nsa.host import _forward, _Operands, select_backward

    gen = torch.Generator().manual_seed(335 + hq)
    q, k, v, ids, counts, cu = _nsa_inputs(hq, packed, gen)
    dout = torch.randn(q.shape, generator=gen).bfloat16().to(DEV)
    ops = _Operands(q, k, v, ids, counts, cu, 0.1, NSA_BLOCK)
    out, lse = _forward(ops, None)
    g = hq // k.shape[2]
    grads = [select_backward(ops, out, lse, dout, NsaSelectDkvSpec(arch=ARCH, group=g, stages=st, overlap=ov))
             for st, ov in ((2, False), (3, True))]
    torch.cuda.synchronize()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("hq,packed", [(64, False), (4, True)])
def test_nsa_compressed(hq, packed):
    """The NSA compressed branch's kernels (compressed attention, importance, selection) and the selected branch on
    their selection, per-token counts 0..19 (a selection width of 19; G 16: 4 tokens per CTA; G 1: 16 tokens,
    padded rows), BSHD B 2 with odd T or packed sequences with empty and one-token ones; checked against the
    reference."""
    gen = torch.Generator().manual_seed(340 + hq)
    q, k, v, _, counts, cu = _nsa_inputs(hq, packed, gen)
    g_cmp = torch.rand(q.shape[:3], generator=gen).to(DEV)
    kw = dict(g_cmp=g_cmp, block_counts=counts, cu_seqlens=cu, softmax_scale=0.1, block_size=32)
    out = dsagen.native_sparse_attention(q, k, v, **kw)
    torch.cuda.synchronize()
    ref = dsagen.native_sparse_attention(q, k, v, impl="reference", **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("hq,packed", [(64, False), (4, True)])
def test_nsa_compressed_backward(hq, packed):
    """The NSA backward with g_cmp (blocks of 64): the selected branch's dq and dk / dv kernels on the compressed
    branch's selection, the compressed dq kernel and the compressed dk / dv kernel over its (tile, window) lists, on
    the forward case's inputs (per-token counts 0..19); dq, dk, dv and the gates' gradients finite."""
    gen = torch.Generator().manual_seed(350 + hq)
    q, k, v, _, counts, cu = _nsa_inputs(hq, packed, gen)
    g_cmp = torch.rand(q.shape[:3], generator=gen).to(DEV).requires_grad_()
    g_slc = torch.rand(q.shape[:3], generator=gen).to(DEV).requires_grad_()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = dsagen.native_sparse_attention(*leaves, g_cmp=g_cmp, g_slc=g_slc, block_counts=counts, cu_seqlens=cu,
                                         softmax_scale=0.1)
    grads = torch.autograd.grad(out, leaves + [g_cmp, g_slc], torch.randn(out.shape, generator=gen).to(out))
    torch.cuda.synchronize()
    assert all(torch.isfinite(x).all() for x in grads)


@gpu
@pytest.mark.parametrize("hq,hkv,w", [(12, 1, 68), (24, 2, 132)])
def test_qsa_indexed_forward(hq, hkv, w):
    """The QSA indexed forward (G 12, D 256) on adversarial ids: -1 padding, ids past T and below -1, a repeated
    id, a row without a valid id, a partial last tile (W not a multiple of 64), odd T; checked against the
    reference."""
    gen = torch.Generator().manual_seed(360 + w)
    t = 41
    q = (torch.randn(t, hq, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn(t, hkv, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    v = torch.randn(t, hkv, 256, generator=gen).bfloat16().to(DEV)
    ids = torch.randint(-3, t + 3, (t, w), generator=gen, dtype=torch.int32)
    ids[4] = -1
    ids[6, 1] = ids[6, 0]
    ids = ids.to(DEV)
    out, out32, lse = dsagen.qsa_indexed_forward(q, k, v, ids)
    torch.cuda.synchronize()
    ref = dsagen.qsa_indexed_forward(q, k, v, ids, impl="reference")
    torch.testing.assert_close(out32, ref[1], atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref[2]))


@gpu
@pytest.mark.parametrize("cu", [None, [0, 0, 3, 20, 41]])
def test_qsa_bitmap_forward(cu):
    """The QSA bitmap forward (G 12, D 256): rows with blocks set past the query, in other sequences and none at all,
    packed sequences (empty, shorter than a block, lengths not a multiple of 4), odd T; checked against the
    reference."""
    from dsagen.reference.qsa import bitmap_token_layout

    gen = torch.Generator().manual_seed(370 + (cu is None))
    t = 41
    q = (torch.randn(t, 12, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn(t, 1, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    v = torch.randn(t, 1, 256, generator=gen).bfloat16().to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    nb = bitmap_token_layout(t, cu_t, "cpu")[2]
    bm = (torch.rand((t, nb), generator=gen) < 0.5).to(torch.uint8)
    bm[5] = 0
    bm, cu_t = bm.to(DEV), None if cu_t is None else cu_t.to(DEV)
    out, out32, lse = dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu_t)
    torch.cuda.synchronize()
    ref = dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu_t, impl="reference")
    torch.testing.assert_close(out32, ref[1], atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref[2]))


@gpu
@pytest.mark.parametrize("cu", [None, [0, 0, 3, 20, 41]])
def test_qsa_backward(cu):
    """The QSA backward (G 12, D 256: the forward, then the dq and dk / dv kernels, through autograd) on adversarial
    ids (-1 padding, ids past T and below -1, a repeated id, a row without a valid id, a partial last tile, odd T) and
    on the bitmap form (packed sequences with an empty and a short one, blocks set past the query, an empty row);
    every output in the loss; gradients checked against the reference's autograd."""
    from dsagen.reference.qsa import bitmap_token_layout

    gen = torch.Generator().manual_seed(390 + (cu is None))
    t = 41
    q = (torch.randn(t, 24, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    k = (torch.randn(t, 2, 256, generator=gen) * 0.5).bfloat16().to(DEV)
    v = torch.randn(t, 2, 256, generator=gen).bfloat16().to(DEV)
    ids = torch.randint(-3, t + 3, (t, 72), generator=gen, dtype=torch.int32)
    ids[4] = -1
    ids[6, 1] = ids[6, 0]
    ids = ids.to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    bm = (torch.rand((t, bitmap_token_layout(t, cu_t, "cpu")[2]), generator=gen) < 0.5).to(torch.uint8)
    bm[5] = 0
    bm, cu_t = bm.to(DEV), None if cu_t is None else cu_t.to(DEV)
    w = [torch.randn(t, 24, 256, generator=gen).to(DEV), torch.randn(t, 24, 256, generator=gen).to(DEV),
         torch.randn(24, t, generator=gen).to(DEV)]

    def grads(fn):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out, out32, lse = fn(qq, kk, vv)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        ((out.float() * w[0]).sum() + (out32.float() * w[1]).sum() + (lse.float() * w[2]).sum()).backward()
        return qq.grad, kk.grad, vv.grad

    for impl_fn in (lambda a, b, c, impl: dsagen.qsa_indexed_forward(a, b, c, ids, impl=impl),
                    lambda a, b, c, impl: dsagen.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu_t, impl=impl)):
        got = grads(lambda a, b, c: impl_fn(a, b, c, "fused"))
        torch.cuda.synchronize()
        want = grads(lambda a, b, c: impl_fn(a, b, c, "reference"))
        for a, b in zip(got, want):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2 * b.abs().max().item(), rtol=0)


@gpu
def test_indexer_decode_fp8():
    """The decode-time indexer over a paged FP8 key cache (the paged score kernel reading K and its descales through
    the block table, then the forward top-k): lengths next_n .. a partial last page, table entries past each
    length left as -1 or past the cache (never read); checked as sets against the reference."""
    gen = torch.Generator().manual_seed(380)
    b, next_n, n_pages = 3, 2, 12
    cache = dsagen.quantize_index_k_fp8(torch.randn(n_pages, 64, 128, generator=gen), impl="reference").to(DEV)
    q = torch.randn(b, next_n, 64, 128, generator=gen).to(torch.float8_e4m3fn).to(DEV)
    w = torch.randn(b, next_n, 64, generator=gen).to(DEV)
    lens = torch.tensor([2, 65, 250], dtype=torch.int32, device=DEV)
    table = torch.tensor([[5, -1, -1, -1], [0, 11, 99, -1], [3, 7, 1, 9]], dtype=torch.int32, device=DEV)
    ids = dsagen.indexer_decode_topk(q, w, cache, table, lens, 96)
    torch.cuda.synchronize()
    ref = dsagen.indexer_decode_topk(q, w, cache, table, lens, 96, impl="reference")
    for a, r in zip(ids.view(-1, 96).tolist(), ref.view(-1, 96).tolist()):
        got, want = {x for x in a if x >= 0}, {x for x in r if x >= 0}
        assert len(got) == len(want) and len(got & want) >= 0.95 * len(want)


@gpu
def test_kv_fp8_codec():
    """The FP8 KV cache writer and reader on 37 tokens (the last CTA's warps partly past the end) of mixed
    magnitudes, strided rows: byte for byte the references."""
    gen = torch.Generator().manual_seed(390)
    kv = (torch.randn(37, 576, generator=gen) * torch.pow(2.0, torch.randint(-9, 9, (37, 1), generator=gen))).bfloat16()
    kv = kv.to(DEV)
    cache = dsagen.quantize_kv_fp8(kv)
    back = dsagen.dequantize_kv_fp8(cache[::2])
    torch.cuda.synchronize()
    assert torch.equal(cache, dsagen.quantize_kv_fp8(kv, impl="reference"))
    assert torch.equal(back.view(torch.int16), dsagen.dequantize_kv_fp8(cache[::2], impl="reference").view(torch.int16))
