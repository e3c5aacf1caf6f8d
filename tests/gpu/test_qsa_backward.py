"""GPU tests of the fused QSA backward (autograd through `dsagen.qsa_indexed_forward` / `dsagen.qsa_bitmap_forward`
with impl="fused": the forward kernel, then the dq and dk / dv kernels of QsaDqSpec / QsaDkvSpec) against autograd of
a dense FP64 oracle and of the plain-PyTorch reference on fresh random inputs: 12 / 1 and 24 / 2 heads at D 256 (and
G 4 at D 128 / Dv 64 in fp16), -1 padding, out-of-range and repeated ids, empty rows, partial last tiles, short
sequences; the bitmap form on packed sequences (and its gradients against the indexed form's on the same blocks);
every output (out, out_fp32, lse) in the loss; dq bitwise repeatable (dk / dv are summed by atomics: close, not
bitwise); torch.compile with gradients.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under `compute-sanitizer`.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.kernels.qsa.spec import backward_specs_for, spec_for
from poison import poison_allocator
from qsa_grad_oracle import grads, loss_weights, oracle_grads, slot_counts
from test_qsa import bitmap_as_indices, make_bitmap, make_inputs

ARCH = "sm_90a"
DEV = "cuda"

# (G, D, Dv, dtype) of every kernel the tests run, both forms
_SHAPES = [(12, 256, 256, "bfloat16"), (4, 128, 64, "float16")]
REQUIRED_SPECS = [s for g, d, dv, dt in _SHAPES for b in (False, True)
                  for s in (spec_for(g, d, dv, dt, ARCH, bitmap=b), *backward_specs_for(g, d, dv, dt, ARCH, bitmap=b))]

pytestmark = pytest.mark.gpu


def assert_grads_close(got, want, rel=2e-2):
    """Each gradient within rel of its largest magnitude (bf16 / fp16 inputs, P and dS rounded to 16 bits)."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        scale = max(b.abs().max().item(), 1e-6)
        err = (a.double() - b).abs().max().item()
        assert err <= rel * scale, f"{name}: max error {err:.3g} against {scale:.3g}"


def check_indexed(q, k, v, ids, scale, gen):
    t, hq, d = q.shape
    sc = 1 / math.sqrt(d) if scale is None else scale
    weights = loss_weights(t, hq, v.shape[2], gen, DEV)
    got = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids, scale), q, k, v, weights)
    for g, x in zip(got, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_grads_close(got, oracle_grads(q, k, v, slot_counts(ids, t), sc, weights))
    ref = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids, scale, impl="reference"), q, k, v, weights)
    assert_grads_close(got, [r.double() for r in ref], rel=3e-2)
    return got


@pytest.mark.parametrize("t,hq,hkv,w", [(37, 12, 1, 64), (64, 24, 2, 68), (129, 12, 1, 260), (9, 12, 1, 4)])
def test_indexed_backward_adversarial(t, hq, hkv, w):
    """-1 padding, ids past T and below -1, a repeated id, a row without a valid id, partial last tiles, short T."""
    gen = torch.Generator().manual_seed(500 + t * 7 + w)
    q, k, v, ids = make_inputs(t, hq, hkv, 256, 256, w, gen)
    poison_allocator()                      # fresh allocations hold NaN bytes: a read of unwritten memory shows
    check_indexed(q, k, v, ids, None, gen)


def test_random_ids_scale_and_small_group():
    """Ids drawn per slot (repeats, any order), a given scale; G 4 over 3 KV heads at D 128 / Dv 64 in fp16."""
    gen = torch.Generator().manual_seed(511)
    q, k, v, ids = make_inputs(100, 12, 1, 256, 256, 200, gen, blocks=False)
    check_indexed(q, k, v, ids, 0.11, gen)
    q, k, v, ids = make_inputs(50, 12, 3, 128, 64, 96, gen, torch.float16)
    check_indexed(q, k, v, ids, None, gen)


@pytest.mark.parametrize("t,cu,density", [(37, None, 0.5), (200, [0, 0, 3, 70, 71, 200], 0.3), (300, None, 0.1)])
def test_bitmap_backward_adversarial(t, cu, density):
    """The bitmap form (blocks set past the query and in other sequences, empty rows, packed sequences: empty,
    shorter than a block, lengths not a multiple of 4) against the oracle on its equivalent index rows; dq bitwise
    the indexed form's on those rows (the same tiles), dk / dv within rounding of it."""
    gen = torch.Generator().manual_seed(520 + t)
    q, k, v, _ = make_inputs(t, 24, 2, 256, 256, 4, gen, adversarial=False)
    bm = make_bitmap(t, cu, density, gen).to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    ids = bitmap_as_indices(bm.cpu(), t, cu).to(DEV)
    weights = loss_weights(t, 24, 256, gen, DEV)
    poison_allocator()
    got = grads(lambda a, b, c: dsagen.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu_t), q, k, v, weights)
    assert_grads_close(got, oracle_grads(q, k, v, slot_counts(ids, t), 1 / 16, weights))
    same = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids), q, k, v, weights)
    assert torch.equal(got[0], same[0])
    assert_grads_close(got[1:], [x.double() for x in same[1:]], rel=1e-2)
    ref = grads(lambda a, b, c: dsagen.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu_t, impl="reference"), q, k, v,
                weights)
    assert_grads_close(got, [r.double() for r in ref], rel=3e-2)


def test_bitmap_backward_fp16_bool():
    gen = torch.Generator().manual_seed(531)
    q, k, v, _ = make_inputs(90, 12, 3, 128, 64, 4, gen, torch.float16, adversarial=False)
    bm = make_bitmap(90, [0, 41, 90], 0.4, gen)
    cu = torch.tensor([0, 41, 90], dtype=torch.int32, device=DEV)
    ids = bitmap_as_indices(bm, 90, [0, 41, 90]).to(DEV)
    weights = loss_weights(90, 12, 64, gen, DEV)
    got = grads(lambda a, b, c: dsagen.qsa_bitmap_forward(a, b, c, bm.bool().to(DEV), cu_seqlens=cu), q, k, v,
                weights)
    assert_grads_close(got, oracle_grads(q, k, v, slot_counts(ids, 90), 1 / math.sqrt(128), weights))


def test_repeated_backward_dq_bitwise_equal():
    """dq sums each row's slots in order: bitwise the same every call; dk / dv (FP32 atomics) agree closely."""
    gen = torch.Generator().manual_seed(541)
    q, k, v, ids = make_inputs(300, 24, 2, 256, 256, 512, gen, adversarial=False)
    weights = loss_weights(300, 24, 256, gen, DEV)
    fn = lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids)   # noqa: E731
    first = grads(fn, q, k, v, weights)
    for _ in range(3):
        again = grads(fn, q, k, v, weights)
        assert torch.equal(first[0], again[0])
        assert_grads_close(again[1:], [x.double() for x in first[1:]], rel=1e-2)


def test_torch_compile_backward():
    """torch.compile(fullgraph=True) of both forms with gradients: the forward and backward custom ops run as opaque
    nodes (dO and delta formed inside the backward op); dq is the eager dq bitwise, dk / dv within rounding."""
    gen = torch.Generator().manual_seed(551)
    q, k, v, ids = make_inputs(64, 12, 1, 256, 256, 64, gen)
    bm = make_bitmap(64, [0, 30, 64], 0.5, gen).to(DEV)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEV)
    weights = loss_weights(64, 12, 256, gen, DEV)

    def both(a, b, c):
        x = dsagen.qsa_indexed_forward(a, b, c, ids)
        y = dsagen.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu)
        return x[0] + y[0], x[1] + y[1], torch.maximum(x[2], y[2])

    eager = grads(both, q, k, v, weights)
    compiled = grads(torch.compile(both, fullgraph=True), q, k, v, weights)
    assert torch.equal(eager[0], compiled[0])
    assert_grads_close(compiled[1:], [x.double() for x in eager[1:]], rel=1e-2)


def test_backward_custom_op_direct():
    """torch.ops.dsagen.qsa_indexed_bwd_fused called with the forward's statistics and one output's gradient gives
    autograd's gradients (dq bitwise)."""
    gen = torch.Generator().manual_seed(561)
    q, k, v, ids = make_inputs(40, 12, 1, 256, 256, 64, gen)
    out, out32, lse = dsagen.qsa_indexed_forward(q, k, v, ids)
    d_out32 = torch.randn(out.shape, generator=gen).to(DEV)
    dq, dk, dv = torch.ops.dsagen.qsa_indexed_bwd_fused(q, k, v, ids, out32, lse, None, d_out32, None, 1 / 16)
    want = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids), q, k, v,
                 (torch.zeros_like(d_out32), d_out32, torch.zeros_like(lse)))
    assert torch.equal(dq, want[0])
    assert_grads_close((dk, dv), [x.double() for x in want[1:]], rel=1e-2)
