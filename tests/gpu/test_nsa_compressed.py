"""GPU tests of the fused NSA compressed branch (`dsagen.native_sparse_attention(..., g_cmp=...)`, forward; kernels
of NsaCmpFwdSpec, NsaCmpImportanceSpec, NsaCmpTopkSpec and the selected branch's) against an FP64 oracle on fresh
random inputs: GQA groups 1-64, odd lengths, B > 1, packed sequences with empty and short ones, tokens before their
first complete block, block sizes 32 / 64 / 128, head dims 64 / 128, per-token counts, selection widths past the
candidates; CUDA-graph capture, torch.compile, repeatability, and what the kernels do not cover.

The oracle pools the keys and values in FP64 and rounds them to the inputs' dtype, as the kernels read them. The
compressed attention (o_cmp, lse_cmp) is compared with the oracle's; the selection by the importance the oracle gives
the selected blocks (equal up to near-ties, where FP32 and FP64 sums may order two blocks differently); the output by
the oracle's selected branch on the kernels' own selection plus its compressed branch, gated.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.nsa.host import compressed_forward
from dsagen.kernels.nsa.spec import (NsaCmpDkvSpec, NsaCmpTopkSpec, NsaSelectDkvSpec, cmp_dq_spec_for,
                                     cmp_fwd_spec_for, cmp_importance_spec_for, select_dq_spec_for,
                                     select_fwd_spec_for)
from dsagen.reference import nsa as ref
from poison import poison_allocator

ARCH = "sm_90a"
DEV = "cuda"

# (group, D, Dv, dtype) of every shape the tests run; tiles of 64 compressed rows: 16 (one kernel per shape)
_SHAPES = [(g, 128, 128, "bfloat16") for g in (1, 2, 4, 8, 16, 32, 64)] + [(16, 64, 64, "bfloat16"),
                                                                           (16, 128, 128, "float16")]
REQUIRED_SPECS = [cmp_fwd_spec_for(g, d, dv, 1, dt, ARCH) for g, d, dv, dt in _SHAPES]
REQUIRED_SPECS += [cmp_importance_spec_for(g, d, 1, dt, ARCH) for g, d, _, dt in _SHAPES]
REQUIRED_SPECS += [NsaCmpTopkSpec(arch=ARCH)]
# the selected branch on the kernels' selection: each shape at blocks of 64, G 16 at 32 / 128, 20 slots packed
REQUIRED_SPECS += [select_fwd_spec_for(g, d, dv, 64, 16, dt, ARCH) for g, d, dv, dt in _SHAPES]
REQUIRED_SPECS += [select_fwd_spec_for(16, 128, 128, bs, 16, "bfloat16", ARCH) for bs in (32, 128)]
REQUIRED_SPECS += [select_fwd_spec_for(4, 128, 128, 32, 20, "bfloat16", ARCH)]
# the backward with g_cmp: the selected branch's dq / dk / dv and the compressed branch's (dk / dv of 64 rows for
# every block size)
_BWD = [(16, 128, 128, 16), (4, 128, 128, 20), (1, 128, 128, 16), (16, 64, 64, 16)]
REQUIRED_SPECS += [select_fwd_spec_for(4, 128, 128, 64, 20, "bfloat16", ARCH)]
REQUIRED_SPECS += [select_dq_spec_for(g, d, dv, 64, s, "bfloat16", ARCH) for g, d, dv, s in _BWD]
REQUIRED_SPECS += [select_fwd_spec_for(4, 128, 128, 128, 16, "bfloat16", ARCH)]
REQUIRED_SPECS += [select_dq_spec_for(g, 128, 128, bs, 16, "bfloat16", ARCH) for g, bs in ((16, 32), (4, 128))]
REQUIRED_SPECS += [cmp_dq_spec_for(g, d, dv, 1, "bfloat16", ARCH) for g, d, dv, _ in _BWD]
for _cls in (NsaSelectDkvSpec, NsaCmpDkvSpec):
    REQUIRED_SPECS += [_cls(arch=ARCH, group=g, head_dim=d, v_dim=dv) for g, d, dv, _ in _BWD]

pytestmark = pytest.mark.gpu


def _inputs(b, t, hq, h, d, dv, dtype, gen):
    q = torch.randn((b, t, hq, d), generator=gen).to(dtype).to(DEV)
    k = torch.randn((b, t, h, d), generator=gen).to(dtype).to(DEV)
    v = torch.randn((b, t, h, dv), generator=gen).to(dtype).to(DEV)
    return q, k, v


def _segments(b, t, cu):
    return [(bi, 0, t) for bi in range(b)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def cmp_oracle(q, k, v, bs, scale, cu=None):
    """FP64 per token: o_cmp [B, T, HQ, Dv], lse_cmp [B, T, HQ] (-inf without a complete block) and the importance
    imp [B, T, H, NBmax] (own block G, future blocks -inf), keys / values pooled in FP64 and rounded to q's dtype."""
    b, t, hq, d = q.shape
    h, dv = k.shape[2], v.shape[3]
    g = hq // h
    nbmax = max([-(-(e - s) // bs) for _, s, e in _segments(b, t, cu)] + [1])
    o = torch.zeros((b, t, hq, dv), dtype=torch.float64)
    lse = torch.full((b, t, hq), -math.inf, dtype=torch.float64)
    imp = torch.full((b, t, h, nbmax), -math.inf, dtype=torch.float64)
    for bi, s0, s1 in _segments(b, t, cu):
        if s1 == s0:
            continue
        qs = q[bi, s0:s1].double().cpu()
        kc = ref.mean_pool_blocks(k[bi, s0:s1].double().cpu(), bs).to(q.dtype).double()
        vc = ref.mean_pool_blocks(v[bi, s0:s1].double().cpu(), bs).to(q.dtype).double()
        nb = kc.shape[0]
        pos = torch.arange(s1 - s0)
        sc = torch.einsum("lhgd,chd->lhgc", qs.view(-1, h, g, d), kc) * scale
        allowed = torch.arange(nb)[None, :] < ((pos + 1) // bs)[:, None]               # [L, NB]
        sc = sc.masked_fill(~allowed[:, None, None, :], -math.inf)
        l_ = torch.logsumexp(sc, dim=-1)                                              # [L, H, G]
        p = torch.where(allowed[:, None, None, :], torch.exp(sc - l_.nan_to_num(neginf=0.0)[..., None]), 0.0)
        o[bi, s0:s1] = torch.einsum("lhgc,chv->lhgv", p, vc).reshape(-1, hq, dv)
        lse[bi, s0:s1] = l_.reshape(-1, hq)
        own = (pos // bs)[:, None, None]
        blocks = torch.arange(nb)[None, None, :]
        im = p.sum(2)
        im = torch.where(blocks < own, im, torch.where(blocks == own, float(g), -math.inf))
        imp[bi, s0:s1, :, :nb] = im
    return o, lse, imp


def _selected_reference(q, k, v, sel, counts, bs, scale, cu):
    """The reference's selected branch (FP64) on the kernels' selection."""
    cu_d = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    return ref.native_sparse_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), None, None,
                                       sel.long().cpu(), counts.cpu() if isinstance(counts, torch.Tensor) else counts,
                                       cu_d, softmax_scale=scale, block_size=bs)


def _check(q, k, v, bs, n_select, counts=None, cu=None, gates=True, gen=None):
    poison_allocator()
    b, t, hq, d = q.shape
    h = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    cu_d = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    o_cmp, lse, sel = compressed_forward(q, k, v, n_select, cu_d, scale, bs)
    ro, rlse, imp = cmp_oracle(q, k, v, bs, scale, cu)
    torch.testing.assert_close(o_cmp.double().cpu(), ro, atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(rlse)), "rows without a complete block differ"
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse.double().cpu()[fin], rlse[fin], atol=2e-4, rtol=1e-4)

    # selection: -1 exactly past the candidates, the own block first, and the importance of what was selected the
    # oracle's top n_select values (sorted, within FP32-sum tolerance)
    sel_c = sel.long().cpu()
    cand = torch.isfinite(imp).sum(-1)                                                 # own + 1 per (t, h)
    slots = torch.arange(n_select)
    assert torch.equal(sel_c < 0, slots >= cand[..., None]), "padding slots differ"
    if n_select:
        tok_pos = torch.cat([torch.arange(e - s) for _, s, e in _segments(b, t, cu)]).view(-1, t) \
            if cu is not None else torch.arange(t)[None].expand(b, t)
        assert torch.equal(sel_c[..., 0], (tok_pos // bs)[..., None].expand(b, t, h)), "own block not first"
        got = torch.where(sel_c >= 0, imp.gather(-1, sel_c.clamp(min=0)), -math.inf)
        want = imp.sort(-1, descending=True).values[..., :n_select]
        if want.shape[-1] < n_select:
            want = torch.cat([want, want.new_full((*want.shape[:-1], n_select - want.shape[-1]), -math.inf)], -1)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin)
        torch.testing.assert_close(got[fin], want[fin], atol=1e-4 * (hq // h), rtol=0)
        assert (got[..., :-1][fin[..., 1:]] >= got[..., 1:][fin[..., 1:]] - 1e-4 * (hq // h)).all(), "not sorted"

    # the public op: the reference's selected branch on this selection plus the compressed branch, gated
    cnt = n_select if counts is None else counts
    g_cmp = torch.rand((b, t, hq), generator=gen).to(DEV) if gates else torch.ones((b, t, hq), device=DEV)
    g_slc = torch.rand((b, t, hq), generator=gen).to(DEV) if gates else None
    out = dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=cnt, cu_seqlens=cu_d,
                                         block_size=bs)
    o_slc = _selected_reference(q, k, v, sel, cnt, bs, scale, cu)
    want = o_slc * (1.0 if g_slc is None else g_slc.double().cpu()[..., None]) + ro * g_cmp.double().cpu()[..., None]
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
    return out, sel


@pytest.mark.parametrize("hq,h", [(4, 4), (8, 4), (16, 4), (32, 4), (64, 4), (64, 2), (64, 1)])
def test_groups(hq, h):
    """Every GQA group (1-64 query heads per KV head), odd T, B 2, 16 selected blocks of 64 over T 1100 (17 blocks:
    the last tokens have more candidates than slots)."""
    gen = torch.Generator().manual_seed(100 + hq + h)
    q, k, v = _inputs(2, 1100, hq, h, 128, 128, torch.bfloat16, gen)
    _check(q, k, v, 64, 16, gen=gen)


@pytest.mark.parametrize("bs", [32, 128])
def test_block_sizes(bs):
    """Blocks of 32 and 128 tokens (compressed rows per tile and tokens per row differ)."""
    gen = torch.Generator().manual_seed(200 + bs)
    q, k, v = _inputs(1, 1500, 64, 4, 128, 128, torch.bfloat16, gen)
    _check(q, k, v, bs, 8, gen=gen)


def test_packed_sequences_and_counts():
    """Packed sequences (an empty one, one token, shorter than a block, one more than 64 blocks of 32) with per-token
    counts 0..20 and a selection width past many tokens' candidates."""
    gen = torch.Generator().manual_seed(300)
    cu = [0, 0, 1, 40, 2200, 2213, 2600]
    q, k, v = _inputs(1, cu[-1], 16, 4, 128, 128, torch.bfloat16, gen)
    counts = torch.randint(0, 21, (1, cu[-1], 4), generator=gen, dtype=torch.int32).to(DEV)
    _check(q, k, v, 32, 20, counts=counts, cu=cu, gen=gen)


@pytest.mark.parametrize("d,dv,dtype", [(64, 64, torch.bfloat16), (128, 128, torch.float16)])
def test_head_dims_and_fp16(d, dv, dtype):
    gen = torch.Generator().manual_seed(400 + d)
    q, k, v = _inputs(2, 700, 64, 4, d, dv, dtype, gen)
    _check(q, k, v, 64, 4, gates=False, gen=gen)


def test_repeatable_and_graph_capture():
    """Two calls give the same bytes; a captured call replays on new inputs."""
    gen = torch.Generator().manual_seed(500)
    q, k, v = _inputs(2, 900, 64, 4, 128, 128, torch.bfloat16, gen)
    g_cmp = torch.rand((2, 900, 64), generator=gen).to(DEV)

    def f():
        return dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, block_counts=8)

    a, b = f(), f()
    assert torch.equal(a, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    for x in (q, k, v):
        x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f())


def test_torch_compile():
    """torch.compile(fullgraph=True) with g_cmp and an int count: the kernels run as opaque custom ops (without
    gates the output is the eager bytes); with both gates Inductor fuses the FP32 gated sum (it may contract it to
    an FMA), so the output is the eager one within one bf16 rounding."""
    gen = torch.Generator().manual_seed(600)
    q, k, v = _inputs(1, 800, 16, 4, 128, 128, torch.bfloat16, gen)
    g_cmp = torch.rand((1, 800, 16), generator=gen).to(DEV)
    g_slc = torch.rand((1, 800, 16), generator=gen).to(DEV)
    ones = torch.ones_like(g_cmp)

    def f(q, k, v, g_cmp, g_slc):
        return dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=6)

    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(q, k, v, ones, None), f(q, k, v, ones, None)
    assert torch.equal(got, want), f"ungated: max diff {(got.float() - want.float()).abs().max().item()}"
    got, want = compiled(q, k, v, g_cmp, g_slc).float(), f(q, k, v, g_cmp, g_slc).float()
    err = (got - want).abs() - want.abs() * 2.0**-7        # one bf16 ulp: 2^-8 .. 2^-7 of the value
    assert (err <= 1e-6).all(), f"gated: worst excess {err.max().item()}"


def _cmp_reference(q, k, v, bs, scale, cu):
    """The reference's compressed attention (FP64, differentiable), [B, T, HQ, Dv]."""
    b, t, hq, _ = q.shape
    out = q.new_zeros((b, t, hq, v.shape[3]))
    pieces = []
    for bi, s0, s1 in _segments(b, t, cu):
        if s1 > s0:
            kc, vc = ref.mean_pool_blocks(k[bi, s0:s1], bs), ref.mean_pool_blocks(v[bi, s0:s1], bs)
            pieces.append((bi, s0, s1, ref._compressed_branch(q[bi, s0:s1], kc, vc, bs, scale, 0)[0]))
    rows = [torch.zeros_like(out[0])] * b
    for bi, s0, s1, o in pieces:
        rows[bi] = torch.cat([rows[bi][:s0], o, rows[bi][s1:]])
    return torch.stack(rows)


@pytest.mark.parametrize("case", ["g16", "g4_packed_counts", "g1", "g16_d64", "g16_bs32", "g4_packed_bs128"])
def test_backward_matches_reference(case):
    """dq, dk, dv, d g_cmp, d g_slc with g_cmp against autograd of the FP64 reference: its compressed attention plus
    its selected branch on the kernels' own selection (a constant, as in the op), gated; G 16 / 4 / 1, B 2 odd T,
    packed sequences with empty and short ones and per-token counts, D 64, blocks of 32 and 128; and two runs bitwise
    equal."""
    gen = torch.Generator().manual_seed(800 + len(case))
    cu, counts, d, bs = None, 16, 128, 64
    b, t, hq, h = 2, 1100, 64, 4
    if case == "g16_bs32":
        bs = 32
    elif case == "g4_packed_bs128":
        cu, bs = [0, 0, 3, 130, 900, 1500], 128
        b, t, hq = 1, 1500, 16
    elif case == "g4_packed_counts":
        cu = [0, 0, 3, 70, 700, 1500]
        b, t, hq = 1, 1500, 16
        counts = torch.randint(0, 21, (1, t, h), generator=gen, dtype=torch.int32).to(DEV)
    elif case == "g1":
        t, hq = 700, 4
    elif case == "g16_d64":
        t, d = 900, 64
    q, k, v = _inputs(b, t, hq, h, d, d, torch.bfloat16, gen)
    g_cmp = torch.rand((b, t, hq), generator=gen).to(DEV)
    g_slc = torch.rand((b, t, hq), generator=gen).to(DEV)
    dout = torch.randn((b, t, hq, d), generator=gen).to(DEV)
    cu_d = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    scale = 1.0 / math.sqrt(d)

    def fused():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g_cmp, g_slc)]
        out = dsagen.native_sparse_attention(leaves[0], leaves[1], leaves[2], g_cmp=leaves[3], g_slc=leaves[4],
                                             block_counts=counts, cu_seqlens=cu_d, block_size=bs)
        return out, torch.autograd.grad(out, leaves, dout.to(out.dtype))

    out, got = fused()
    n_select = counts if isinstance(counts, int) else int(counts.max())
    sel = compressed_forward(q, k, v, n_select, cu_d, scale, bs)[2]
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, g_cmp, g_slc)]
    cnt = counts if isinstance(counts, int) else counts.cpu()
    o_slc = ref.native_sparse_attention(*leaves[:3], None, None, sel.long().cpu(), cnt,
                                        None if cu is None else torch.tensor(cu), softmax_scale=scale, block_size=bs)
    o_cmp = _cmp_reference(*leaves[:3], bs, scale, cu)
    want_out = o_slc * leaves[4][..., None] + o_cmp * leaves[3][..., None]
    want = torch.autograd.grad(want_out, leaves, dout.double().cpu())
    torch.testing.assert_close(out.double().cpu(), want_out.detach(), atol=2e-2, rtol=2e-2)
    for name, a, w in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc"), got, want):
        err = (a.double().cpu() - w).abs().max().item()
        top = w.abs().max().item()
        assert err <= 2e-2 * top + 1e-3, f"{name}: max err {err:.3g} against max |ref| {top:.3g}"
    again = fused()[1]
    assert all(torch.equal(x, y) for x, y in zip(got, again)), "not bitwise repeatable"


def _train_step(q, k, v, g_cmp, g_slc, dout, fn=None):
    """One forward + backward with g_cmp: (out, dq, dk, dv, d g_cmp, d g_slc)."""
    fn = fn or (lambda *x: dsagen.native_sparse_attention(*x[:3], g_cmp=x[3], g_slc=x[4], block_counts=8))
    out = fn(q, k, v, g_cmp, g_slc)
    return (out, *torch.autograd.grad(out, (q, k, v, g_cmp, g_slc), dout))


def test_torch_compile_backward():
    """torch.compile(fullgraph=True) of a forward + backward with g_cmp (the custom ops dsagen::nsa_cmp_train_fwd /
    _bwd, opaque) gives the eager output and gradients, bitwise."""
    gen = torch.Generator().manual_seed(650)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 900, 64, 4, 128, 128, torch.bfloat16, gen))
    g_cmp, g_slc = (torch.rand((1, 900, 64), generator=gen).to(DEV).requires_grad_() for _ in range(2))
    dout = torch.randn((1, 900, 64, 128), generator=gen).to(DEV).bfloat16()

    def f(q, k, v, g_cmp, g_slc):
        return dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=8)

    eager = _train_step(q, k, v, g_cmp, g_slc, dout)
    compiled = _train_step(q, k, v, g_cmp, g_slc, dout, torch.compile(f, fullgraph=True))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg_cmp", "dg_slc"), compiled, eager):
        assert torch.equal(a, b), name


def test_graph_capture_forward_backward():
    """A captured forward + backward step with g_cmp (eager autograd inside torch.cuda.graph: nothing reads the device
    on the host) replays on new inputs and gives the eager step's output and gradients."""
    gen = torch.Generator().manual_seed(660)
    q, k, v = (x.requires_grad_() for x in _inputs(2, 700, 16, 4, 128, 128, torch.bfloat16, gen))
    g_cmp, g_slc = (torch.rand((2, 700, 16), generator=gen).to(DEV).requires_grad_() for _ in range(2))
    dout = torch.randn((2, 700, 16, 128), generator=gen).to(DEV).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _train_step(q, k, v, g_cmp, g_slc, dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _train_step(q, k, v, g_cmp, g_slc, dout)
    with torch.no_grad():
        for x in (q, k, v, g_cmp, g_slc, dout):
            x.copy_(torch.randn(x.shape, generator=gen).to(x) if x.dtype == torch.bfloat16
                    else torch.rand(x.shape, generator=gen).to(x))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg_cmp", "dg_slc"), captured,
                          _train_step(q, k, v, g_cmp, g_slc, dout)):
        assert torch.equal(a, b), name


def test_what_the_kernels_do_not_cover():
    """Per-token counts with g_cmp under torch.compile: NotImplementedError naming why."""
    gen = torch.Generator().manual_seed(700)
    q, k, v = _inputs(1, 200, 16, 4, 128, 128, torch.bfloat16, gen)
    g_cmp = torch.rand((1, 200, 16), generator=gen).to(DEV)
    counts = torch.full((1, 200, 4), 3, dtype=torch.int32, device=DEV)

    def f(q, k, v, g_cmp, counts):
        return dsagen.native_sparse_attention(q, k, v, g_cmp=g_cmp, block_counts=counts)

    with pytest.raises(Exception, match="per-token block_counts with g_cmp"):
        torch.compile(f, fullgraph=True)(q.detach(), k, v, g_cmp, counts)
