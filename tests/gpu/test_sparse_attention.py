"""GPU tests of the fused sparse MLA forward (`dsagen.sparse_attention(..., impl="fused")`, sm_90a kernel of
SparseAttnFwdSpec) against the plain-PyTorch reference on fresh random inputs: H 64/128 natively and 16/32
padded, D_qk 512/576 with d_v 512, top-k widths that are and are not multiples of 64, topk_length, -1,
negative and out-of-range ids, duplicates, all-invalid rows, with and without sink, total_S_q = 1, the
batched layout of the DeepSeek-V4 inference kernel, fp16, gradients, CUDA-graph capture and torch.compile.
Grids smaller than the item count (CTAs looping over several items) run through the flat entry's `config=`
(dsagen.kernels.sparse_mla.host.sparse_attention, SparseAttnFwdConfig.grid).

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under `compute-sanitizer --tool memcheck`
(with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation).
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
import dsagen.kernels.sparse_mla.host as fused_sa
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdConfig, config_for
from poison import poison_allocator

ARCH = "sm_90a"
# the op's kernels of every shape the tests run: H 64 / 128 (16 and 32 are padded to 64), D_qk 512 / 576, bf16, and
# fp16 at H64 / D576 (test_softmax_scale_and_fp16, test_looping_grid_adversarial)
REQUIRED_SPECS = [config_for(h, d, dt, None, ARCH, None).spec(h, d, dt, ARCH)
                  for h, d, dt in [(h, d, "bfloat16") for h in (64, 128) for d in (512, 576)]
                  + [(64, 576, "float16")]] + [
    config_for(128, 576, "bfloat16", None, ARCH, None).spec(128, 576, "bfloat16", ARCH, lse_prefix=True)]

pytestmark = pytest.mark.gpu

DEV = "cuda"


def make_ids(s_q: int, k: int, n_kv: int, gen: torch.Generator, *, adversarial: bool) -> torch.Tensor:
    """(s_q, k) int32 ids. Clean: distinct valid ids per row (when k <= n_kv). Adversarial: about 15% -1,
    5% other negatives, 5% >= n_kv (up to int32 max), 10% duplicates of another slot of the row, and
    (for s_q >= 3) row 1 all invalid."""
    if not adversarial:
        if k <= n_kv:
            ids = torch.stack([torch.randperm(n_kv, generator=gen)[:k] for _ in range(s_q)])
        else:
            ids = torch.randint(0, n_kv, (s_q, k), generator=gen)
        return ids.to(torch.int32)
    ids = torch.randint(0, n_kv, (s_q, k), generator=gen, dtype=torch.int64)
    u = torch.rand((s_q, k), generator=gen)
    if k > 1:
        dup_src = torch.randint(0, k, (s_q, k), generator=gen)
        ids = torch.where(u < 0.10, ids.gather(1, dup_src), ids)
    big = torch.randint(n_kv, 2**31 - 1, (s_q, k), generator=gen, dtype=torch.int64)
    ids = torch.where((u >= 0.10) & (u < 0.15), big, ids)
    ids = torch.where((u >= 0.15) & (u < 0.20), -2 - torch.randint(0, 2**30, (s_q, k), generator=gen), ids)
    ids = torch.where((u >= 0.20) & (u < 0.35), torch.full_like(ids, -1), ids)
    if s_q >= 3:
        ids[1] = torch.where(torch.rand(k, generator=gen) < 0.5, -1, n_kv + 5)
    return ids.to(torch.int32)


def make_inputs(s_q, h, d_qk, k, n_kv, *, seed, sink=True, length=False, adversarial=False,
                dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((s_q, h, d_qk), generator=gen).to(dtype)
    kv = torch.randn((n_kv, d_qk), generator=gen).to(dtype)
    ids = make_ids(s_q, k, n_kv, gen, adversarial=adversarial)
    attn_sink = (torch.randn(h, generator=gen) * 2).float() if sink else None
    topk_length = None
    if length:
        topk_length = torch.randint(-3, k + 10, (s_q,), generator=gen, dtype=torch.int32)
        if s_q >= 2:
            topk_length[0] = max(k // 2 - 1, 0)           # shorter than the width
    move = lambda t: None if t is None else t.to(DEV)
    return move(q), move(kv), move(ids), move(attn_sink), move(topk_length)


def fused_with(config, q, kv, ids, attn_sink, topk_length, softmax_scale=None):
    """The fused forward of flat-layout inputs under `config` (a SparseAttnFwdConfig) instead of the op's."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return fused_sa.sparse_attention(q, kv, ids, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=scale,
                                     d_v=512, config=config)


def check_against_reference(q, kv, ids, attn_sink, topk_length, softmax_scale=None, config=None):
    """The fused forward (the op's config, or `config` through the flat entry) against the reference."""
    poison_allocator()
    if config is None:
        out, lse, max_logits = dsagen.sparse_attention(q, kv, ids, attn_sink=attn_sink, topk_length=topk_length,
                                                       softmax_scale=softmax_scale, impl="fused")
    else:
        out, lse, max_logits = fused_with(config, q, kv, ids, attn_sink, topk_length, softmax_scale)
    r_out, r_lse, r_max = dsagen.sparse_attention(q, kv, ids, attn_sink=attn_sink, topk_length=topk_length,
                                                  softmax_scale=softmax_scale, impl="reference")
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and out.shape == r_out.shape
    assert lse.dtype == torch.float32 and max_logits.dtype == torch.float32
    o, ro = out.float(), r_out.float()
    assert torch.isfinite(o).all(), "out has non-finite values"
    rel = ((o - ro).norm() / ro.norm().clamp_min(1e-6)).item()
    assert rel < 1e-2, f"relative error of out {rel:.3e}"
    torch.testing.assert_close(o, ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(max_logits, r_max.float(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse.float(), atol=2e-4, rtol=1e-4)
    return out, lse, max_logits


CASES = [  # (s_q, H, D_qk, topk, n_kv, sink, topk_length)
    (4, 128, 576, 2048, 4096, True, False),
    (5, 128, 576, 100, 1000, False, False),
    (3, 64, 576, 64, 300, True, False),
    (4, 64, 512, 2048, 3000, True, True),
    (3, 128, 512, 1000, 2500, False, True),
    (6, 16, 576, 333, 700, True, False),
    (2, 32, 512, 65, 200, True, True),
    (1, 64, 576, 513, 1500, True, False),
    (1, 128, 576, 2048, 32768, True, False),
    (7, 128, 576, 127, 90, True, True),           # topk > n_kv: repeated ids
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "sq{}_h{}_d{}_k{}_kv{}_sink{}_len{}".format(*c))
def test_matches_reference(case):
    s_q, h, d_qk, k, n_kv, sink, length = case
    check_against_reference(*make_inputs(s_q, h, d_qk, k, n_kv, seed=hash(case) % 2**31, sink=sink,
                                         length=length))


@pytest.mark.parametrize("h,d_qk,k", [(64, 576, 200), (128, 576, 2048), (128, 512, 300), (32, 576, 64)])
@pytest.mark.parametrize("length", [False, True])
def test_adversarial_ids(h, d_qk, k, length):
    q, kv, ids, sink, tl = make_inputs(5, h, d_qk, k, 777, seed=h + d_qk + k + length, length=length,
                                       adversarial=True)
    out, lse, max_logits = check_against_reference(q, kv, ids, sink, tl)
    # row 1 has no valid id: out = 0, lse = +inf, max_logits = -inf
    assert (out[1] == 0).all()
    assert torch.isposinf(lse[1]).all() and torch.isneginf(max_logits[1]).all()


def test_adversarial_empty_rows_and_zero_width():
    q, kv, ids, sink, _ = make_inputs(3, 128, 576, 130, 50, seed=7, adversarial=True)
    ids[:] = -1
    ids[2, 5] = 60                                # out of range only
    for width in (ids, ids[:, :0]):
        for tl in (None, torch.zeros(3, dtype=torch.int32, device=DEV)):
            out, lse, max_logits = dsagen.sparse_attention(q, kv, width.contiguous(), attn_sink=sink,
                                                           topk_length=tl, impl="fused")
            assert (out == 0).all() and torch.isposinf(lse).all() and torch.isneginf(max_logits).all()


def test_topk_length_ignores_later_slots():
    q, kv, ids, sink, _ = make_inputs(4, 64, 576, 256, 2000, seed=11)
    tl = torch.tensor([0, 1, 64, 200], dtype=torch.int32, device=DEV)
    out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
    garbage = ids.clone()
    for r, n in enumerate(tl.tolist()):
        garbage[r, n:] = torch.randint(0, 2000, (256 - n,), device=DEV, dtype=torch.int32)
    out2, lse2, _ = dsagen.sparse_attention(q, kv, garbage, attn_sink=sink, topk_length=tl, impl="fused")
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    check_against_reference(q, kv, ids, sink, tl)


def test_softmax_scale_and_fp16():
    q, kv, ids, sink, tl = make_inputs(3, 64, 576, 192, 1000, seed=5, length=True, dtype=torch.float16)
    check_against_reference(q, kv, ids, sink, tl, softmax_scale=0.02)


def test_sink_only_in_denominator():
    q, kv, ids, _, _ = make_inputs(2, 64, 512, 128, 500, seed=3, sink=False)
    out0, lse0, m0 = dsagen.sparse_attention(q, kv, ids, impl="fused")
    sink = torch.full((64,), 1.5, device=DEV)
    out1, lse1, m1 = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")
    torch.testing.assert_close(lse0, lse1, atol=0, rtol=0)
    torch.testing.assert_close(m0, m1, atol=0, rtol=0)
    factor = torch.exp(lse0) / (torch.exp(lse0) + math.exp(1.5))
    torch.testing.assert_close(out1.float(), (out0.float() * factor[..., None]), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("h,d_qk", [(64, 576), (128, 576), (64, 512), (128, 512)])
@pytest.mark.parametrize("sink", [True, False])
def test_odd_tile_counts(h, d_qk, sink):
    """The kernel pairs the tiles (even -> WG1, odd -> WG2) and pads an odd count with an all-masked tile: every tile
    count 0..5 and longer rows in one batch (topk_length), adversarial ids, against the reference."""
    q, kv, ids, attn_sink, _ = make_inputs(12, h, d_qk, 320, 900, seed=h + d_qk + sink, sink=sink,
                                           adversarial=True)
    tl = torch.tensor([0, 1, 63, 64, 65, 128, 129, 191, 192, 257, 320, 500], dtype=torch.int32, device=DEV)
    out, lse, m = check_against_reference(q, kv, ids, attn_sink, tl)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()          # topk_length 0
    assert (out[1] == 0).all()                                           # adversarial row 1: no valid id


@pytest.mark.parametrize("grid", ["persistent", 7, 1])
@pytest.mark.parametrize("h,d_qk", [(128, 576), (64, 512), (128, 512), (64, 576)])
def test_grid_adversarial(grid, h, d_qk):
    """The CTAs loop over the items (query row, 64 heads) when the grid is smaller than the item count
    (SparseAttnFwdConfig.grid): the barriers' phases, the Q hand-over between items and the per-item resets must give
    every item exactly the result of a one-CTA-per-item launch. Tile counts 0..5 and longer rows in one batch
    (topk_length), adversarial ids (row 1 all invalid), against the reference and bitwise against a grid of one CTA
    per item."""
    s_q = 300 if grid == "persistent" else 24          # persistent: 300 rows x H/64 items over 132 SMs
    q, kv, ids, attn_sink, _ = make_inputs(s_q, h, d_qk, 704, 2000, seed=h + d_qk + 7, adversarial=True)
    tl = torch.tensor([0, 1, 63, 64, 65, 128, 129, 191, 192, 257, 320, 704], dtype=torch.int32)
    tl = tl.repeat((s_q + len(tl) - 1) // len(tl))[:s_q].to(DEV)
    config = SparseAttnFwdConfig(grid=grid)
    out, lse, m = check_against_reference(q, kv, ids, attn_sink, tl, config=config)
    items = s_q * (fused_sa.kernel_heads(h) // 64)
    i_out, i_lse, i_m = fused_with(SparseAttnFwdConfig(grid=items), q, kv, ids, attn_sink, tl)
    assert torch.equal(out, i_out) and torch.equal(lse, i_lse) and torch.equal(m, i_m)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()          # topk_length 0
    assert (out[1] == 0).all()                                           # adversarial row 1: no valid id
    if grid == "persistent":                                            # the op's own launch is the same kernel
        o_out, o_lse, o_m = dsagen.sparse_attention(q, kv, ids, attn_sink=attn_sink, topk_length=tl, impl="fused")
        assert torch.equal(out, o_out) and torch.equal(lse, o_lse) and torch.equal(m, o_m)


_LOOPING_CASES = [(128, 576, 2048, False, torch.bfloat16), (64, 512, 300, True, torch.bfloat16),
                  (128, 512, 333, True, torch.bfloat16), (64, 576, 1000, False, torch.bfloat16),
                  (64, 576, 200, True, torch.float16)]


@pytest.mark.parametrize("h,d_qk,k,length,dtype", _LOOPING_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_looping_grid_adversarial(h, d_qk, k, length, dtype):
    """The kernel's epilogue (16-byte O stores after the quad transpose, evict_first Q loads and O stores) on
    adversarial ids (rows without valid slots among them), with 3 CTAs looping over 7 query rows' items, bf16 and
    fp16: against the reference."""
    inputs = make_inputs(7, h, d_qk, k, 3000, seed=k + h, length=length, adversarial=True, dtype=dtype)
    check_against_reference(*inputs, config=SparseAttnFwdConfig(grid=3))


@pytest.mark.parametrize("h,d_qk", [(128, 576), (64, 512), (16, 576)])
def test_strided_and_misaligned_inputs(h, d_qk):
    """Inputs the kernel reads in place (q with a padded token stride, kv with a row stride above D_qk, ids with a row
    stride above K) and inputs the op must copy first (q with a padded head stride, q and kv contiguous but starting
    8 bytes off 16-byte alignment, ids with a non-unit slot stride), against the reference on the same views."""
    gen = torch.Generator().manual_seed(h + d_qk + 7)
    s_q, n_kv, k = 5, 700, 200
    q_tok = torch.randn((s_q, h * d_qk + 64), generator=gen).bfloat16().to(DEV)[:, :h * d_qk].view(s_q, h, d_qk)
    q_head = torch.randn((s_q, h, d_qk + 64), generator=gen).bfloat16().to(DEV)[:, :, :d_qk]
    q_off = torch.randn(s_q * h * d_qk + 4, generator=gen).bfloat16().to(DEV)[4:].view(s_q, h, d_qk)
    kv_row = torch.randn((n_kv, d_qk + 64), generator=gen).bfloat16().to(DEV)[:, :d_qk]
    kv_off = torch.randn(n_kv * d_qk + 4, generator=gen).bfloat16().to(DEV)[4:].view(n_kv, d_qk)
    ids = make_ids(s_q, k, n_kv, gen, adversarial=True)
    ids_row = torch.full((s_q, k + 24), -7, dtype=torch.int32)
    ids_row[:, :k] = ids
    ids_row = ids_row.to(DEV)[:, :k]
    ids_col = ids.t().contiguous().to(DEV).t()
    sink = torch.randn(h, generator=gen).to(DEV)
    assert q_tok.stride(0) == h * d_qk + 64 and q_head.stride(1) == d_qk + 64
    assert kv_row.stride(0) == d_qk + 64 and kv_off.data_ptr() % 16 == 8 and q_off.data_ptr() % 16 == 8
    assert ids_row.stride(0) == k + 24 and ids_col.stride(1) == s_q
    for q, kv, i in ((q_tok, kv_row, ids_row), (q_head, kv_off, ids_col), (q_tok, kv_off, ids_row),
                     (q_off, kv_row, ids_col)):
        check_against_reference(q, kv, i, sink, None)


def test_batched_layout():
    gen = torch.Generator().manual_seed(21)
    b, t, h, n, k = 2, 3, 64, 400, 96
    q = torch.randn((b, t, h, 576), generator=gen).bfloat16().to(DEV)
    kv = torch.randn((b, n, 576), generator=gen).bfloat16().to(DEV)
    ids = torch.randint(-1, n + 3, (b, t, k), generator=gen, dtype=torch.int32).to(DEV)
    sink = torch.randn(h, generator=gen).to(DEV)
    f = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")
    r = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="reference")
    torch.testing.assert_close(f[0].float(), r[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(f[1], r[1].float(), atol=2e-4, rtol=1e-4)


def test_gradients_flow():
    q, kv, ids, sink, tl = make_inputs(3, 64, 576, 128, 600, seed=9, length=True)
    grads = []
    for impl in ("fused", "reference"):
        qq, kk, ss = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
        out, _, _ = dsagen.sparse_attention(qq, kk, ids, attn_sink=ss, topk_length=tl, impl=impl)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEV)).sum().backward()
        grads.append((qq.grad.float(), kk.grad.float(), ss.grad.float()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_cuda_graph_capture():
    q, kv, ids, sink, tl = make_inputs(4, 128, 576, 256, 2048, seed=13, length=True)
    out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
    q.copy_(torch.randn_like(q.float()).to(q.dtype))
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
    assert torch.equal(g_out, ref_out) and torch.equal(g_lse, ref_lse)
    assert not torch.equal(g_out, out)


def test_torch_compile():
    q, kv, ids, sink, tl = make_inputs(3, 64, 512, 200, 900, seed=17, length=True)

    def f(q, kv, ids, sink, tl):
        out, lse, m = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
        return out.float().sum(-1) + lse

    eager = f(q, kv, ids, sink, tl)
    compiled = torch.compile(f, fullgraph=True)(q, kv, ids, sink, tl)
    torch.testing.assert_close(compiled, eager, atol=1e-3, rtol=1e-4)


def _fast_path_inputs(case: str, gen: torch.Generator) -> tuple[tuple, dict]:
    """(q, kv, ids) and keyword arguments of one fast-path case (test_fast_path_repeats_the_full_path)."""
    if case == "batched":
        b, t, h, n, k = 2, 3, 64, 400, 96
        q = torch.randn((b, t, h, 576), generator=gen).bfloat16().to(DEV)
        kv = torch.randn((b, n, 576), generator=gen).bfloat16().to(DEV)
        ids = torch.randint(-1, n + 3, (b, t, k), generator=gen, dtype=torch.int32).to(DEV)
        length = torch.randint(0, k + 3, (b, t), generator=gen, dtype=torch.int32).to(DEV)
        return (q, kv, ids), dict(attn_sink=torch.randn(h, generator=gen).to(DEV), topk_length=length)
    h, k = (16, 200) if case == "padded_heads" else (128, 256)
    q, kv, ids, sink, length = make_inputs(9, h, 576, k, 700, seed=int(torch.randint(0, 2**30, (1,), generator=gen)),
                                           length=True, adversarial=True)
    if case == "padded_heads":
        return (q, kv, ids), dict(attn_sink=sink.double(), topk_length=length)
    if case == "misaligned_kv":
        kv_off = torch.empty(kv.numel() + 4, dtype=kv.dtype, device=DEV)[4:].view(kv.shape)
        kv_off.copy_(kv)
        return (q, kv_off, ids), dict(attn_sink=sink, topk_length=length)
    return (q, kv, ids), dict(attn_sink=sink, topk_length=length, indexer_topk=128)


@pytest.mark.parametrize("case", ["padded_heads", "batched", "misaligned_kv", "indexer_prefix"])
def test_fast_path_repeats_the_full_path(case):
    """Eager calls of a signature that passed once run by their plan (dsagen.ops._fast_path): on new inputs of the
    same signature every output equals the full path's bytes (padded heads with an FP64 sink, the batched layout, a
    misaligned kv the op copies, the indexer prefix)."""
    from dsagen.ops import sparse_attention as sa

    gen = torch.Generator().manual_seed(500 + len(case))
    sa._FAST.clear()
    args, kw = _fast_path_inputs(case, gen)
    dsagen.sparse_attention(*args, **kw)
    assert len(sa._FAST) == 1
    args, kw = _fast_path_inputs(case, gen)
    fast = dsagen.sparse_attention(*args, **kw)
    sa._FAST.clear()
    want = dsagen.sparse_attention(*args, **kw)
    assert len(fast) == len(want)
    for a, b in zip(fast, want):
        assert (a is None and b is None) or torch.equal(a, b)
    if case != "batched":
        check_against_reference(*args, kw["attn_sink"], kw["topk_length"])
