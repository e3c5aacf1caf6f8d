"""GPU tests of the fused NSA selected-branch forward (`dsagen.native_sparse_attention(..., impl="fused")`, sm_90a
kernel of NsaSelectFwdSpec) against the plain-PyTorch reference and a dense FP64 oracle (every key weighted by how
many of the token's slots name its block) on fresh random inputs: GQA groups 1-64, odd lengths, B > 1, packed
sequences with empty and short ones, tokens before their first complete block, repeated, -1 and out-of-range ids,
per-token counts 0..S+, block sizes 32 / 64 / 128, head dims 64 / 128, fp16, neighbouring tokens sharing blocks (the
kernel's merged block list), the per-query-block index layout, g_slc, and what the kernel does not cover.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under `compute-sanitizer`.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.nsa.host import _forward, _Operands, select_backward, select_forward
from dsagen.kernels.nsa.spec import NsaSelectDkvSpec, select_dq_spec_for, select_fwd_spec_for
from poison import poison_allocator

ARCH = "sm_90a"
DEV = "cuda"

# (group, D, Dv, block_size, slots, dtype) of every kernel the tests run
_SHAPES = [(g, 128, 128, 64, 16, "bfloat16") for g in (1, 2, 4, 8, 16, 32, 64)] + [
    (16, 64, 64, 64, 16, "bfloat16"), (4, 128, 64, 32, 16, "bfloat16"), (16, 128, 128, 128, 16, "bfloat16"),
    (16, 128, 128, 64, 16, "float16"), (4, 128, 128, 64, 32, "bfloat16")]
REQUIRED_SPECS = [select_fwd_spec_for(g, d, dv, bs, s, dt, ARCH) for g, d, dv, bs, s, dt in _SHAPES]
# the backward's kernels: dq (the forward's fields) and dk / dv, for the shapes test_backward_* run
# (blocks of 32 and 128 run the dk / dv kernel of 64 rows)
_BWD_SHAPES = [(g, 128, 128, 64, 16, "bfloat16") for g in (1, 4, 16)] + [(16, 64, 64, 64, 16, "bfloat16")]
_BWD_SHAPES += [(16, 128, 128, 32, 16, "bfloat16"), (4, 128, 128, 128, 16, "bfloat16")]
REQUIRED_SPECS += [select_fwd_spec_for(4, 128, 128, 128, 16, "bfloat16", ARCH),
                   select_fwd_spec_for(16, 128, 128, 32, 16, "bfloat16", ARCH)]
REQUIRED_SPECS += [select_dq_spec_for(*x, ARCH) for x in _BWD_SHAPES]
REQUIRED_SPECS += [NsaSelectDkvSpec(arch=ARCH, group=g, head_dim=d, v_dim=dv, dtype=dt)
                   for g, d, dv, bs, _, dt in _BWD_SHAPES if bs == 64]
# the overlapped dk / dv kernel beside the one-chunk-at-a-time one (test_dkv_overlap_same_bytes)
_OVERLAP_SHAPES = [(16, 128, 128), (4, 128, 64), (1, 64, 64)]
REQUIRED_SPECS += [NsaSelectDkvSpec(arch=ARCH, group=g, head_dim=d, v_dim=dv, stages=st, overlap=ov)
                   for g, d, dv in _OVERLAP_SHAPES for st, ov in ((2, False), (3, True), (2, True))]
REQUIRED_SPECS += [f(g, d, dv, 64, 16, "bfloat16", ARCH) for g, d, dv in _OVERLAP_SHAPES
                   for f in (select_fwd_spec_for, select_dq_spec_for)]

pytestmark = pytest.mark.gpu


def make_ids(b, t, h, s, block_size, gen, *, adversarial=True, shared=False, seq_lens=None):
    """Block ids [b, t, h, s] int64: random blocks a token may see (its own and earlier ones), with repeats; when
    adversarial also -1, negative, out-of-range and future ids; when shared the tokens of a 16-token group draw
    from a common pool (so the kernel merges their blocks). seq_lens: packed sequences (b = 1), local ids."""
    pos = torch.arange(t)
    if seq_lens is not None:
        starts = torch.repeat_interleave(torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)[:-1])),
                                         torch.tensor(seq_lens))
        pos = pos - starts
    own = (pos // block_size)[None, :, None, None].expand(b, t, h, s)
    u = torch.rand((b, t, h, s), generator=gen)
    if shared:
        grp = torch.rand((b, (t + 15) // 16, h, s), generator=gen)
        u = grp.repeat_interleave(16, dim=1)[:, :t]
    ids = (u * (own + 1).double()).long()                       # 0..own
    ids[..., 0] = own[..., 0]                                   # the own block (NSA always selects it)
    if adversarial:
        r = torch.rand((b, t, h, s), generator=gen)
        ids = torch.where(r < 0.05, torch.full_like(ids, -1), ids)
        ids = torch.where((r >= 0.05) & (r < 0.08), own + 1 + (r * 100).long() % 3, ids)     # future / past end
        ids = torch.where((r >= 0.08) & (r < 0.10), torch.full_like(ids, -7), ids)
        ids = torch.where((r >= 0.10) & (r < 0.15), ids.roll(1, dims=-1), ids)               # repeats
    return ids


def dense_oracle(q, k, v, ids, counts, scale, block_size, cu=None):
    """FP64 (o, lse) by dense scores: key j of token t weighted by the number of t's valid slots naming j's block
    (j <= t, same sequence); o = 0, lse = -inf without keys."""
    b, t, hq, _ = q.shape
    h = k.shape[2]
    g = hq // h
    qd, kd, vd = q.double(), k.double(), v.double()
    seq = torch.zeros(t, dtype=torch.long)
    first = torch.zeros(t, dtype=torch.long)
    lens = torch.full((t,), t)
    if cu is not None:
        for i in range(len(cu) - 1):
            seq[cu[i]:cu[i + 1]] = i
            first[cu[i]:cu[i + 1]] = cu[i]
            lens[cu[i]:cu[i + 1]] = cu[i + 1] - cu[i]
    nb = (lens + block_size - 1) // block_size
    ids = ids.cpu().long()
    s = ids.shape[-1]
    cnt = counts.cpu().long() if isinstance(counts, torch.Tensor) else torch.full((b, t, h), counts)
    ok = (ids >= 0) & (ids < nb[None, :, None, None]) & (torch.arange(s) < cnt[..., None])
    weight = torch.zeros((b, t, h, t), dtype=torch.float64)
    key_pos = torch.arange(t)
    for sl in range(s):
        blk_first = first[None, :, None] + ids[..., sl] * block_size                # [b, t, h] key rows
        inblk = (key_pos[None, None, None, :] >= blk_first[..., None]) & \
                (key_pos[None, None, None, :] < blk_first[..., None] + block_size)
        weight += (inblk & ok[..., sl, None]).double()
    causal = (key_pos[None, :] <= torch.arange(t)[:, None]) & (seq[None, :] == seq[:, None])
    weight = weight * causal[None, :, None, :]
    out = torch.zeros((b, t, hq, v.shape[-1]), dtype=torch.float64)
    lse = torch.full((b, t, hq), -math.inf, dtype=torch.float64)
    for hh in range(h):
        sc = torch.einsum("btgd,bsd->btgs", qd[:, :, hh * g:(hh + 1) * g].cpu(), kd[:, :, hh].cpu()) * scale
        w = weight[:, :, hh][:, :, None, :]
        logits = torch.where(w > 0, sc + torch.log(w.clamp(min=1e-300)), torch.full_like(sc, -math.inf))
        l_ = torch.logsumexp(logits, dim=-1)
        p = torch.where(torch.isfinite(l_)[..., None], torch.exp(logits - l_[..., None]), torch.zeros_like(logits))
        out[:, :, hh * g:(hh + 1) * g] = torch.einsum("btgs,bsd->btgd", p, vd[:, :, hh].cpu())
        lse[:, :, hh * g:(hh + 1) * g] = l_
    return out, lse


def _inputs(b, t, hq, h, d, dv, dtype, gen):
    q = torch.randn((b, t, hq, d), generator=gen).to(dtype).to(DEV)
    k = torch.randn((b, t, h, d), generator=gen).to(dtype).to(DEV)
    v = torch.randn((b, t, h, dv), generator=gen).to(dtype).to(DEV)
    return q, k, v


def _check(q, k, v, ids, counts, block_size=64, cu=None, scale=None):
    """Fused select_forward against the dense oracle (o and lse) and the public op against the reference."""
    poison_allocator()
    d = q.shape[-1]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    ids_d = ids.to(DEV)
    cnt_d = counts.to(DEV) if isinstance(counts, torch.Tensor) else counts
    cu_d = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    o, lse = select_forward(q, k, v, ids_d, cnt_d, cu_d, sc, block_size)
    ro, rlse = dense_oracle(q, k, v, ids, counts, sc, block_size, cu)
    torch.testing.assert_close(o.double().cpu(), ro, atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(rlse)), "empty rows differ"
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse.double().cpu()[fin], rlse[fin], atol=2e-4, rtol=1e-4)
    pub = dsagen.native_sparse_attention(q, k, v, block_indices=ids_d, block_counts=cnt_d, cu_seqlens=cu_d,
                                         softmax_scale=scale, block_size=block_size)
    ref = dsagen.native_sparse_attention(q, k, v, block_indices=ids_d, block_counts=cnt_d, cu_seqlens=cu_d,
                                         softmax_scale=scale, block_size=block_size, impl="reference")
    torch.testing.assert_close(pub.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hq,h", [(4, 4), (8, 4), (16, 4), (32, 4), (64, 4), (64, 2), (64, 1)])
def test_groups_adversarial(hq, h):
    """Every GQA group 1..64 (G < 4: padded tiles), B = 2, odd T, adversarial ids, S = 16."""
    gen = torch.Generator().manual_seed(1000 + hq * 10 + h)
    b, t = 2, 301
    q, k, v = _inputs(b, t, hq, h, 128, 128, torch.bfloat16, gen)
    ids = make_ids(b, t, h, 16, 64, gen)
    _check(q, k, v, ids, 16)


def test_shared_blocks_and_counts_adversarial():
    """Neighbouring tokens draw from one pool (the merged list holds blocks several tokens chose, with repeats);
    per-token counts 0..S+3 (0: an empty row, o 0 and lse -inf)."""
    gen = torch.Generator().manual_seed(7)
    b, t, h = 1, 517, 4
    q, k, v = _inputs(b, t, 64, h, 128, 128, torch.bfloat16, gen)
    ids = make_ids(b, t, h, 16, 64, gen, shared=True)
    counts = torch.randint(0, 20, (b, t, h), generator=gen)
    counts[0, :5] = 0
    _check(q, k, v, ids, counts.int())


def test_packed_sequences_adversarial():
    """cu_seqlens with empty, one-token and short sequences; ids sequence-local."""
    gen = torch.Generator().manual_seed(11)
    lens = [130, 0, 1, 63, 64, 200, 0, 5]
    t = sum(lens)
    q, k, v = _inputs(1, t, 16, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, t, 4, 16, 64, gen, seq_lens=lens)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    _check(q, k, v, ids, 16, cu=cu)


@pytest.mark.parametrize("hq,h,d,dv,bs,dtype", [(64, 4, 64, 64, 64, torch.bfloat16),
                                                (16, 4, 128, 64, 32, torch.bfloat16),
                                                (64, 4, 128, 128, 128, torch.bfloat16),
                                                (64, 4, 128, 128, 64, torch.float16)])
def test_shapes_and_dtypes(hq, h, d, dv, bs, dtype):
    """Head dims 64 / 128, block sizes 32 / 64 / 128, fp16, a softmax scale of its own."""
    gen = torch.Generator().manual_seed(hq + d + dv + bs)
    b, t = 2, 260
    q, k, v = _inputs(b, t, hq, h, d, dv, dtype, gen)
    ids = make_ids(b, t, h, 16, bs, gen)
    _check(q, k, v, ids, 12, block_size=bs, scale=0.07)


def test_more_slots():
    """32 slots per token (its own kernel: max_slots 32), G = 4 (16 tokens per item)."""
    gen = torch.Generator().manual_seed(5)
    b, t = 1, 700
    q, k, v = _inputs(b, t, 16, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(b, t, 4, 32, 64, gen, shared=True)
    _check(q, k, v, ids, 32)


def test_per_query_block_layout_and_gate():
    """ejkernel's [B, H, NQB, S] ids and [B, H, NQB] counts give what their per-token expansion gives; g_slc scales
    the output."""
    gen = torch.Generator().manual_seed(3)
    b, t, h, s, bs = 1, 300, 4, 8, 64
    q, k, v = _inputs(b, t, 64, h, 128, 128, torch.bfloat16, gen)
    nqb = (t + bs - 1) // bs
    own = torch.arange(nqb)[None, None, :, None]
    ids = (torch.rand((b, h, nqb, s), generator=gen) * (own + 1)).long()
    ids[..., 0] = own[..., 0]
    counts = torch.randint(1, s + 1, (b, h, nqb), generator=gen)
    g_slc = torch.rand((b, t, 64), generator=gen).to(DEV)
    args = dict(block_indices=ids.to(DEV), block_counts=counts.to(DEV), g_slc=g_slc, block_size=bs)
    got = dsagen.native_sparse_attention(q, k, v, **args)
    ref = dsagen.native_sparse_attention(q, k, v, impl="reference", **args)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_repeated_calls_bitwise_equal():
    """The same inputs give the same bytes (no atomics, a fixed order of blocks)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = _inputs(1, 1000, 64, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 1000, 4, 16, 64, gen, shared=True).to(DEV)
    a = dsagen.native_sparse_attention(q, k, v, block_indices=ids)
    b2 = dsagen.native_sparse_attention(q, k, v, block_indices=ids)
    assert torch.equal(a, b2)


def test_what_the_kernel_does_not_cover():
    """FP32 inputs (and, with g_cmp, more than 64 selected blocks) raise NotImplementedError naming the reason
    (the compressed branch's other limits: test_nsa_compressed.py)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = _inputs(1, 64, 16, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 64, 4, 4, 64, gen, adversarial=False).to(DEV)
    g = torch.ones((1, 64, 16), device=DEV)
    with pytest.raises(NotImplementedError, match="at most 64"):
        dsagen.native_sparse_attention(q, k, v, g_cmp=g, block_counts=65)
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        dsagen.native_sparse_attention(q.float(), k.float(), v.float(), block_indices=ids)


def test_custom_op_and_out_variant():
    """torch.ops.dsagen.native_sparse_attention (an int count, or per-token counts) and its _out variant give the
    public op's bytes."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = _inputs(1, 300, 64, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 300, 4, 16, 64, gen).to(DEV)
    counts = torch.randint(0, 17, (1, 300, 4), generator=gen, dtype=torch.int32).to(DEV)
    want = dsagen.native_sparse_attention(q, k, v, block_indices=ids, block_counts=counts)
    got = torch.ops.dsagen.native_sparse_attention(q, k, v, block_indices=ids, block_counts_per_token=counts)
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    torch.ops.dsagen.native_sparse_attention_out(q, k, v, block_indices=ids, block_counts=12, out_out=out)
    assert torch.equal(out, dsagen.native_sparse_attention(q, k, v, block_indices=ids, block_counts=12))


def test_cuda_graph_capture():
    """A captured call replays on new inputs (nothing synchronizes or reads the device on the host)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = _inputs(2, 257, 16, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(2, 257, 4, 16, 64, gen).to(DEV)
    f = lambda: dsagen.native_sparse_attention(q, k, v, block_indices=ids)   # noqa: E731
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    q2, k2, v2 = _inputs(2, 257, 16, 4, 128, 128, torch.bfloat16, gen)
    q.copy_(q2)
    k.copy_(k2)
    v.copy_(v2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f())


def test_torch_compile():
    """torch.compile(fullgraph=True) of the op (the kernel as an opaque custom op, g_slc traced) gives the eager
    bytes, with an int count and with per-token counts."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _inputs(1, 300, 64, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 300, 4, 16, 64, gen).to(DEV)
    counts = torch.randint(0, 17, (1, 300, 4), generator=gen, dtype=torch.int32).to(DEV)
    g_slc = torch.rand((1, 300, 64), generator=gen).to(DEV)

    def f(q, k, v, ids, counts, g_slc):
        return (dsagen.native_sparse_attention(q, k, v, g_slc=g_slc, block_indices=ids, block_counts=counts),
                dsagen.native_sparse_attention(q, k, v, block_indices=ids, block_counts=12))

    compiled = torch.compile(f, fullgraph=True)(q, k, v, ids, counts, g_slc)
    eager = f(q, k, v, ids, counts, g_slc)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


def _grads(impl, q, k, v, ids, counts, cu, bs, g_slc, dout, dtype=None):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    gate = None if g_slc is None else g_slc.detach().to(dtype or g_slc.dtype).requires_grad_()
    out = dsagen.native_sparse_attention(*leaves, g_slc=gate, block_indices=ids, block_counts=counts, cu_seqlens=cu,
                                         block_size=bs, impl=impl)
    grads = torch.autograd.grad(out, leaves + ([gate] if gate is not None else []), dout.to(out.dtype))
    return out, grads


@pytest.mark.parametrize("case", ["g16", "g4_counts", "g1_packed", "g16_d64_gate", "g16_bs32", "g4_bs128_packed"])
def test_backward_matches_reference(case):
    """dq, dk, dv (and d g_slc) of the fused backward against autograd of the FP64 reference on the same bf16 inputs:
    adversarial ids, per-token counts with zeros, packed sequences with empty and short ones, G 16 / 4 / 1, head dims
    64 / 128, g_slc, shared blocks, blocks of 32 and 128."""
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    cu = None
    counts = 16
    bs, d, g_slc = 64, 128, None
    if case == "g16":
        b, t, hq, h = 2, 301, 64, 4
        ids = make_ids(b, t, h, 16, bs, gen, shared=True)
    elif case == "g4_counts":
        b, t, hq, h = 1, 517, 16, 4
        ids = make_ids(b, t, h, 16, bs, gen)
        counts = torch.randint(0, 20, (b, t, h), generator=gen, dtype=torch.int32).to(DEV)
    elif case == "g1_packed":
        lens = [130, 0, 1, 63, 64, 200, 5]
        b, t, hq, h = 1, sum(lens), 4, 4
        ids = make_ids(b, t, h, 16, bs, gen, seq_lens=lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    elif case == "g16_d64_gate":
        b, t, hq, h, bs, d = 1, 260, 64, 4, 64, 64
        ids = make_ids(b, t, h, 16, bs, gen, shared=True)
        g_slc = torch.rand((b, t, hq), generator=gen).to(DEV)
    elif case == "g16_bs32":
        b, t, hq, h, bs = 2, 301, 64, 4, 32
        ids = make_ids(b, t, h, 16, bs, gen, shared=True)
        counts = torch.randint(0, 20, (b, t, h), generator=gen, dtype=torch.int32).to(DEV)
    else:
        lens = [300, 0, 1, 127, 128, 129, 450]
        b, t, hq, h, bs = 1, sum(lens), 16, 4, 128
        ids = make_ids(b, t, h, 16, bs, gen, seq_lens=lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = _inputs(b, t, hq, h, d, d, torch.bfloat16, gen)
    dout = torch.randn((b, t, hq, d), generator=gen).to(DEV)
    ids = ids.to(DEV)
    out, got = _grads("fused", q, k, v, ids, counts, cu, bs, g_slc, dout)
    ref_out, want = _grads("reference", q, k, v, ids, counts, cu, bs, g_slc, dout, torch.float64)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    for name, a, w in zip(("dq", "dk", "dv", "dg"), got, want):
        err = (a.double() - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= 2e-2 * scale + 1e-3, f"{name}: max err {err:.3g} against max |ref| {scale:.3g}"


def test_backward_bitwise_repeatable():
    """The same inputs give the same dq, dk and dv bytes (fixed-order sums, no atomics)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = _inputs(1, 700, 64, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 700, 4, 16, 64, gen, shared=True).to(DEV)
    dout = torch.randn((1, 700, 64, 128), generator=gen).to(DEV)
    a = _grads("fused", q, k, v, ids, 16, None, 64, None, dout)[1]
    b2 = _grads("fused", q, k, v, ids, 16, None, 64, None, dout)[1]
    assert all(torch.equal(x, y) for x, y in zip(a, b2))


def select_grads(q, k, v, ids, counts, cu, bs, dout, dkv_spec):
    """(dq, dk, dv) of the fused selected branch with the dk / dv kernel of `dkv_spec` (host.select_backward)."""
    ops = _Operands(q, k, v, ids, counts, cu, 1.0 / math.sqrt(q.shape[-1]), bs)
    out, lse = _forward(ops, None)
    return select_backward(ops, out, lse, dout.to(q.dtype), dkv_spec=dkv_spec)


@pytest.mark.parametrize("g,d,dv", _OVERLAP_SHAPES)
def test_dkv_overlap_same_bytes(g, d, dv):
    """The overlapped dk / dv kernel (the next chunk's S^T / dP^T issued before this chunk's dv / dk; 3 stages, and
    2 where the next chunk's load waits for this chunk's release) gives the bytes of the one-chunk-at-a-time kernel:
    the same products in the same order. Adversarial ids, per-token counts with zeros, packed sequences with empty and
    short ones (lists of one token, of many chunks, and blocks no token chose)."""
    gen = torch.Generator().manual_seed(40 + g)
    lens = [300, 0, 1, 63, 64, 700, 5]
    t, h = sum(lens), 4
    ids = make_ids(1, t, h, 16, 64, gen, seq_lens=lens).to(DEV)
    counts = torch.randint(0, 20, (1, t, h), generator=gen, dtype=torch.int32).to(DEV)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = _inputs(1, t, g * h, h, d, dv, torch.bfloat16, gen)
    dout = torch.randn((1, t, g * h, dv), generator=gen).to(DEV)
    base = NsaSelectDkvSpec(arch=ARCH, group=g, head_dim=d, v_dim=dv)
    want = select_grads(q, k, v, ids, counts, cu, 64, dout, base)
    assert want[1].abs().max() > 0 and want[2].abs().max() > 0
    for stages in (3, 2):
        got = select_grads(q, k, v, ids, counts, cu, 64, dout,
                           NsaSelectDkvSpec(arch=ARCH, group=g, head_dim=d, v_dim=dv, stages=stages, overlap=True))
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(a, w), f"{name} differs with stages={stages}"


def test_graph_capture_forward_backward():
    """A captured forward + backward step of the selected branch (g_slc, per-token counts; eager autograd inside
    torch.cuda.graph, the inverse index a device sort) replays on new inputs and gives the eager step's output and
    gradients."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 600, 64, 4, 128, 128, torch.bfloat16, gen))
    ids = make_ids(1, 600, 4, 16, 64, gen, shared=True).to(DEV)
    counts = torch.randint(0, 17, (1, 600, 4), generator=gen, dtype=torch.int32).to(DEV)
    g_slc = torch.rand((1, 600, 64), generator=gen).to(DEV).requires_grad_()
    dout = torch.randn((1, 600, 64, 128), generator=gen).to(DEV).bfloat16()

    def step():
        out = dsagen.native_sparse_attention(q, k, v, g_slc=g_slc, block_indices=ids, block_counts=counts)
        return (out, *torch.autograd.grad(out, (q, k, v, g_slc), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for x in (q, k, v, dout):
            x.copy_(torch.randn(x.shape, generator=gen).to(x))
        ids.copy_(make_ids(1, 600, 4, 16, 64, gen, shared=True).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg"), captured, step()):
        assert torch.equal(a, b), name


def test_torch_compile_backward():
    """torch.compile(fullgraph=True) of the op with gradients (the kernels as custom ops with registered autograd;
    AOTAutograd compiles the backward) gives the eager output's and gradients' bytes."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = _inputs(1, 300, 64, 4, 128, 128, torch.bfloat16, gen)
    ids = make_ids(1, 300, 4, 16, 64, gen, shared=True).to(DEV)
    dout = torch.randn((1, 300, 64, 128), generator=gen).bfloat16().to(DEV)

    def f(q, k, v):
        return dsagen.native_sparse_attention(q, k, v, block_indices=ids)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        results.append((out, *(x.grad for x in leaves)))
    assert all(torch.equal(a, b) for a, b in zip(*results))
