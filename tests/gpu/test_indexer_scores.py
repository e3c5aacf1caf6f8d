"""GPU tests of the fused dsagen.indexer_scores and dsagen.dense_indexer_score_recompute (sm_90a): the lightning indexer's score kernel in its dense_scores form
plus the mask / LSE kernel, through the public op, against the FP64 reference on fresh random inputs.

Checked on every case: masked entries are exactly -inf, valid entries are finite and within
TOL_REL * (the row-entry's sum of |terms|) + TOL_ABS of the FP64 reference (the kernel sums in FP32 in another order),
and, with return_lse, the LSE within the scores' error plus a relative 1e-5 (ex2.approx) of the FP64 logsumexp; -inf
exactly for rows without a valid column. Outputs come from a poisoned allocator, so an element the kernels forget
shows up as the poison pattern.

Build first (CPU, with CuTe-DSL):  dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.lightning_indexer.spec import scores_config_for
from indexer_inputs import bshd as _bshd, fp8_inputs as _fp8_inputs, thd as _thd
from poison import poison_allocator

ARCH = "sm_90a"
DEV = "cuda"
HEAD_SHAPES = [(64, 128), (64, 64), (8, 128), (16, 128), (32, 128), (32, 64), (128, 128), (8, 64)]
FP8_HEADS = (16, 32, 64, 128)     # cuDNN frontend DSA SM90 FP8 heads (32, 64) and ours, D = 128
REQUIRED_SPECS = [s for h, d in HEAD_SHAPES for s in scores_config_for(h, d, "bfloat16", ARCH).specs()] + [
    *scores_config_for(64, 128, "float16", ARCH).specs()] + [
    scores_config_for(h, 128, "float8_e4m3fn", ARCH).score for h in FP8_HEADS]
TOL_REL = 3e-5
TOL_ABS = 1e-5

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------- helpers
def _expected(q, k, w, **kw):
    """(FP64 scores, FP64 magnitude: the same op with |w| and |.| of the dots, FP64 lse) from the reference."""
    qd, kd, wd = q.double(), k.double(), w.double()
    ref = dsagen.indexer_scores(qd, kd, wd, impl="reference", **kw)
    mag = dsagen.indexer_scores(qd, kd, wd.abs(), impl="reference", **kw)   # relu(x) >= 0: |w| relu(x) bounds
    return ref, mag, ref.logsumexp(dim=-1)


def _check(got, ref, mag, lse=None, lse_ref=None):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    masked = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), masked), "mask differs"
    valid = ~masked
    g, r, m = got.double()[valid], ref[valid], mag[valid]
    assert torch.isfinite(g).all()
    err = (g - r).abs()
    bound = TOL_REL * m + TOL_ABS
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    if lse is None:
        return
    assert lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows differ"
    row_err = torch.where(valid, TOL_REL * mag + TOL_ABS, torch.zeros_like(mag))
    row_err = row_err.amax(dim=-1) if mag.shape[-1] else torch.zeros(mag.shape[:-1], dtype=mag.dtype, device=DEV)
    ld, lr = lse.double()[~empty], lse_ref[~empty]
    assert ((ld - lr).abs() <= row_err[~empty] + 1e-5 * lr.abs() + 1e-5).all(), (ld - lr).abs().max()


def _run_case(q, k, w, **kw):
    poison_allocator()
    got, lse = dsagen.indexer_scores(q, k, w, return_lse=True, impl="fused", **kw)
    ref, mag, lse_ref = _expected(q, k, w, **kw)
    _check(got, ref, mag, lse, lse_ref)
    plain = dsagen.indexer_scores(q, k, w, impl="fused", **kw)             # without the LSE: same scores
    assert torch.equal(plain, got)


# ----------------------------------------------------------------------------------------------- model shapes
@pytest.mark.parametrize("t", [1024, 2048, 4096])
@pytest.mark.parametrize("ratio", [1, 4])
def test_model_shapes(t, ratio):
    """DeepSeek-V3.2's indexer: H 64, D 128, bf16, S_k = T // ratio (T = 4096: 4 launches of 1024 rows)."""
    gen = torch.Generator().manual_seed(t + ratio)
    q, k, w = _bshd(1, t, t // ratio, 64, 128, gen)
    _run_case(q, k, w, ratio=ratio)


def test_model_shape_with_offsets_batches():
    """B = 2 at T = 2048 with a chunked-prefill offset per batch element (rows past the KV prefix clamp to S_k)."""
    gen = torch.Generator().manual_seed(5)
    q, k, w = _bshd(2, 2048, 1024, 64, 128, gen)
    off = torch.tensor([1500, 0], dtype=torch.int32, device=DEV)
    _run_case(q, k, w, ratio=4, q_causal_offsets=off)


# ----------------------------------------------------------------------------------------------- edges
@pytest.mark.parametrize("h,d", HEAD_SHAPES)
def test_heads_and_dims(h, d):
    """Every head count / head dim the kernel supports, odd lengths, B = 2 (odd S_q: per-batch launches for QC > 1)."""
    gen = torch.Generator().manual_seed(h * 1000 + d)
    q, k, w = _bshd(2, 301, 257, h, d, gen)
    _run_case(q, k, w, ratio=1)


@pytest.mark.parametrize("offsets", [[0, 0, 0], [7, 5000, 2**31 - 1 - 400], [-50, -1000, -2**31], [-3, 1, 130]])
@pytest.mark.parametrize("ratio", [1, 4])
def test_offsets(offsets, ratio):
    """Offsets past the KV prefix (every column valid), int32 extremes, negative offsets (empty rows), mixed."""
    gen = torch.Generator().manual_seed(abs(offsets[1]) % 1000 + ratio)
    q, k, w = _bshd(3, 333, 111, 64, 128, gen)
    off = torch.tensor(offsets, dtype=torch.int32, device=DEV)
    _run_case(q, k, w, ratio=ratio, q_causal_offsets=off)


def test_fp16_4d_keys_strided_weights():
    """fp16, k [B, S_k, 1, D], weights a transposed view (any strides), ratio 3, a strided offsets view."""
    gen = torch.Generator().manual_seed(11)
    q, k, _ = _bshd(2, 200, 90, 64, 128, gen, dtype=torch.float16, k4=True)
    w = torch.randn((2, 64, 200), generator=gen).half().to(DEV).transpose(1, 2)
    off = torch.tensor([10, 0, -20, 0], dtype=torch.int32, device=DEV)[::2]
    _run_case(q, k, w, ratio=3, q_causal_offsets=off)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 5000), (5000, 1), (130, 64), (7, 0), (0, 9)])
def test_lengths(sq, sk):
    """One row, one key, more keys than any row sees, empty S_k (all -inf / -inf LSE), empty S_q."""
    gen = torch.Generator().manual_seed(sq + sk)
    q, k, w = _bshd(2, sq, sk, 64, 128, gen)
    _run_case(q, k, w, ratio=1)


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("int64", [False, True])
def test_packed_documents(ratio, int64):
    """THD: empty segments on either side, a 1-row one, long ones, rows after the last offset, key rows in no
    segment, per-segment offsets (one negative)."""
    gen = torch.Generator().manual_seed(ratio + 10 * int64)
    lens_q, lens_k = [5, 0, 300, 1, 17, 700], [3, 10, 0, 40, 17, 180]
    q, k, w, cu_q, cu_k = _thd(lens_q, lens_k, 4, 64, 128, gen, int64=int64)
    off = torch.tensor([0, 4, 9, -1, -10, 12], dtype=torch.int32, device=DEV)
    _run_case(q, k, w, ratio=ratio, q_causal_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _run_case(q, k, w, ratio=ratio, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_packed_d64_3d_keys():
    gen = torch.Generator().manual_seed(3)
    q, k, w, cu_q, cu_k = _thd([64, 129], [64, 100], 0, 32, 64, gen)
    _run_case(q, k[:, None], w, ratio=1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# ----------------------------------------------------------------------------------------------- outputs, graphs
def test_caller_owned_outputs():
    """out / lse_out are filled in place (NaN garbage before), returned as given, and equal the allocating call."""
    gen = torch.Generator().manual_seed(21)
    q, k, w = _bshd(2, 257, 200, 64, 128, gen)
    off = torch.tensor([3, -100], dtype=torch.int32, device=DEV)
    out = torch.full((2, 257, 200), float("nan"), device=DEV)
    lse_out = torch.full((2, 257), float("nan"), device=DEV)
    got, lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, out=out,
                                     lse_out=lse_out)
    assert got is out and lse is lse_out
    want, want_lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse_out, want_lse)
    only = torch.full_like(out, float("nan"))
    assert dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, out=only) is only
    assert torch.equal(only, want)


def test_cuda_graph_capture_allocates_nothing():
    """A warmed-up BSHD call with out / lse_out captured in a CUDA graph: no allocation during capture; a replay
    with new inputs and new offsets (copied into the captured tensors) gives the eager result."""
    gen = torch.Generator().manual_seed(33)
    q, k, w = _bshd(2, 601, 300, 64, 128, gen)
    off = torch.tensor([0, 40], dtype=torch.int32, device=DEV)
    out = torch.empty((2, 601, 300), device=DEV)
    lse = torch.empty((2, 601), device=DEV)

    def call():
        return dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, out=out, lse_out=lse)

    call()                                                                # warm up: load the kernels
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            before = torch.cuda.memory_allocated()     # after capture_begin, which allocates its own RNG state
            call()
            during = torch.cuda.memory_allocated() - before
    torch.cuda.current_stream().wait_stream(s)
    assert during == 0
    q2, k2, w2 = _bshd(2, 601, 300, 64, 128, gen)
    q.copy_(q2), k.copy_(k2), w.copy_(w2)
    off.copy_(torch.tensor([-30, 900], dtype=torch.int32))
    out.fill_(float("nan")), lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want, want_lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, mag, lse_ref = _expected(q, k, w, ratio=4, q_causal_offsets=off)
    _check(out, ref, mag, lse, lse_ref)


def test_torch_compile():
    """fullgraph torch.compile of the BSHD op with and without caller-owned outputs, dynamic lengths."""
    import torch._dynamo

    torch._dynamo.reset()

    def f(q, k, w, off):
        s, lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True)
        return s, lse

    fn = torch.compile(f, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(41)
    off = torch.tensor([5], dtype=torch.int32, device=DEV)
    for t in (300, 517):
        q, k, w = _bshd(1, t, t // 4, 64, 128, gen)
        got, got_lse = fn(q, k, w, off)
        want, want_lse = f(q, k, w, off)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


# ----------------------------------------------------------------------------------------------- limits
def test_fused_limits_name_the_argument():
    gen = torch.Generator().manual_seed(1)
    q, k, w = _bshd(1, 16, 16, 64, 128, gen)
    with pytest.raises(ValueError, match="q_indexer in bfloat16 or float16"):
        dsagen.indexer_scores(q.float(), k.float(), w.float())
    with pytest.raises(ValueError, match="weights in q_indexer's dtype"):
        dsagen.indexer_scores(q, k, w.float())
    q12, k12, w12 = _bshd(1, 16, 16, 12, 128, gen)
    with pytest.raises(ValueError, match="heads H in"):
        dsagen.indexer_scores(q12, k12, w12)
    q96, k96, w96 = _bshd(1, 16, 16, 64, 96, gen)
    with pytest.raises(ValueError, match="head dim D in"):
        dsagen.indexer_scores(q96, k96, w96)
    with pytest.raises(ValueError, match="k_indexer must have stride 1"):
        dsagen.indexer_scores(q, k.transpose(1, 2).contiguous().transpose(1, 2), w)
    with pytest.raises(ValueError, match="out must be contiguous"):
        dsagen.indexer_scores(q, k, w, out=torch.empty(1, 16, 32, device=DEV)[:, :, ::2])


# ----------------------------------------------------------------------------------------------- FP8
#: FP8 tolerance: the E4M3 products are exact in FP32, but the QGMMA accumulator keeps fewer mantissa bits than FP32
#: (about 14 on Hopper), so each dot's error is a few 2**-14 of its sum of |products|; 1e-3 of the bound built from
#: |q8| . |k8| (and |w| q_scale k_scale) covers that with margin while a wrong scale or layout is off by O(1).
FP8_TOL_REL = 1e-3


def _fp8_check(q, k, w, q_scale, k_scale, **kw):
    poison_allocator()
    got, lse = dsagen.indexer_scores(q, k, w, return_lse=True, impl="fused", precision="fp8", q_scale=q_scale,
                                     k_scale=k_scale, **kw)
    s = dict(precision="fp8", q_scale=q_scale, k_scale=k_scale)
    ref = dsagen.indexer_scores(q, k, w, impl="reference", **s, **kw).double()
    qa = q.float().abs().to(torch.float8_e4m3fn)                    # |q8|, |k8| are exact in E4M3
    ka = k.float().abs().to(torch.float8_e4m3fn)
    mag = dsagen.indexer_scores(qa, ka, w.abs(), impl="reference", **s, **kw).double()
    masked = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), masked), "mask differs"
    err = (got.double() - ref)[~masked].abs()
    bound = FP8_TOL_REL * mag[~masked] + 1e-5
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    lse_ref = ref.logsumexp(dim=-1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))


@pytest.mark.parametrize("h", FP8_HEADS)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fp8_bshd(h, w_dtype):
    """precision="fp8", BSHD: odd S_q, ratio 4, offsets (one negative), bf16 and fp32 weights."""
    gen = torch.Generator().manual_seed(900 + h)
    q, k, w, qs, ks = _fp8_inputs((2, 301, h, 128), (2, 257, 128), (2, 301, h), gen, w_dtype)
    off = torch.tensor([-40, 700], dtype=torch.int32, device=DEV)
    _fp8_check(q, k, w, qs, ks, ratio=4, q_causal_offsets=off)


def test_fp8_packed_strided_scales():
    """precision="fp8", THD with empty segments, non-contiguous descales (column slices of wider tensors)."""
    gen = torch.Generator().manual_seed(931)
    cu_q = torch.tensor([0, 3, 3, 120, 200], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 2, 9, 90, 150], dtype=torch.int32, device=DEV)
    q, k, w, qs, ks = _fp8_inputs((205, 64, 128), (153, 128), (205, 64), gen, torch.bfloat16)
    qs = torch.cat([qs, qs], dim=1)[:, ::2]
    ks = torch.stack([ks, ks], dim=1)[:, 0]
    _fp8_check(q, k, w, qs, ks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# ----------------------------------------------------------------------------------------------- dense recompute
@pytest.mark.parametrize("packed", [False, True])
def test_dense_indexer_score_recompute(packed):
    """dense_indexer_score_recompute (indexer_scores' kernels, sm_scale folded into the weights, LSE as denom) against
    the FP64 reference: BSHD B = 2 with offsets and ratio 4, THD with empty segments and rows after the last offset."""
    gen = torch.Generator().manual_seed(61 + packed)
    if packed:
        q, k, w, cu_q, cu_k = _thd([100, 0, 37], [80, 5, 40], 4, 64, 128, gen)
        kw = dict(ratio=1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, w = _bshd(2, 301, 150, 64, 128, gen)
        kw = dict(ratio=4, q_causal_offsets=torch.tensor([20, -100], dtype=torch.int32, device=DEV))
    poison_allocator()
    got = dsagen.dense_indexer_score_recompute(q, k, w, sm_scale=0.37, **kw)
    qd, kd, wd = q.double(), k.double(), w.double()
    ref = dsagen.dense_indexer_score_recompute(qd, kd, wd, sm_scale=0.37, impl="reference", **kw)
    mag = dsagen.dense_indexer_score_recompute(qd, kd, wd.abs(), sm_scale=0.37, impl="reference", **kw).out
    _check(got.out, ref.out, mag, got.denom, ref.denom)


# ----------------------------------------------------------------------------------------------- fast path
@pytest.mark.parametrize("precision", ["default", "fp8"])
def test_fast_path_repeats_the_full_path(precision):
    """Eager BSHD calls of a signature that passed once run by their plan (dsagen.ops._fast_path): on new inputs of
    the same signature it gives the full path's bytes, scores and LSE, with and without out= / lse_out=."""
    from dsagen.ops import indexer as ix

    gen = torch.Generator().manual_seed(61)
    shape = ((2, 301, 64, 128), (2, 257, 128), (2, 301, 64))
    off = torch.tensor([-40, 700], dtype=torch.int32, device=DEV)

    def inputs():
        if precision == "fp8":
            q, k, w, qs, ks = _fp8_inputs(*shape, gen, torch.bfloat16)
            return (q, k, w), dict(precision="fp8", q_scale=qs, k_scale=ks)
        return _bshd(2, 301, 257, 64, 128, gen), {}

    (q, k, w), s = inputs()
    ix._SCORES_FAST.clear()
    dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, **s)     # full path: plan kept
    assert len(ix._SCORES_FAST) == 1
    (q, k, w), s = inputs()
    fast, fast_lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, **s)
    out, lse = torch.full_like(fast, float("nan")), torch.full_like(fast_lse, float("nan"))
    for _ in range(2):                                                    # full path, then its plan
        got = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, out=out, lse_out=lse,
                                    **s)
        assert got[0] is out and got[1] is lse
    assert len(ix._SCORES_FAST) == 2
    ix._SCORES_FAST.clear()
    want, want_lse = dsagen.indexer_scores(q, k, w, ratio=4, q_causal_offsets=off, return_lse=True, **s)
    assert torch.equal(fast, want) and torch.equal(fast_lse, want_lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    if precision == "default":
        ref, mag, lse_ref = _expected(q, k, w, ratio=4, q_causal_offsets=off)
        _check(fast, ref, mag, fast_lse, lse_ref)


def test_fast_path_misaligned_input_still_refused():
    """A plan is only for its signature, whose base addresses were 16-byte aligned: the same shapes and strides at a
    misaligned address take the full path and its ValueError (TMA)."""
    gen = torch.Generator().manual_seed(62)
    q, k, w, qs, ks = _fp8_inputs((1, 128, 64, 128), (1, 128, 128), (1, 128, 64), gen, torch.bfloat16)
    s = dict(precision="fp8", q_scale=qs, k_scale=ks)
    dsagen.indexer_scores(q, k, w, **s)
    dsagen.indexer_scores(q, k, w, **s)
    buf = torch.empty(q.numel() + 16, dtype=torch.uint8, device=DEV)
    q_odd = buf[1:1 + q.numel()].view(torch.float8_e4m3fn).view(q.shape)
    q_odd.copy_(q)
    assert q_odd.stride() == q.stride()
    with pytest.raises(ValueError, match="q_indexer.*16-byte-aligned"):
        dsagen.indexer_scores(q_odd, k, w, **s)
