"""GPU tests of the fused QSA forwards (`dsagen.qsa_indexed_forward` / `dsagen.qsa_bitmap_forward` with
impl="fused", sm_90a kernels of QsaFwdSpec) against the plain-PyTorch reference and a dense FP64 oracle on fresh random
inputs: 12 / 1 and 24 / 2 heads at D 256 (and a small group at D 128 / Dv 64 in fp16), widths 4..2052 with -1
padding, partial tiles, out-of-range and repeated ids, empty rows, odd T, non-contiguous inputs; the bitmap form on
dense, sparse and empty rows, packed sequences (empty, shorter than a block, lengths not a multiple of 4) and its
equivalence with the indexed form (bitwise, on the same blocks in the same order); bitwise-repeatable calls, the
custom ops and their out variants, torch.compile and CUDA-graph capture.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under `compute-sanitizer`.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.qsa.spec import spec_for
from poison import poison_allocator

ARCH = "sm_90a"
DEV = "cuda"

# (G, D, Dv, dtype) of every kernel the tests run
_SHAPES = [(12, 256, 256, "bfloat16"), (4, 128, 64, "float16"), (1, 64, 64, "bfloat16")]
REQUIRED_SPECS = [spec_for(g, d, dv, dt, ARCH) for g, d, dv, dt in _SHAPES]
REQUIRED_SPECS += [spec_for(g, d, dv, dt, ARCH, bitmap=True) for g, d, dv, dt in _SHAPES[:2]]

pytestmark = pytest.mark.gpu


def make_inputs(t, hq, hkv, d, dv, w, gen, dtype=torch.bfloat16, *, adversarial=True, blocks=True):
    """q, k, v (normal, scaled so the softmax is not flat) and int32 ids [t, w]: per query its own four-token block
    cut at the query (the partial causal tail), then distinct earlier blocks, then -1 padding; adversarial adds
    out-of-range ids (>= T, < -1), a repeated id and rows with no valid id. blocks=False: ids drawn per slot."""
    q = (torch.randn(t, hq, d, generator=gen) * 0.5).to(dtype)
    k = (torch.randn(t, hkv, d, generator=gen) * 0.5).to(dtype)
    v = torch.randn(t, hkv, dv, generator=gen).to(dtype)
    ids = torch.full((t, w), -1, dtype=torch.int32)
    for i in range(t):
        if not blocks:
            ids[i] = torch.randint(-1, t, (w,), generator=gen, dtype=torch.int32)
            continue
        own = i // 4
        tail = torch.arange(own * 4, i + 1, dtype=torch.int32)
        earlier = torch.randperm(own, generator=gen)[: max(0, (w - 4) // 4)]
        n_blocks = int(torch.randint(0, earlier.numel() + 1, (1,), generator=gen))
        slots = [tail] + [torch.arange(4 * b, 4 * b + 4, dtype=torch.int32) for b in earlier[:n_blocks].tolist()]
        row = torch.cat(slots)[:w]
        ids[i, :row.numel()] = row
    if adversarial and t > 8:
        ids[1, 0] = t + 5                      # past the tokens: skipped
        ids[2, 1] = -7                         # negative: skipped
        ids[3, :] = -1                         # no valid id: out 0, lse -inf
        ids[5, 2] = ids[5, 0]                  # a repeated id counts once per slot
    return q.to(DEV), k.to(DEV), v.to(DEV), ids.to(DEV)


def oracle(q, k, v, ids, scale):
    """Dense FP64: every key weighted by how many slots of the row name it."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    idl = ids.long()
    valid = (idl >= 0) & (idl < t)
    cnt = torch.zeros(t, t, dtype=torch.float64, device=q.device)
    cnt.scatter_add_(1, torch.where(valid, idl, 0), valid.double())
    kh = k.double().repeat_interleave(g, dim=1)                        # [t, hq, d]
    vh = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,uhd->htu", q.double(), kh) * scale           # [hq, t, u]
    s = s.masked_fill(cnt[None] == 0, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * cnt[None]
    z = e.sum(-1)
    lse = torch.where(z > 0, m[..., 0] + torch.log(torch.where(z > 0, z, 1)), torch.full_like(z, float("-inf")))
    out = torch.einsum("htu,uhd->thd", e / torch.where(z > 0, z, 1)[..., None], vh)
    return out, lse


def check(q, k, v, ids, scale=None):
    d = q.shape[2]
    sc = 1 / math.sqrt(d) if scale is None else scale
    out, out32, lse = dsagen.qsa_indexed_forward(q, k, v, ids, scale)
    ref_out, ref_lse = oracle(q, k, v, ids, sc)
    assert out.dtype == q.dtype and out32.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out32.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=2e-2, rtol=1e-3)
    assert (lse[~fin] == float("-inf")).all() and out32.permute(1, 0, 2)[~fin].eq(0).all()
    r_out, r_out32, r_lse = dsagen.qsa_indexed_forward(q, k, v, ids, scale, impl="reference")
    torch.testing.assert_close(out32, r_out32, atol=2e-2, rtol=2e-2)
    return out, out32, lse


@pytest.mark.parametrize("t,hq,hkv,w", [(37, 12, 1, 64), (64, 24, 2, 68), (129, 12, 1, 2052), (9, 12, 1, 4)])
def test_indexed_forward_adversarial(t, hq, hkv, w):
    gen = torch.Generator().manual_seed(t * 7 + w)
    poison_allocator()                      # fresh allocations hold NaN bytes: a read of unwritten memory shows
    check(*make_inputs(t, hq, hkv, 256, 256, w, gen))


def test_random_ids_and_scale():
    gen = torch.Generator().manual_seed(3)
    q, k, v, ids = make_inputs(100, 12, 1, 256, 256, 200, gen, blocks=False)
    check(q, k, v, ids, scale=0.11)


@pytest.mark.parametrize("g,hkv,d,dv,dtype", [(4, 3, 128, 64, torch.float16), (1, 2, 64, 64, torch.bfloat16)])
def test_other_groups_and_dims(g, hkv, d, dv, dtype):
    gen = torch.Generator().manual_seed(g * 13 + d)
    check(*make_inputs(50, g * hkv, hkv, d, dv, 96, gen, dtype))


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(5)
    q, k, v, ids = make_inputs(40, 12, 1, 256, 256, 64, gen)
    wide = torch.zeros(40, 2, 12, 256, dtype=q.dtype, device=DEV)
    wide[:, 1] = q
    ids_t = ids.t().contiguous().t()                                    # column-major ids
    out_a = check(wide[:, 1], k, v, ids_t)[1]
    out_b = dsagen.qsa_indexed_forward(q, k, v, ids)[1]
    assert torch.equal(out_a, out_b)


def test_repeated_calls_are_bitwise_equal():
    gen = torch.Generator().manual_seed(11)
    q, k, v, ids = make_inputs(300, 24, 2, 256, 256, 512, gen, adversarial=False)
    first = dsagen.qsa_indexed_forward(q, k, v, ids)
    for _ in range(3):
        again = dsagen.qsa_indexed_forward(q, k, v, ids)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_empty_token_axis():
    q = torch.zeros(0, 12, 256, dtype=torch.bfloat16, device=DEV)
    k = v = torch.zeros(0, 1, 256, dtype=torch.bfloat16, device=DEV)
    out, out32, lse = dsagen.qsa_indexed_forward(q, k, v, torch.zeros(0, 4, dtype=torch.int32, device=DEV))
    assert out.shape == (0, 12, 256) and lse.shape == (12, 0)


def test_custom_op_out_variant_compile_and_graph():
    gen = torch.Generator().manual_seed(17)
    q, k, v, ids = make_inputs(48, 12, 1, 256, 256, 64, gen)
    want = dsagen.qsa_indexed_forward(q, k, v, ids)
    got = torch.ops.dsagen.qsa_indexed_forward(q, k, v, ids)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    outs = [torch.empty_like(x) for x in want]
    torch.ops.dsagen.qsa_indexed_forward_out(q, k, v, ids, out_out=outs[0], out_out_fp32=outs[1], out_lse=outs[2])
    assert all(torch.equal(a, b) for a, b in zip(want, outs))
    compiled = torch.compile(lambda *a: dsagen.qsa_indexed_forward(*a), fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(want, compiled(q, k, v, ids)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.qsa_indexed_forward(q, k, v, ids)
    q2 = (torch.randn(q.shape, generator=gen) * 0.5).to(q.dtype).to(DEV)
    q.copy_(q2)
    graph.replay()
    fresh = dsagen.qsa_indexed_forward(q, k, v, ids)
    assert all(torch.equal(a, b) for a, b in zip(fresh, captured))


def test_limits_are_value_errors():
    q = torch.zeros(8, 65, 64, dtype=torch.bfloat16, device=DEV)
    k = v = torch.zeros(8, 1, 64, dtype=torch.bfloat16, device=DEV)
    ids = torch.zeros(8, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="query heads per KV head"):
        dsagen.qsa_indexed_forward(q, k, v, ids)
    q = torch.zeros(8, 4, 96, dtype=torch.bfloat16, device=DEV)
    k = v = torch.zeros(8, 1, 96, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="head dim"):
        dsagen.qsa_indexed_forward(q, k, v, ids)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        dsagen.qsa_indexed_forward(q.float(), k.float(), v.float(), ids)


def bitmap_layout(t, cu):
    """(block of each token, its sequence's first token, NB) as the reference numbers them."""
    from dsagen.reference.qsa import bitmap_token_layout
    return bitmap_token_layout(t, None if cu is None else torch.tensor(cu, dtype=torch.int32), "cpu")


def bitmap_as_indices(bitmap, t, cu):
    """The index rows that select what `bitmap` does: per query its selected causal blocks of its own sequence in
    ascending order, four slots each, the own block's tokens after the query -1 (the bitmap kernel's tiles)."""
    block, starts, nb = bitmap_layout(t, cu)
    rows = []
    for i in range(t):
        s0 = int(starts[i])
        b0 = int(block[s0])
        own = (i - s0) // 4
        sel = [b for b in range(own + 1) if bitmap[i, b0 + b]]
        ids = [s0 + 4 * b + c if s0 + 4 * b + c <= i else -1 for b in sel for c in range(4)]
        rows.append(ids)
    w = max(4, -(-max(len(r) for r in rows) // 4) * 4)
    out = torch.full((t, w), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def make_bitmap(t, cu, density, gen):
    """A uint8 [T, NB] bitmap of the given density (future blocks and other sequences' blocks set too: the
    kernel must ignore them), rows 2 and 3 empty when T > 3."""
    nb = bitmap_layout(t, cu)[2]
    bm = (torch.rand((t, nb), generator=gen) < density).to(torch.uint8)
    if t > 3:
        bm[2:4] = 0
    return bm


@pytest.mark.parametrize("t,cu,density", [(37, None, 0.5), (130, None, 1.0), (200, [0, 0, 3, 70, 71, 200], 0.3),
                                          (1100, None, 0.05)])
def test_bitmap_forward_adversarial(t, cu, density):
    """Against the dense oracle (through the equivalent index rows) and the reference; bitwise the indexed form's
    result on those rows."""
    gen = torch.Generator().manual_seed(t + int(density * 10))
    q, k, v, _ = make_inputs(t, 24, 2, 256, 256, 4, gen, adversarial=False)
    bm = make_bitmap(t, cu, density, gen)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    poison_allocator()
    out, out32, lse = dsagen.qsa_bitmap_forward(q, k, v, bm.to(DEV), cu_seqlens=cu_t)
    ids = bitmap_as_indices(bm, t, cu).to(DEV)
    ref_out, ref_lse = oracle(q, k, v, ids, 1 / 16)
    torch.testing.assert_close(out32.double(), ref_out, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=2e-2, rtol=1e-3)
    r = dsagen.qsa_bitmap_forward(q, k, v, bm.to(DEV), cu_seqlens=cu_t, impl="reference")
    torch.testing.assert_close(out32, r[1], atol=2e-2, rtol=2e-2)
    same = dsagen.qsa_indexed_forward(q, k, v, ids)
    assert torch.equal(out32, same[1]) and torch.equal(out, same[0]) and torch.equal(lse, same[2])


def test_bitmap_bool_fp16_and_repeats():
    gen = torch.Generator().manual_seed(23)
    q, k, v, _ = make_inputs(90, 12, 3, 128, 64, 4, gen, torch.float16, adversarial=False)
    bm = make_bitmap(90, None, 0.4, gen)
    a = dsagen.qsa_bitmap_forward(q, k, v, bm.bool().to(DEV))
    b = dsagen.qsa_bitmap_forward(q, k, v, bm.to(DEV))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    r = dsagen.qsa_bitmap_forward(q, k, v, bm.to(DEV), impl="reference")
    torch.testing.assert_close(a[1], r[1], atol=2e-2, rtol=2e-2)


def test_bitmap_custom_op_compile_and_graph():
    gen = torch.Generator().manual_seed(29)
    q, k, v, _ = make_inputs(64, 12, 1, 256, 256, 4, gen, adversarial=False)
    bm = make_bitmap(64, [0, 30, 64], 0.5, gen).to(DEV)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEV)
    want = dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu)
    got = torch.ops.dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    compiled = torch.compile(lambda *a: dsagen.qsa_bitmap_forward(*a[:4], cu_seqlens=a[4]), fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(want, compiled(q, k, v, bm, cu)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu)
    bm.copy_(make_bitmap(64, [0, 30, 64], 0.2, gen).to(DEV))
    graph.replay()
    fresh = dsagen.qsa_bitmap_forward(q, k, v, bm, cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(fresh, captured))
