"""GPU tests of the fused lightning_indexer (sm_90a): generated wgmma score kernel + radix top-k, through
the whole pipeline (spec -> template -> cubin in the cache -> runtime), against plain-PyTorch scores.

Checked property (attention-gym leaves order and ties open, so no exact-set comparison): for every row the
selected ids are distinct, valid for the row's causal / document bounds, ascending (this backend's
order), followed by -1 exactly when fewer than topk candidates exist, and every selected candidate's
reference score is >= every unselected valid candidate's reference score minus one bf16 ulp of the
row's largest |score| (the kernel accumulates in fp32 in another order than the reference).

Build first (CPU, with CuTe-DSL):  dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dsagen
from dsagen.kernels.lightning_indexer import host as fused
from dsagen.reference.indexer import weighted_relu_scores
from dsagen.kernels.lightning_indexer.spec import config_for
from poison import POISON_INT32, poison_allocator

ARCH = "sm_90a"
HEAD_SHAPES = [(64, 128), (8, 64), (16, 128), (32, 64), (128, 128), (8, 128), (64, 64)]
#: the op's configuration for DeepSeek-V3.2's indexer shape; its top-k plan serves every shape
CONFIG = config_for(64, 128, "bfloat16", ARCH)
#: top-k kernels checked exactly by test_topk_kernel_exact: every kernel of the plan
TOPK_SPECS = list(CONFIG.topk.specs())
REQUIRED_SPECS = [config_for(h, d, "bfloat16", ARCH).score for h, d in HEAD_SHAPES] + [
    config_for(64, 128, "float16", ARCH).score, *TOPK_SPECS]

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------- helpers
def _inputs(b, t, h, d, s, gen, dtype=torch.bfloat16, weights_layout="contiguous"):
    q = torch.randn((b, t, h, d), generator=gen).to(dtype).cuda()
    k = torch.randn((b, s, d), generator=gen).to(dtype).cuda()
    if weights_layout == "transposed":        # [B, H, T] storage viewed as [B, T, H]
        w = torch.randn((b, h, t), generator=gen).to(dtype).cuda().transpose(1, 2)
    elif weights_layout == "strided":         # every third element of a wider tensor
        w = torch.randn((b, t, 3 * h), generator=gen).to(dtype).cuda()[:, :, ::3]
    elif weights_layout == "broadcast":       # stride 0 over tokens
        w = torch.randn((b, 1, h), generator=gen).to(dtype).cuda().expand(b, t, h)
    else:
        w = torch.randn((b, t, h), generator=gen).to(dtype).cuda()
    return q, k, w


def _bounds(t, s, causal, ratio, cu_q=None, cu_k=None):
    """Per query row: [lo, hi) candidate range in the pool (pool coordinates) and the id offset."""
    lo = torch.zeros(t, dtype=torch.int64)
    hi = torch.full((t,), s, dtype=torch.int64)
    if cu_q is None:
        if causal:
            hi = torch.clamp((torch.arange(t) + 1) // ratio, max=s)
        return lo, hi
    cu_q, cu_k = cu_q.cpu().long(), cu_k.cpu().long()
    hi[:] = 0
    for d_ in range(cu_q.numel() - 1):
        a, z = int(cu_q[d_]), int(cu_q[d_ + 1])
        for tt in range(a, z):
            n = int(cu_k[d_ + 1] - cu_k[d_])
            if causal:
                n = min(n, (tt - a + 1) // ratio)
            lo[tt] = cu_k[d_]
            hi[tt] = cu_k[d_] + n
    return lo, hi


def _scores(q, k, w, rows=None):
    """fp32 reference scores [B, R, S] of the given query rows (all when None), in row chunks."""
    b, t, h, d = q.shape
    if rows is not None:
        q, w = q[:, rows], w[:, rows]
    kf = k.float()
    out = []
    step = max(1, (1 << 28) // max(1, h * k.shape[1] * 4))
    for r0 in range(0, q.shape[1], step):
        out.append(weighted_relu_scores(q[:, r0:r0 + step].float(), kf, w[:, r0:r0 + step].float())
                   / math.sqrt(h * d))
    return torch.cat(out, 1)


def _check_rows(out, scores, lo, hi, topk, row_ids=None):
    """The defining property for out[B, R, topk] against reference scores[B, R, S] and bounds."""
    out = out.cpu().long()
    scores = scores.cpu()
    b_count, r_count, _ = out.shape
    assert not (out == POISON_INT32).any(), "unwritten output elements"
    for bb in range(b_count):
        for r in range(r_count):
            row = r if row_ids is None else int(row_ids[r])
            a, z = int(lo[row]), int(hi[row])
            n = z - a
            sel = out[bb, r]
            want = min(n, topk)
            valid = sel[:want]
            assert (sel[want:] == -1).all(), f"row {bb},{row}: -1 padding must start at {want}: {sel.tolist()[:64]}"
            assert ((valid >= 0) & (valid < n)).all(), f"row {bb},{row}: ids outside [0, {n}): {valid.tolist()[:64]}"
            if want > 1:
                assert (valid[1:] > valid[:-1]).all(), f"row {bb},{row}: ids not ascending/distinct"
            if n > topk and topk > 0:
                sc = scores[bb, r, a:z]
                mask = torch.zeros(n, dtype=torch.bool)
                mask[valid] = True
                tol = 2.0 ** -8 * float(sc.abs().max())
                worst_in = float(sc[mask].min())
                best_out = float(sc[~mask].max())
                assert worst_in >= best_out - tol, (
                    f"row {bb},{row}: selected score {worst_in} < unselected {best_out} - {tol}")


def _run_and_check(q, k, w, topk, causal, ratio=1, cu_q=None, cu_k=None, **kw):
    poison_allocator()
    out = dsagen.lightning_indexer(q, k, w, topk, causal=causal, compress_ratio=ratio, cu_seqlens=cu_q,
                                   cu_seqlens_k=cu_k, impl="fused", **kw)
    torch.cuda.synchronize()
    b, t = q.shape[:2]
    assert out.shape == (b, t, topk) and out.dtype == torch.int32 and out.is_contiguous()
    lo, hi = _bounds(t, k.shape[1], causal, ratio, cu_q, cu_k)
    if topk > 0:
        _check_rows(out, _scores(q, k, w), lo, hi, topk)
    return out


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("causal", [True, False])
def test_model_shape(causal):
    gen = torch.Generator().manual_seed(1 + causal)
    q, k, w = _inputs(2, 333, 64, 128, 333, gen)
    _run_and_check(q, k, w, 100, causal)


@pytest.mark.parametrize("h,d", HEAD_SHAPES)
@pytest.mark.parametrize("t", [1, 77, 260])
def test_heads_and_dims(h, d, t):
    gen = torch.Generator().manual_seed(h * 1000 + d + t)
    q, k, w = _inputs(2, t, h, d, t, gen)
    _run_and_check(q, k, w, 33, True)


@pytest.mark.parametrize("ratio", [1, 4, 3])
def test_compress_ratio(ratio):
    gen = torch.Generator().manual_seed(ratio)
    t = 1001
    q, k, w = _inputs(1, t, 64, 128, t // ratio, gen)
    _run_and_check(q, k, w, 64, True, ratio)


@pytest.mark.parametrize("topk", [0, 1, 2048, 5000])
def test_topk_edges(topk):
    gen = torch.Generator().manual_seed(topk + 5)
    q, k, w = _inputs(1, 4200, 64, 128, 4200, gen)
    _run_and_check(q, k, w, topk, True)


# the score kernel over heads, dims, dtypes, weight layouts, ratios and packed documents, test_score_cases:
# id -> (H, D, B, T, S, topk, causal, ratio, packed document lengths or None, weights layout, dtype)
SCORE_CASES = {
    "h64_causal": (64, 128, 2, 1500, 1500, 200, True, 1, None, "contiguous", torch.bfloat16),
    "h64_odd_t_noncausal": (64, 128, 2, 333, 333, 100, False, 1, None, "transposed", torch.bfloat16),
    "h64_ratio4": (64, 128, 1, 1001, 250, 64, True, 4, None, "contiguous", torch.bfloat16),
    "h64_ratio3_fp16": (64, 128, 1, 1001, 333, 64, True, 3, None, "strided", torch.float16),
    "h64_packed": (64, 128, 1, None, None, 40, True, 1, [1, 0, 300, 0, 1, 513, 9], "contiguous", torch.bfloat16),
    "h64_packed_ratio4": (64, 128, 1, None, None, 40, True, 4, [1, 0, 300, 0, 1, 513, 9], "contiguous", torch.bfloat16),
    "h64_long_chunks": (64, 128, 1, 4200, 4200, 2048, True, 1, None, "contiguous", torch.bfloat16),
    "h8_d64": (8, 64, 2, 260, 260, 33, True, 1, None, "broadcast", torch.bfloat16),
    "h16_d128_noncausal": (16, 128, 1, 517, 517, 50, False, 1, None, "contiguous", torch.bfloat16),
    "h32_d64": (32, 64, 2, 77, 77, 33, True, 1, None, "contiguous", torch.bfloat16),
    "h128": (128, 128, 2, 260, 260, 33, True, 1, None, "contiguous", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_score_cases(case):
    """The op's score kernel for each case's H, D and dtype (config_for), through the public op."""
    h, d, b, t, s, topk, causal, ratio, lens, layout, dtype = SCORE_CASES[case]
    gen = torch.Generator().manual_seed(131 + len(case))
    if lens is None:
        q, k, w = _inputs(b, t, h, d, s, gen, dtype=dtype, weights_layout=layout)
        _run_and_check(q, k, w, topk, causal, ratio)
    else:
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + [n // ratio for n in lens]).cumsum(0).to(torch.int32)
        t, s = int(cu[-1]) + 21, int(cu_k[-1]) + 7
        q, k, w = _inputs(b, t, h, d, s, gen, dtype=dtype, weights_layout=layout)
        out = _run_and_check(q, k, w, topk, causal, ratio, cu.cuda(), cu_k.cuda())
        assert (out[0, int(cu[-1]):].cpu() == -1).all()
    want = config_for(h, d, _DTYPE_NAMES[dtype], ARCH).score
    assert fused._kernels[(0, h, d, dtype)].score.name == want.name(), f"{want.name()} was not used"


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------- top-k kernel alone, exact, on synthetic slabs
def _slab_rows(pattern: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "randn":
        return torch.randn(n, generator=gen)
    if pattern == "equal":                            # every key ties
        return torch.full((n,), 0.375)
    if pattern == "few_values":                       # heavy ties at the threshold, both signs
        return torch.randint(-3, 4, (n,), generator=gen).float()
    if pattern == "zeros_pm":                         # +0.0 and -0.0 (different keys: +0 ranks above -0)
        return torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0)
    if pattern == "negative":
        return -torch.randn(n, generator=gen).abs() - 1e-3
    if pattern == "quantized":                        # ties plus a few values 1 ulp apart
        x = torch.round(torch.randn(n, generator=gen) * 4) / 4
        return torch.nextafter(x, torch.full_like(x, 9.0)).where(torch.rand(n, generator=gen) < 0.02, x)
    if pattern == "narrow":                           # one 16-bit key prefix, distinct keys: the last pass decides
        return 1 + torch.rand(n, generator=gen) * 2.0 ** -8   # (sample=True: the entries are written in pass 3)
    if pattern == "one_octave":                       # every key in [1, 2): one top byte (sample=True: pass 0 is
        return 1 + torch.rand(n, generator=gen)       # skipped), the 16-bit prefixes spread over 128 values
    if pattern == "front_heavy":                      # the largest keys all in the row's first eighth (sample=True:
        x = torch.randn(n, generator=gen)             # the first warps' entries overflow: the row falls back)
        x[:max(1, n // 8)] += 4.0
        return x
    raise ValueError(pattern)


def _keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving uint32 keys of fp32 scores, as int64."""
    b = x.float().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(b >> 31 == 1, b ^ 0xFFFFFFFF, b | 0x80000000)


#: (12288 / 24576 +- 0: TOPK_COMPACT_CAP of sample=True at 512 / 1024 threads; all-equal rows of those lengths
#: fill the smem entries exactly or run without them)
TOPK_EXACT_LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 511, 2047, 2048, 2049, 2050, 4097, 9001, 12288, 12289, 24576,
                      24577, 40000, 131073]


@pytest.mark.parametrize("topk", [1, 64, 2048])
@pytest.mark.parametrize("pattern", ["randn", "equal", "few_values", "zeros_pm", "negative", "quantized", "narrow",
                                     "front_heavy", "one_octave"])
@pytest.mark.parametrize("spec", TOPK_SPECS, ids=[s.name() for s in TOPK_SPECS])
def test_topk_kernel_exact(spec, pattern, topk):
    """The top-k kernel alone on slab rows of many lengths (one 1-token document per row): exactly the ids of
    the topk largest keys, ties to the lower id, ascending; 0..n-1 then -1 when n <= topk."""
    from dsagen.jit import get_kernel

    kern = get_kernel(spec, 0)
    gen = torch.Generator().manual_seed(sum(map(ord, pattern)) * 7 + topk)
    lens = TOPK_EXACT_LENGTHS
    rows = len(lens)
    ld = -(-max(lens) // 4) * 4 + 4
    slab = torch.full((rows, ld), float("nan"))
    for r, n in enumerate(lens):
        slab[r, :n] = _slab_rows(pattern, n, gen)
    cu_q = torch.arange(rows + 1, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    s_total = int(cu_k[-1])
    poison_allocator()
    out = torch.empty((1, rows, topk), dtype=torch.int32, device="cuda")
    # args: slab, out, cu_q, cu_k, n_docs, T, S, n_tblk, blk0, qc, nrows, topk, causal, ratio, ld_slab
    kern.launch(slab.cuda(), out, cu_q.cuda(), cu_k.cuda(), rows, rows, s_total, rows, 0, 1, rows, topk, 0, 1, ld)
    torch.cuda.synchronize()
    got = out[0].cpu().long()
    for r, n in enumerate(lens):
        if n <= topk:
            want = torch.where(torch.arange(topk) < n, torch.arange(topk), -1)
        else:
            order = torch.sort(-_keys(slab[r, :n]), stable=True).indices[:topk]
            want = torch.sort(order).values
        assert torch.equal(got[r], want), (f"{pattern} topk={topk} n={n}: first mismatch at "
                                           f"{int((got[r] != want).nonzero()[0])}: {got[r][:16].tolist()} vs "
                                           f"{want[:16].tolist()}")


def test_no_candidates():
    gen = torch.Generator().manual_seed(9)
    q, k, w = _inputs(2, 3, 64, 128, 0, gen)          # T < ratio: S = 0
    out = dsagen.lightning_indexer(q, k, w, 8, causal=True, compress_ratio=4, impl="fused")
    assert out.shape == (2, 3, 8) and (out.cpu() == -1).all()


@pytest.mark.parametrize("layout", ["transposed", "strided", "broadcast"])
def test_weights_any_stride(layout):
    gen = torch.Generator().manual_seed(17)
    q, k, w = _inputs(2, 200, 64, 128, 200, gen, weights_layout=layout)
    assert not w.is_contiguous()
    _run_and_check(q, k, w, 50, False)


def test_float16():
    gen = torch.Generator().manual_seed(23)
    q, k, w = _inputs(1, 500, 64, 128, 500, gen, dtype=torch.float16)
    _run_and_check(q, k, w, 64, True)


@pytest.mark.parametrize("causal,ratio", [(True, 1), (False, 1), (True, 4)])
def test_packed_documents(causal, ratio):
    gen = torch.Generator().manual_seed(31 + ratio)
    lens = [1, 0, 300, 0, 1, 513, 9]                  # a 1-token document, empty documents, odd sizes
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [n // ratio for n in lens]).cumsum(0).to(torch.int32)
    t = int(cu[-1]) + 20                              # rows past the last offset return -1
    s = int(cu_k[-1]) + 7                             # inactive capacity at the end of the pool
    q, k, w = _inputs(1, t, 64, 128, s, gen)
    out = _run_and_check(q, k, w, 40, causal, ratio, cu.cuda(), cu_k.cuda())
    assert (out[0, int(cu[-1]):].cpu() == -1).all()


def test_packed_long_sequence():
    """T = 2**20 packed query rows (short documents keep the reference cheap): checked on sampled rows."""
    gen = torch.Generator().manual_seed(41)
    t, ratio, doc = 2 ** 20, 4, 4096
    n_docs = t // doc
    cu = (torch.arange(n_docs + 1) * doc).to(torch.int32)
    cu_k = (torch.arange(n_docs + 1) * (doc // ratio)).to(torch.int32)
    q, k, w = _inputs(1, t, 8, 64, t // ratio, gen)
    out = dsagen.lightning_indexer(q, k, w, 16, causal=True, compress_ratio=ratio, cu_seqlens=cu.cuda(),
                                   cu_seqlens_k=cu_k.cuda(), impl="fused")
    rows = torch.cat([torch.randint(0, t, (48,), generator=gen), torch.tensor([0, 3, 4, doc - 1, t - 1])])
    lo, hi = _packed_bounds(rows, doc, ratio)
    _check_rows(out[:, rows.cuda()], _scores(q, k, w, rows.cuda()), lo, hi, 16)


def test_long_causal_slabs_cross_batch_elements():
    """Causal, unpacked, long enough for several slabs (slab_rows), two batch elements so that a slab crosses
    into the next one: checked on each slab's first and last rows and on random rows."""
    from dsagen.kernels.lightning_indexer.host import slab_rows

    gen = torch.Generator().manual_seed(43)
    b, t, h, topk = 2, 9000, 64, 2048
    q, k, w = _inputs(b, t, h, 128, t, gen)
    per = slab_rows(h, t, CONFIG)
    assert per < t and t % per != 0                        # several slabs, one of them across the batch boundary
    poison_allocator()
    out = dsagen.lightning_indexer(q, k, w, topk, causal=True, impl="fused")
    edges = sorted({r for r0 in range(0, b * t, per) for r in (r0, min(r0 + per, b * t) - 1)})   # flat rows
    flat = torch.tensor(edges + torch.randint(0, b * t, (24,), generator=gen).tolist())
    lo, hi = _bounds(t, t, True, 1)
    for bb in range(b):
        rows = flat[(flat // t) == bb] % t
        _check_rows(out[bb:bb + 1, rows.cuda()], _scores(q[bb:bb + 1], k[bb:bb + 1], w[bb:bb + 1], rows.cuda()),
                    lo, hi, topk, row_ids=rows)


@pytest.mark.parametrize("slab_mib", [128, 6])
def test_topk_plan_per_slab(slab_mib, monkeypatch):
    """The host's per-slab top-k choice (TopkPlan): a causal call long enough that the early slabs run the
    short-row kernel and the late ones the sampled 512-thread kernel (slab_mib=128, the op's config: 1024-row slabs),
    or, with 112-row slabs (one wave; a config with a 6 MiB slab), the two 1024-thread kernels; checked on every
    slab's first and last rows."""
    picked = []
    real = fused.IndexerKernels.topk_for
    monkeypatch.setattr(fused.IndexerKernels, "topk_for", lambda self, n, rows, sms: picked.append(
        self.config.topk.pick(n, rows, sms)) or real(self, n, rows, sms))
    gen = torch.Generator().manual_seed(47)
    t, h, topk = 14000, 64, 2048
    config = dataclasses.replace(CONFIG, slab_bytes=slab_mib * 2 ** 20)
    q, k, w = _inputs(1, t, h, 128, t, gen)
    per = fused.slab_rows(h, t, config)
    poison_allocator()
    if slab_mib == 128:
        assert config == CONFIG
        out = dsagen.lightning_indexer(q, k, w, topk, causal=True, impl="fused")
    else:
        out = fused.lightning_indexer(q, k, w, topk, causal=True, compress_ratio=1, cu_seqlens=None, cu_seqlens_k=None,
                                      kernel_options=None, config=config)
    kinds = {(spec.threads, spec.sample) for spec in picked}
    assert kinds == ({(128, False), (512, True)} if slab_mib == 128 else {(1024, False), (1024, True)}), kinds
    rows = sorted({r for r0 in range(0, t, per) for r in (r0, min(r0 + per, t) - 1)})
    rows = torch.tensor(rows + torch.randint(0, t, (16,), generator=gen).tolist())
    lo, hi = _bounds(t, t, True, 1)
    _check_rows(out[:, rows.cuda()], _scores(q, k, w, rows.cuda()), lo, hi, topk, row_ids=rows)


def _packed_bounds(rows, doc, ratio):
    d_ = rows // doc
    lo = d_ * (doc // ratio)
    hi = lo + torch.minimum(torch.full_like(rows, doc // ratio), (rows - d_ * doc + 1) // ratio)
    return lo, hi


def test_deterministic_and_ties_to_lower_index():
    gen = torch.Generator().manual_seed(53)
    q, k, w = _inputs(1, 700, 64, 128, 700, gen)
    torch.use_deterministic_algorithms(True)
    try:
        a = dsagen.lightning_indexer(q, k, w, 64, causal=True, impl="fused")
        b = dsagen.lightning_indexer(q, k, w, 64, causal=True, impl="fused")
        assert torch.equal(a, b)
        k_same = k[:, :1].expand_as(k).contiguous()   # every candidate scores the same
        c = dsagen.lightning_indexer(q, k_same, w, 64, causal=True, impl="fused").cpu()
    finally:
        torch.use_deterministic_algorithms(False)
    t = torch.arange(700)
    n = torch.clamp(t + 1, max=64)
    want = torch.where(torch.arange(64)[None, :] < n[:, None], torch.arange(64)[None, :], -1)
    assert torch.equal(c[0].long(), want)


def test_backend_option_and_limits():
    gen = torch.Generator().manual_seed(61)
    q, k, w = _inputs(1, 16, 64, 128, 16, gen)
    dsagen.lightning_indexer(q, k, w, 4, causal=True, impl="fused", kernel_options={"backend": "cute"})
    with pytest.raises(ValueError, match="backend"):
        dsagen.lightning_indexer(q, k, w, 4, causal=True, impl="fused", kernel_options={"backend": "triton"})
    q6, k6, w6 = _inputs(1, 16, 6, 128, 16, gen)
    with pytest.raises(ValueError, match=r"H \(heads\) in"):
        dsagen.lightning_indexer(q6, k6, w6, 4, causal=True, impl="fused")
    q96, k96, w96 = _inputs(1, 16, 64, 96, 16, gen)
    with pytest.raises(ValueError, match=r"D \(head dim\) in"):
        dsagen.lightning_indexer(q96, k96, w96, 4, causal=True, impl="fused")


def test_torch_compile_dynamic_no_recompile():
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(dsagen.lightning_indexer, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(71)
    for i, t in enumerate((300, 517, 1024)):
        q, k, w = _inputs(1, t, 64, 128, t, gen)
        ctx = torch._dynamo.config.patch(error_on_recompile=True) if i else _nullcontext()
        with ctx:
            got = fn(q, k, w, 32, causal=True, impl="fused")
        want = dsagen.lightning_indexer(q, k, w, 32, causal=True, impl="fused")
        assert torch.equal(got, want)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("slabs", ["op", "three_slabs"])
def test_cuda_graph_capture(slabs):
    """Capture and replay with new inputs: the public op (one slab), and a config of 256-row slabs, so three slabs,
    the last of 88 rows: the plan's 128- and 1024-thread top-k kernels in one graph."""
    if slabs == "op":
        def call(q, k, w):
            return dsagen.lightning_indexer(q, k, w, 48, causal=True, impl="fused")
    else:
        config = dataclasses.replace(CONFIG, slab_bytes=256 * 4 * 600)

        def call(q, k, w):
            return fused.lightning_indexer(q, k, w, 48, causal=True, compress_ratio=1, cu_seqlens=None,
                                           cu_seqlens_k=None, kernel_options=None, config=config)
    gen = torch.Generator().manual_seed(83)
    q, k, w = _inputs(1, 600, 64, 128, 600, gen)
    call(q, k, w)                                                         # warm up: load the kernels
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = call(q, k, w)
    torch.cuda.current_stream().wait_stream(s)
    q2, k2, w2 = _inputs(1, 600, 64, 128, 600, gen)
    q.copy_(q2), k.copy_(k2), w.copy_(w2)
    g.replay()
    torch.cuda.synchronize()
    want = call(q, k, w)
    assert torch.equal(out, want)
    lo, hi = _bounds(600, 600, True, 1)
    _check_rows(out, _scores(q, k, w), lo, hi, 48)


# ------------------------------------------------------------------------------------------------ fast path
@pytest.mark.parametrize("packed", [False, True])
def test_fast_path_repeats_the_full_path(packed):
    """Eager calls of a signature that passed once run by their plan (dsagen.ops._fast_path): on new inputs of the
    same signature (several slabs; packed documents with new offsets) the ids equal the full path's and are
    checked against the scores."""
    from dsagen.ops import lightning_indexer as li

    gen = torch.Generator().manual_seed(47)
    t = config_for(64, 128, "bfloat16", "sm_90a").slab_max_rows * 2 + 77

    def call(q, k, w, cu_q=None, cu_k=None):
        return dsagen.lightning_indexer(q, k, w, 64, causal=True, compress_ratio=4 if packed else 1,
                                        cu_seqlens=cu_q, cu_seqlens_k=cu_k)

    offs = []
    for cut in (300, 1900):
        cu = torch.tensor([0, cut, t], dtype=torch.int32)
        offs.append((cu.cuda(), (cu // 4).cuda()) if packed else (None, None))
    s = t // 4 if packed else t
    li._FAST.clear()
    call(*_inputs(1, t, 64, 128, s, gen), *offs[0])
    assert len(li._FAST) == 1
    q, k, w = _inputs(1, t, 64, 128, s, gen)
    fast = call(q, k, w, *offs[1])
    li._FAST.clear()
    want = _run_and_check(q, k, w, 64, True, 4 if packed else 1, *offs[1])
    assert torch.equal(fast, want)
