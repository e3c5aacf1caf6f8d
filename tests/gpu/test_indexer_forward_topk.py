"""GPU tests of the fused dsagen.indexer_forward_topk (sm_90a): the lightning indexer's slab pipeline with the dense
indexer's mask (dense_scores score kernel, forward top-k kernel, softmax / LSE / global-id pass), through the public
op, on fresh random inputs.

Checked on every case, exactly: the ids are the top_k of the fused indexer_scores rows (the same score kernel, so the
same FP32 scores bit for bit) with ties at the k-th value going to the lower ids, in ascending id order, -1 padded,
and the logits are those scores at the ids. Against the FP64 reference: every logit within TOL_REL * (its sum of
|terms|) + TOL_ABS, and no unselected valid column scores above the k-th selected one by more than that tolerance;
the LSE and softmax within 2e-5 (relative) of the FP64 values computed from the logits. Outputs come from a poisoned
allocator, so a slot the kernels forget shows up as the poison pattern.

Build first (CPU, with CuTe-DSL):  dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsagen
from dsagen.kernels.lightning_indexer.spec import forward_topk_config_for, scores_config_for
from dsagen.reference.indexer import dequantize_fp8
from indexer_inputs import bshd as _bshd, fp8_inputs, thd as _thd
from poison import poison_allocator

ARCH = "sm_90a"
DEV = "cuda"
HEAD_SHAPES = [(64, 128), (8, 64), (16, 128), (32, 64), (128, 128)]
FP8_HEADS = (64,)
# the exact checks compare with the fused indexer_scores, so its kernels are needed too
REQUIRED_SPECS = [s for h, d in HEAD_SHAPES for dt in ("bfloat16",)
                  for s in (*forward_topk_config_for(h, d, dt, ARCH).specs(), *scores_config_for(h, d, dt, ARCH).specs())
                  ] + [s for h in FP8_HEADS for cfg in (forward_topk_config_for(h, 128, "float8_e4m3fn", ARCH),
                                                        scores_config_for(h, 128, "float8_e4m3fn", ARCH))
                       for s in cfg.specs()] + [
    *forward_topk_config_for(64, 128, "float16", ARCH).specs(), *scores_config_for(64, 128, "float16", ARCH).specs(),
    *forward_topk_config_for(64, 128, "bfloat16", ARCH, finish_in_topk=False).specs()]
TOL_REL = 3e-5
TOL_ABS = 1e-5
SOFT_TOL = 2e-5

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------- helpers
def _expected_ids(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k column ids of each row of `scores` (rows, W) (-inf: masked) in ascending order, ties at the k-th
    value to the lower ids, -1 padded: a stable descending sort keeps equal scores in id order."""
    rows, width = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    picked = scores.gather(-1, order)
    big = torch.iinfo(torch.int64).max
    order = torch.where(torch.isneginf(picked), big, order).sort(dim=-1).values
    order = torch.where(order == big, -1, order)
    if width < top_k:
        order = torch.cat([order, order.new_full((rows, top_k - width), -1)], dim=-1)
    return order.to(torch.int32)


def _local(ids: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Global ids back to local (base per row, -1 stays)."""
    return torch.where(ids >= 0, ids - base[:, None], ids)


def _run_case(q, k, w, top_k, *, fp8=None, **kw):
    """Run the fused op with every output and check it (module docstring). fp8: (q_scale, k_scale) or None."""
    s = dict(precision="fp8", q_scale=fp8[0], k_scale=fp8[1]) if fp8 is not None else {}
    packed = "cu_seqlens_q" in kw
    poison_allocator()
    res = dsagen.indexer_forward_topk(q, k, w, top_k, return_softmax=True, return_lse=True, impl="fused", **s, **kw)
    scores = dsagen.indexer_scores(q, k, w, impl="fused", **s, **kw)        # same kernel: same FP32 scores
    rows = scores.shape[0] * (1 if packed else scores.shape[1])
    flat = scores.reshape(rows, -1)
    lead = res.indices.shape[:-1]
    assert res.indices.dtype == torch.int32 and res.logits.dtype == torch.float32
    assert res.softmax.shape == res.indices.shape == res.logits.shape == lead + (top_k,) and res.lse.shape == lead
    if packed:
        cu_q, cu_k = kw["cu_seqlens_q"].long().cpu(), kw["cu_seqlens_k"].long().cpu()
        seg = torch.searchsorted(cu_q, torch.arange(rows), right=True) - 1
        base = torch.where(seg < len(cu_q) - 1, cu_k[seg.clamp(max=len(cu_k) - 1)], 0).to(DEV)
    else:
        base = (torch.arange(rows, device=DEV) // q.shape[1]) * k.shape[1]
    ids = _local(res.indices.reshape(rows, top_k).long(), base)
    if flat.shape[1] == 0:                                   # no key column: every row is empty
        assert (ids == -1).all() and torch.isneginf(res.logits).all() and (res.softmax == 0).all()
        assert torch.isneginf(res.lse).all()
        return res
    want = _expected_ids(flat, top_k)
    assert torch.equal(ids.to(torch.int32), want), "selection differs from the top-k of the fused scores"
    valid = ids >= 0
    logits = res.logits.reshape(rows, top_k)
    picked = flat.gather(-1, ids.clamp(min=0))
    assert torch.equal(torch.where(valid, picked, float("-inf")), logits), "logits are not the selected scores"
    # FP64 reference: values and the selection's margin
    if fp8 is not None:
        qd, kd, wd = dequantize_fp8(q, k, w, *fp8)
        qd, kd, wd = qd.double(), kd.double(), wd.double()
    else:
        qd, kd, wd = q.double(), k.double(), w.double()
    ref = dsagen.indexer_scores(qd, kd, wd, impl="reference", **kw).reshape(rows, -1)
    mag = dsagen.indexer_scores(qd.abs() if fp8 is not None else qd, kd.abs() if fp8 is not None else kd, wd.abs(),
                                impl="reference", **kw).reshape(rows, -1)
    tol = (3e-3 if fp8 is not None else TOL_REL) * mag + TOL_ABS
    r_sel, t_sel = ref.gather(-1, ids.clamp(min=0)), tol.gather(-1, ids.clamp(min=0))
    assert ((logits.double() - r_sel).abs() <= t_sel)[valid].all(), "logits far from the FP64 reference"
    assert torch.equal(torch.isneginf(ref).logical_not().sum(-1).clamp(max=top_k), valid.sum(-1)), "valid count"
    kth = torch.where(valid, r_sel + t_sel, float("inf")).amin(-1, keepdim=True)
    selected = torch.zeros(ref.shape, dtype=torch.bool, device=DEV)
    selected[torch.arange(rows, device=DEV)[:, None].expand_as(ids)[valid], ids[valid]] = True
    unsel = torch.where(selected, float("-inf"), ref)
    beats = ~torch.isneginf(unsel) & (unsel - tol > kth)          # masked columns (-inf, and -inf tol) never count
    assert not beats.any(), "an unselected column beats the selection beyond the tolerance"
    # softmax and LSE from the logits, in FP64
    lg = logits.double()
    lse_ref = torch.where(valid.any(-1), torch.logsumexp(lg, dim=-1), float("-inf"))
    lse = res.lse.reshape(rows).double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "empty rows differ"
    ok = ~torch.isneginf(lse_ref)
    assert ((lse - lse_ref).abs()[ok] <= SOFT_TOL * lse_ref.abs()[ok] + SOFT_TOL).all()
    p_ref = torch.where(valid, (lg - lse_ref[:, None]).exp(), 0.0)
    soft = res.softmax.reshape(rows, top_k).double()
    assert torch.equal(soft[~valid], p_ref[~valid]), "padding softmax is not 0"
    assert ((soft - p_ref).abs() <= SOFT_TOL * p_ref + 1e-7).all(), (soft - p_ref).abs().max()
    return res


# ----------------------------------------------------------------------------------------------- model shapes
@pytest.mark.parametrize("t", [2048, 4096])
@pytest.mark.parametrize("ratio", [1, 4])
def test_model_shapes(t, ratio):
    """DeepSeek-V3.2's indexer: H 64, D 128, bf16, topk 2048, S_k = T // ratio (T = 4096 ratio 1: 4 slabs)."""
    gen = torch.Generator().manual_seed(t + ratio)
    q, k, w = _bshd(1, t, t // ratio, 64, 128, gen)
    _run_case(q, k, w, 2048, ratio=ratio)


def test_batches_with_offsets():
    """B = 2 with chunked-prefill offsets (one past the KV prefix, one negative: empty rows), ratio 4, topk 512."""
    gen = torch.Generator().manual_seed(5)
    q, k, w = _bshd(2, 1500, 1024, 64, 128, gen)
    off = torch.tensor([3000, -700], dtype=torch.int32, device=DEV)
    _run_case(q, k, w, 512, ratio=4, q_causal_offsets=off)


# ----------------------------------------------------------------------------------------------- edges
@pytest.mark.parametrize("h,d", HEAD_SHAPES)
def test_heads_and_dims(h, d):
    """Every head count / head dim family, odd lengths, B = 2, a topk inside the rows' lengths."""
    gen = torch.Generator().manual_seed(h * 1000 + d)
    q, k, w = _bshd(2, 301, 257, h, d, gen)
    _run_case(q, k, w, 100, ratio=1)


@pytest.mark.parametrize("sq,sk,top_k", [(1, 1, 4), (130, 64, 200), (7, 0, 5), (0, 9, 3), (33, 40, 0),
                                         (300, 5000, 16)])
def test_lengths(sq, sk, top_k):
    """Single rows, topk wider than every row (-1 / -inf / 0 padding), no keys, no queries, topk 0, S_k > S_q."""
    gen = torch.Generator().manual_seed(sq * 7 + sk)
    q, k, w = _bshd(1, sq, sk, 64, 128, gen)
    if sq == 0 or top_k == 0:
        res = dsagen.indexer_forward_topk(q, k, w, top_k, return_lse=True)
        assert res.indices.shape == (1, sq, top_k) and res.lse.shape == (1, sq)
        assert torch.isneginf(res.lse).all()
        return
    _run_case(q, k, w, top_k, ratio=1, q_causal_offsets=torch.tensor([4000], dtype=torch.int32, device=DEV))


def test_fp16_and_local_ids():
    """fp16 inputs; topk_indices_global=False gives the local ids of the global call."""
    gen = torch.Generator().manual_seed(77)
    q, k, w = _bshd(2, 200, 180, 64, 128, gen, torch.float16)
    res = _run_case(q, k, w, 64, ratio=1)
    loc = dsagen.indexer_forward_topk(q, k, w, 64, topk_indices_global=False)
    base = torch.arange(2, device=DEV).view(2, 1, 1) * 180
    assert torch.equal(torch.where(res.indices >= 0, res.indices - base, -1).to(torch.int32), loc.indices)


@pytest.mark.parametrize("ratio", [1, 4])
def test_packed_documents(ratio):
    """THD: empty segments, rows after the last offset (empty rows), key rows in no segment, offsets per segment."""
    gen = torch.Generator().manual_seed(40 + ratio)
    q, k, w, cu_q, cu_k = _thd([0, 300, 5, 200, 0], [3, 300 // ratio, 9, 200 // ratio, 0], 6, 64, 128, gen)
    off = torch.tensor([0, 10, -2, 700, 5], dtype=torch.int32, device=DEV)
    _run_case(q, k, w, 48, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_many_slabs_cross_batch_elements():
    """A 64 KiB slab (a few token blocks each): slabs cross the batch boundary and the per-slab top-k plan changes
    kernels; the result equals the op's (one slab)."""
    from dsagen.kernels.lightning_indexer.forward_topk_host import indexer_forward_topk as host_op

    gen = torch.Generator().manual_seed(91)
    q, k, w = _bshd(3, 129, 129, 64, 128, gen)
    cfg = dataclasses.replace(forward_topk_config_for(64, 128, "bfloat16", ARCH), slab_bytes=64 * 1024)
    kw = dict(ratio=1, q_causal_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None, width=129, return_softmax=True,
              return_lse=True, topk_indices_global=True)
    got = host_op(q, k, w, 40, config=cfg, **kw)
    want = dsagen.indexer_forward_topk(q, k, w, 40, return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_finish_in_topk_equals_finishing_kernel(packed):
    """The top-k kernels' own finish (the default) against the separate finishing kernel (finish_in_topk=False):
    bitwise the same ids, logits, softmax and LSE, with and without softmax / LSE / global ids, over several
    slabs (a 1 MiB slab), B 2 with offsets or packed documents with an empty one."""
    from dsagen.kernels.lightning_indexer.forward_topk_host import indexer_forward_topk as host_op

    gen = torch.Generator().manual_seed(93)
    kw = dict(ratio=4, q_causal_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None)
    if packed:
        q, k, w, cu_q, cu_k = _thd([700, 0, 800], [175, 0, 200], 5, 64, 128, gen)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, width=200)
    else:
        q, k, w = _bshd(2, 1500, 375, 64, 128, gen)
        kw.update(q_causal_offsets=torch.tensor([-40, 300], dtype=torch.int32, device=DEV), width=375)
    fused, sep = (dataclasses.replace(forward_topk_config_for(64, 128, "bfloat16", ARCH, finish_in_topk=f),
                                      slab_bytes=2 ** 20) for f in (True, False))
    for soft, lse, glob in ((True, True, True), (False, True, False), (True, False, True), (False, False, False)):
        flags = dict(return_softmax=soft, return_lse=lse, topk_indices_global=glob)
        got = host_op(q, k, w, 100, config=fused, **kw, **flags)
        want = host_op(q, k, w, 100, config=sep, **kw, **flags)
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), flags


def test_deterministic_reruns_and_ties():
    """Equal scores (duplicated key rows) resolve to the lower ids; reruns are bitwise identical."""
    gen = torch.Generator().manual_seed(3)
    q, k, w = _bshd(1, 512, 512, 64, 128, gen)
    k[:, 1::2] = k[:, 0::2]                                  # every score appears twice
    res = _run_case(q, k, w, 101, ratio=1)
    again = dsagen.indexer_forward_topk(q, k, w, 101, return_lse=True, deterministic=True)
    for a, b in zip(res, again):
        assert torch.equal(a, b)


def test_softmax_is_the_index_score():
    """The softmax equals sparse_indexer_score_recompute over the selected ids: indexer_backward can take it as its
    index_score directly."""
    gen = torch.Generator().manual_seed(12)
    q, k, w = _bshd(2, 700, 700, 64, 128, gen)
    res = dsagen.indexer_forward_topk(q, k, w, 256)
    predict = dsagen.sparse_indexer_score_recompute(q, k, w, res.indices, topk_indices_global=True)
    assert ((res.softmax - predict).abs() <= 1e-4 * predict + 1e-6).all(), (res.softmax - predict).abs().max()


# ----------------------------------------------------------------------------------------------- FP8
def _fp8_inputs(shape_q, shape_k, shape_w, gen):
    """E4M3 inputs with bf16 weights: q, k, weights, (q_scale, k_scale)."""
    q, k, w, q_scale, k_scale = fp8_inputs(shape_q, shape_k, shape_w, gen)
    return q, k, w, (q_scale, k_scale)


@pytest.mark.parametrize("h", FP8_HEADS)
def test_fp8_bshd(h):
    """precision="fp8": E4M3 q / k with per-token (and head) descales, B = 2, offsets, ratio 4."""
    gen = torch.Generator().manual_seed(800 + h)
    q, k, w, scales = _fp8_inputs((2, 1100, h, 128), (2, 300, 128), (2, 1100, h), gen)
    off = torch.tensor([-40, 100], dtype=torch.int32, device=DEV)
    _run_case(q, k, w, 128, fp8=scales, ratio=4, q_causal_offsets=off)


def test_fp8_packed():
    gen = torch.Generator().manual_seed(931)
    cu_q = torch.tensor([0, 3, 3, 420, 500], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 2, 9, 390, 450], dtype=torch.int32, device=DEV)
    q, k, w, scales = _fp8_inputs((505, 64, 128), (453, 128), (505, 64), gen)
    _run_case(q, k, w, 200, fp8=scales, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# ----------------------------------------------------------------------------------------------- graphs, compile
def test_cuda_graph_capture():
    """A warmed-up BSHD call captured in a CUDA graph; a replay with new inputs and offsets gives the eager result."""
    gen = torch.Generator().manual_seed(33)
    q, k, w = _bshd(2, 601, 300, 64, 128, gen)
    off = torch.tensor([0, 40], dtype=torch.int32, device=DEV)

    def call():
        return dsagen.indexer_forward_topk(q, k, w, 64, ratio=4, q_causal_offsets=off, return_lse=True)

    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = call()
    torch.cuda.current_stream().wait_stream(s)
    q2, k2, w2 = _bshd(2, 601, 300, 64, 128, gen)
    q.copy_(q2), k.copy_(k2), w.copy_(w2)
    off.copy_(torch.tensor([-30, 900], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    want = call()
    for a, b in zip(out, want):
        assert torch.equal(a, b)


def test_torch_compile():
    """fullgraph torch.compile of the BSHD op through torch.ops.dsagen and the public function, dynamic lengths."""
    import torch._dynamo

    torch._dynamo.reset()

    def f(q, k, w, off):
        r = dsagen.indexer_forward_topk(q, k, w, 32, ratio=4, q_causal_offsets=off, return_lse=True)
        return r.indices, r.logits, r.softmax, r.lse

    def g(q, k, w, off):
        return torch.ops.dsagen.indexer_forward_topk(q, k, w, 32, 4, off, return_lse=True)

    gen = torch.Generator().manual_seed(41)
    off = torch.tensor([5], dtype=torch.int32, device=DEV)
    for fn in (f, g):
        cf = torch.compile(fn, fullgraph=True, dynamic=True)
        for t in (300, 517):
            q, k, w = _bshd(1, t, t // 4, 64, 128, gen)
            for a, b in zip(cf(q, k, w, off), f(q, k, w, off)):
                assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- limits
def test_fused_limits_name_the_argument():
    gen = torch.Generator().manual_seed(1)
    q, k, w = _bshd(1, 16, 16, 64, 128, gen)
    with pytest.raises(ValueError, match="q_indexer in bfloat16 or float16"):
        dsagen.indexer_forward_topk(q.float(), k.float(), w.float(), 4)
    with pytest.raises(ValueError, match="top_k <= 2\\*\\*20"):
        dsagen.indexer_forward_topk(q, k, w, 2 ** 20 + 1)
    with pytest.raises(ValueError, match="k_indexer must have stride 1"):
        dsagen.indexer_forward_topk(q, k.transpose(1, 2).contiguous().transpose(1, 2), w, 4)


# ----------------------------------------------------------------------------------------------- fast path
@pytest.mark.parametrize("fp8", [False, True])
def test_fast_path_repeats_the_full_path(fp8):
    """Eager BSHD calls of a signature that passed once run by their plan (dsagen.ops._fast_path): on new inputs of
    the same signature (several slabs, B 2, offsets) every output equals the full path's bytes, and is checked."""
    from dsagen.ops import indexer as ix

    gen = torch.Generator().manual_seed(71)
    off = torch.tensor([5, 300], dtype=torch.int32, device=DEV)
    t = forward_topk_config_for(64, 128, "bfloat16", "sm_90a").slab_max_rows + 300     # two slabs per element

    def inputs():
        if fp8:
            q, k, w, scales = _fp8_inputs((2, t, 64, 128), (2, 700, 128), (2, t, 64), gen)
            return q, k, w, scales, dict(precision="fp8", q_scale=scales[0], k_scale=scales[1])
        q, k, w = _bshd(2, t, 700, 64, 128, gen)
        return q, k, w, None, {}

    q, k, w, _, s = inputs()
    ix._FORWARD_TOPK_FAST.clear()
    dsagen.indexer_forward_topk(q, k, w, 300, return_lse=True, ratio=4, q_causal_offsets=off, **s)
    assert len(ix._FORWARD_TOPK_FAST) == 1
    q, k, w, scales, s = inputs()
    fast = dsagen.indexer_forward_topk(q, k, w, 300, return_lse=True, ratio=4, q_causal_offsets=off, **s)
    ix._FORWARD_TOPK_FAST.clear()
    want = _run_case(q, k, w, 300, fp8=scales, ratio=4, q_causal_offsets=off)
    for a, b in zip(fast, want):
        assert torch.equal(a, b)
