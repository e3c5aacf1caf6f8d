"""The public sparse MLA backward op on the CPU (cuDNN frontend DSA §2 Sparse Attention Backward):
`dsagen.sparse_attention_backward(impl="reference")` against autograd through an independent differentiable
formulation, the batched layout against the flat one, d_sink's dtype, every validation error, the fused path's
refusals on the CPU, the wiring of autograd to the fused backward (deterministic mode from
torch.are_deterministic_algorithms_enabled()), the custom op's fake, the workspace size the docs state, and
`fused_impl` resolving the sparse MLA host modules while Dynamo traces with no eager call before."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import dsagen
from dsagen.kernels.sparse_mla_bwd import host as bwd_host
from test_reference_attention import plain_attention, random_case

sa_mod = sys.modules[dsagen.sparse_attention.__module__]


def bwd(*args, **kw):
    kw.setdefault("impl", "reference")
    return dsagen.sparse_attention_backward(*args, **kw)


def forward_and_dout(q, kv, idx, sk, ln, seed=1, **kw):
    out, lse, _ = dsagen.sparse_attention(q, kv, idx, attn_sink=sk, topk_length=ln, impl="reference", **kw)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return out, lse, dout


# ----------------------------------------------------------------------------------------------------
# values (reference)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("length", [False, True])
def test_reference_backward_matches_autograd_of_a_plain_formulation(sink, length):
    """-1, negative, out-of-range and duplicate ids, an all-invalid row, lengths shorter than the width."""
    q, kv, idx, sk, ln = random_case(seed=40 + 2 * sink + length, sink=sink, length=length)
    sk = None if sk is None else sk.double()
    out, lse, dout = forward_and_dout(q, kv, idx, sk, ln)
    dq, dkv, d_sink = bwd(q, kv, out, dout, lse, idx, attn_sink=sk, topk_length=ln)
    inputs = [q.clone().requires_grad_(), kv.clone().requires_grad_()] + ([sk.clone().requires_grad_()] if sink else [])
    p_out = plain_attention(inputs[0], inputs[1], idx, inputs[2] if sink else None, ln)
    want = torch.autograd.grad(p_out, inputs, dout)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dkv, want[1])
    if sink:
        assert d_sink.shape == (3,) and d_sink.dtype == torch.float64
        torch.testing.assert_close(d_sink, want[2])
    else:
        assert d_sink is None
    assert torch.all(dq[2] == 0)                       # the all-invalid row: no gradient


def test_reference_backward_equals_the_autograd_gradients_of_sparse_attention():
    q, kv, idx, sk, ln = random_case(seed=50)
    sk = sk.double()
    leaves = [x.clone().requires_grad_() for x in (q, kv, sk)]
    out, lse, _ = dsagen.sparse_attention(*leaves[:2], idx, attn_sink=leaves[2], topk_length=ln, impl="reference")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, dout)
    got = bwd(q, kv, out.detach(), dout, lse, idx, attn_sink=sk, topk_length=ln)
    for g, w in zip(got, grads):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_duplicate_ids_are_distinct_slots_whose_dkv_terms_add():
    q, kv, idx, sk, _ = random_case(seed=51, length=False)
    idx = idx[:, :3].repeat(1, 2).contiguous()         # every slot twice
    out, lse, dout = forward_and_dout(q, kv, idx, sk, None)
    dq, dkv, _ = bwd(q, kv, out, dout, lse, idx, attn_sink=sk)
    leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()]
    want = torch.autograd.grad(plain_attention(*leaves, idx, sk), leaves, dout)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dkv, want[1])


def test_batched_layout_equals_the_flat_op_on_offset_ids():
    """Local ids b * N + i; ids outside [0, N) (even ones valid in a neighbouring batch) contribute nothing."""
    g = torch.Generator().manual_seed(52)
    b, t, h, n, d, k = 2, 3, 2, 5, 6, 4
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, n, (b, t, k), generator=g, dtype=torch.int32)
    idx[0, 0, :2] = torch.tensor([n, n + 2])            # would alias batch 1 if offset blindly
    idx[1, 2, 0] = -5
    sk = torch.randn(h, generator=g, dtype=torch.float64)
    ln = torch.tensor([[4, 2, 0], [3, 4, 1]], dtype=torch.int32)
    out, lse, dout = forward_and_dout(q, kv, idx, sk, ln, d_v=4)
    dq, dkv, d_sink = bwd(q, kv, out, dout, lse, idx, attn_sink=sk, topk_length=ln, d_v=4)
    assert dq.shape == q.shape and dkv.shape == kv.shape and d_sink.shape == (h,)
    flat_ids = torch.where((idx >= 0) & (idx < n), idx + torch.arange(b).view(b, 1, 1) * n, -1).int()
    f = bwd(q.reshape(b * t, h, d), kv.reshape(b * n, d), out.reshape(b * t, h, -1), dout.reshape(b * t, h, -1),
            lse.reshape(b * t, h), flat_ids.reshape(b * t, k), attn_sink=sk, topk_length=ln.reshape(-1), d_v=4)
    torch.testing.assert_close(dq, f[0].reshape(q.shape), atol=0, rtol=0)
    torch.testing.assert_close(dkv, f[1].reshape(kv.shape), atol=0, rtol=0)
    torch.testing.assert_close(d_sink, f[2], atol=0, rtol=0)
    # and against autograd of the batched forward
    leaves = [x.clone().requires_grad_() for x in (q, kv, sk)]
    o, _, _ = dsagen.sparse_attention(*leaves[:2], idx, attn_sink=leaves[2], topk_length=ln, d_v=4,
                                      impl="reference")
    for got, want in zip((dq, dkv, d_sink), torch.autograd.grad(o, leaves, dout)):
        torch.testing.assert_close(got, want)


def test_empty_inputs_and_zero_width():
    q, kv, idx, sk, _ = random_case(seed=53, length=False)
    out, lse, dout = forward_and_dout(q, kv, idx[:, :0].contiguous(), sk, None)
    dq, dkv, d_sink = bwd(q, kv, out, dout, lse, idx[:, :0].contiguous(), attn_sink=sk)
    assert not dq.any() and not dkv.any() and not d_sink.any()      # out = 0, so delta = 0
    e = q[:0]
    dq, dkv, d_sink = bwd(e, kv, out[:0], dout[:0], lse[:0], idx[:0], attn_sink=sk)
    assert dq.shape == e.shape and not dkv.any() and not d_sink.any()


def test_d_sink_is_fp32_for_low_precision_inputs_whatever_the_sink_dtype():
    q, kv, idx, sk, ln = random_case(dtype=torch.bfloat16, seed=54)
    for sink in (sk.float(), sk.double()):
        out, lse, dout = forward_and_dout(q, kv, idx, sink, ln)
        assert lse.dtype == torch.float32
        dq, dkv, d_sink = bwd(q, kv, out, dout, lse, idx, attn_sink=sink, topk_length=ln)
        assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16 and d_sink.dtype == torch.float32
        want = dsagen.reference.sparse_attention.sparse_attention_backward(
            q, kv, out, dout, lse, sink, idx, topk_length=ln)[2]
        torch.testing.assert_close(d_sink, want.float(), atol=0, rtol=0)


def test_softmax_scale_and_d_v_defaults_are_the_forwards():
    q, kv, idx, sk, ln = random_case(seed=55, d=8)
    out, lse, dout = forward_and_dout(q, kv, idx, sk, ln)
    a = bwd(q, kv, out, dout, lse, idx, attn_sink=sk, topk_length=ln)
    b = bwd(q, kv, out, dout, lse, idx, attn_sink=sk, topk_length=ln, softmax_scale=1.0 / math.sqrt(8), d_v=8)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------
# validation


def _case():
    q, kv, idx, sk, ln = random_case(dtype=torch.float32, seed=56)
    out, lse, dout = forward_and_dout(q, kv, idx, sk, ln)
    return q, kv, out, dout, lse, idx, sk, ln


def _bad_calls():
    q, kv, out, dout, lse, idx, sk, ln = _case()
    a = (q, kv, out, dout, lse, idx)

    def call(**over):
        args = dict(q=q, kv=kv, out=out, dout=dout, lse=lse, topk_idxs=idx)
        kw = {k: over.pop(k) for k in list(over) if k not in args}
        args.update(over)
        return lambda: bwd(*args.values(), **kw)

    return {
        "impl": (call(impl="cuda"), ValueError, "impl"),
        "q-ndim": (call(q=q[0]), ValueError, "q must have 3 or 4 dimensions"),
        "q-dtype": (call(q=q.int()), TypeError, "q must have dtype"),
        "q-type": (call(q=q.tolist()), TypeError, "q must be a torch.Tensor"),
        "kv-dtype": (call(kv=kv.double()), TypeError, "kv must have the same dtype as q"),
        "kv-shape": (call(kv=kv[:, :3]), ValueError, "kv must have shape"),
        "topk_idxs-dtype": (call(topk_idxs=idx.long()), TypeError, "topk_idxs must have dtype"),
        "topk_idxs-shape": (call(topk_idxs=idx[:3]), ValueError, "topk_idxs must have shape"),
        "out-type": (call(out=None), TypeError, "out must be a torch.Tensor"),
        "out-dtype": (call(out=out.double()), TypeError, "out must have the same dtype as q"),
        "out-shape": (call(out=out[:, :, :3]), ValueError, r"out must have shape \(total_S_q, H, d_v\)"),
        "dout-dtype": (call(dout=dout.half()), TypeError, "dout must have the same dtype as q"),
        "dout-shape": (call(dout=dout[:2]), ValueError, "dout must have shape"),
        "lse-dtype": (call(lse=lse.half()), TypeError, "lse must have dtype"),
        "lse-shape": (call(lse=lse[:, :1]), ValueError, r"lse must have shape \(total_S_q, H\)"),
        "attn_sink-shape": (call(attn_sink=sk[:2]), ValueError, "attn_sink must have shape"),
        "attn_sink-dtype": (call(attn_sink=sk.half()), TypeError, "attn_sink must have dtype"),
        "topk_length-shape": (call(topk_length=ln[:2]), ValueError, "topk_length must have shape"),
        "topk_length-dtype": (call(topk_length=ln.long()), TypeError, "topk_length must have dtype"),
        "softmax_scale": (call(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
        "softmax_scale-type": (call(softmax_scale="1"), TypeError, "softmax_scale must be a float"),
        "d_v": (call(d_v=9), ValueError, "d_v must be <= 8"),
        "d_v-out": (call(d_v=4), ValueError, "out must have shape"),            # out is (.., 8): d_v default
        "d_v-type": (call(d_v=2.0), TypeError, "d_v must be an int"),
        "deterministic-type": (call(deterministic=1), TypeError, "deterministic must be a bool"),
        "workspace-reference": (call(workspace=torch.empty(10)), ValueError, "workspace is only accepted"),
        "workspace-type": (call(workspace=[0.0], impl="fused"), TypeError, "workspace must be a torch.Tensor"),
        "workspace-dtype": (call(workspace=torch.empty(10, dtype=torch.float64), impl="fused"), TypeError,
                            "workspace must have dtype torch.float32"),
        "fused-on-cpu": (call(impl="fused"), ValueError, "sparse_attention_backward: impl='fused' runs generated"),
        "fused-is-default": (lambda: dsagen.sparse_attention_backward(*a), ValueError, "impl='fused'"),
        "fused-workspace-on-cpu": (call(workspace=torch.empty(10), impl="fused"), ValueError,
                                   "sparse_attention_backward: impl='fused' runs generated"),
        "batched-kv": (lambda: bwd(q[None], kv[None].expand(2, -1, -1), out[None], dout[None], lse[None], idx[None]),
                       ValueError, "kv must have shape"),
        "batched-lse": (lambda: bwd(q[None], kv[None], out[None], dout[None], lse, idx[None]), ValueError,
                        r"lse must have shape \[B, T, H\]"),
        "batched-out": (lambda: bwd(q[None], kv[None], out, dout[None], lse[None], idx[None]), ValueError,
                        r"out must have shape \[B, T, H, d_v\]"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_validation_errors_name_the_argument(name):
    fn, exc, match = _bad_calls()[name]
    with pytest.raises(exc, match=match):
        fn()


def test_device_mismatch_is_a_value_error():
    q, kv, out, dout, lse, idx, sk, ln = _case()
    with pytest.raises(ValueError, match="lse must be on cpu"):
        bwd(q, kv, out, dout, lse.to("meta"), idx)


def test_workspace_helper_validates_and_refuses_the_cpu():
    q, kv, out, dout, lse, idx, sk, ln = _case()
    with pytest.raises(ValueError, match="runs on CUDA"):
        dsagen.sparse_attention_backward_workspace(q, kv, idx)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        dsagen.sparse_attention_backward_workspace(q, kv, idx, deterministic="yes")
    with pytest.raises(ValueError, match="topk_idxs must have shape"):
        dsagen.sparse_attention_backward_workspace(q, kv, idx[:2])


# ----------------------------------------------------------------------------------------------------
# the workspace size the docs state, the custom op's fake


@pytest.mark.parametrize("s_q,h,n_kv,k,d", [(7, 16, 100, 64, 576), (3, 128, 9, 200, 512), (1, 64, 5, 0, 576),
                                            (5000, 128, 10, 2048, 576), (9, 64, 10000, 300, 576)])
def test_workspace_numel_is_the_documented_formula(s_q, h, n_kv, k, d):
    hk = 64 if h <= 64 else 128
    a4 = lambda n: (n + 3) // 4 * 4  # noqa: E731
    base = n_kv * d + s_q * hk + 4 + a4(2 * s_q) + (a4(s_q * k) if n_kv > 4096 else 0)
    assert bwd_host.workspace_numel(s_q, h, n_kv, k, d, False) == base
    per_row = (hk // 64) * max(k, 1) * d
    rows = max(1, 2**30 // (4 * per_row))
    assert bwd_host.workspace_numel(s_q, h, n_kv, k, d, True) == base + min(s_q, rows) * per_row
    assert min(s_q, rows) * per_row * 4 <= max(2**30, per_row * 4)


def test_custom_op_fake_gives_the_output_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 16, 576, dtype=torch.bfloat16)
        kv = torch.empty(40, 576, dtype=torch.bfloat16)
        out = torch.empty(5, 16, 512, dtype=torch.bfloat16)
        lse = torch.empty(5, 16)
        ids = torch.empty(5, 70, dtype=torch.int32)
        for sink, want in ((torch.empty(16), (16,)), (torch.empty(16, dtype=torch.float64), (16,)), (None, (0,))):
            dq, dkv, d_sink = torch.ops.dsagen.sparse_attention_bwd(q, kv, out, out, lse, ids, sink, None, 0.1,
                                                                   512, False)
            assert dq.shape == q.shape and dq.dtype == q.dtype
            assert dkv.shape == kv.shape and dkv.dtype == kv.dtype
            assert d_sink.shape == want
            assert d_sink.dtype == (torch.float32 if sink is None else sink.dtype)


# ----------------------------------------------------------------------------------------------------
# autograd of impl="fused" calls the fused backward (its kernel replaced by the reference, on the CPU)


class _Recorder:
    """Stands in for fused_impl: the forward and backward run the reference and the backward records its call."""

    def __init__(self):
        self.calls = []

    def __call__(self, op, device):
        ref = dsagen.reference.sparse_attention
        if op == "sparse_attention":
            return ref.sparse_attention_forward
        assert op == "sparse_attention_backward", op

        def backward(q, kv, out, dout, lse, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v,
                     deterministic, workspace):
            self.calls.append(dict(deterministic=deterministic, workspace=workspace, softmax_scale=softmax_scale,
                                   d_v=d_v, shape=tuple(q.shape)))
            return ref.sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs,
                                                 topk_length=topk_length, softmax_scale=softmax_scale, d_v=d_v)
        return backward


@pytest.mark.parametrize("deterministic", [False, True])
def test_fused_autograd_uses_the_fused_backward_deterministic_by_torch_setting(monkeypatch, deterministic):
    rec = _Recorder()
    monkeypatch.setattr(sa_mod, "fused_impl", rec)
    q, kv, idx, sk, ln = random_case(seed=57)
    leaves = [x.clone().requires_grad_() for x in (q, kv, sk.double())]
    out, _, _ = dsagen.sparse_attention(*leaves[:2], idx, attn_sink=leaves[2], topk_length=ln, softmax_scale=0.3,
                                        impl="fused")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        grads = torch.autograd.grad(out.sum(), leaves)
    finally:
        torch.use_deterministic_algorithms(before)
    assert rec.calls == [dict(deterministic=deterministic, workspace=None, softmax_scale=0.3, d_v=8,
                              shape=tuple(q.shape))]
    leaves_r = [x.detach().clone().requires_grad_() for x in leaves]
    out_r, _, _ = dsagen.sparse_attention(*leaves_r[:2], idx, attn_sink=leaves_r[2], topk_length=ln,
                                          softmax_scale=0.3, impl="reference")
    for g, w in zip(grads, torch.autograd.grad(out_r.sum(), leaves_r)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_fused_autograd_of_the_batched_layout_goes_through_the_flat_backward(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(sa_mod, "fused_impl", rec)
    g = torch.Generator().manual_seed(58)
    q = torch.randn(2, 3, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 7, (2, 3, 4), generator=g, dtype=torch.int32)
    out, _, _ = dsagen.sparse_attention(q, kv, idx, impl="fused")
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    assert rec.calls[0]["shape"] == (6, 2, 6) and dq.shape == q.shape and dkv.shape == kv.shape
    q2, kv2 = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out2, _, _ = dsagen.sparse_attention(q2, kv2, idx, impl="reference")
    want = torch.autograd.grad(out2.sum(), (q2, kv2))
    torch.testing.assert_close(dq, want[0], atol=0, rtol=0)
    torch.testing.assert_close(dkv, want[1], atol=0, rtol=0)


def test_reference_autograd_never_calls_the_fused_backward(monkeypatch):
    def refuse(op, device):
        raise AssertionError(f"fused_impl({op!r}) called for impl='reference'")

    monkeypatch.setattr(sa_mod, "fused_impl", refuse)
    q, kv, idx, sk, ln = random_case(seed=59)
    q.requires_grad_()
    out, _, _ = dsagen.sparse_attention(q, kv, idx, attn_sink=sk, topk_length=ln, impl="reference")
    out.sum().backward()
    assert q.grad is not None


# ----------------------------------------------------------------------------------------------------
# torch.compile finds the fused host modules without an eager call


def test_fused_impl_resolves_the_compiled_ops_hosts_while_dynamo_traces():
    """A fresh process: nothing resolved yet, and importlib cannot be traced; the static imports can."""
    code = """
import torch
from dsagen.ops import _fused
dev = torch.device("cuda")          # fused_impl only reads device.type: no CUDA needed
ops = ("sparse_attention", "sparse_attention_backward", "sparse_attn_score_recompute",
       "sparse_indexer_score_recompute", "indexer_backward", "indexer_topk")
def f(x):
    for op in ops:
        _fused.fused_impl(op, dev)
    return x + 1
assert not _fused._resolved
y = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
assert y.tolist() == [2.0, 2.0]
import importlib
want = {}
for op in ops:
    mod, name = _fused.FUSED[op].split(":")
    want[op] = getattr(importlib.import_module(mod), name)
assert _fused._resolved == want, _fused._resolved
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_every_traceable_import_is_the_module_of_its_fused_entry():
    from dsagen.ops import _fused

    for mod, loader in _fused._TRACEABLE_IMPORTS.items():
        assert loader().__name__ == mod
    targets = {t.split(":")[0] for t in _fused.FUSED.values()}
    assert set(_fused._TRACEABLE_IMPORTS) <= targets
    assert {_fused.FUSED["sparse_attention"].split(":")[0],
            _fused.FUSED["sparse_attention_backward"].split(":")[0]} <= set(_fused._TRACEABLE_IMPORTS)
