"""GPU tests of the public sparse MLA backward (`dsagen.sparse_attention_backward`, cuDNN frontend DSA §2 Sparse
Attention Backward) and of the autograd of `dsagen.sparse_attention(impl="fused")`, which differentiates through it:

* the public op on the fused forward's out / lse against the reference backward in FP64, flat and batched layouts,
  H 64/128 natively and 16/32 padded, D_qk 512/576, sink on/off, topk_length shorter than the width, -1, negative
  and out-of-range ids, duplicates, all-invalid rows (zero gradients, unreferenced kv rows exactly zero),
  total_S_q = 1; deterministic=True bitwise run to run, with and without a caller-owned workspace;
* unsupported inputs raise NotImplementedError (no fallback);
* autograd: bitwise the public op's gradients (deterministic via torch.use_deterministic_algorithms), close to
  impl="reference"'s, under torch.compile(fullgraph=True) and in a captured and replayed CUDA graph of a forward +
  backward step; a training step of a small DSA attention layer against the same layer with impl="reference".

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import dsagen
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.kernels.sparse_mla.spec import config_for as fwd_config_for
from dsagen.kernels.sparse_mla_bwd import host as bwd_host
from dsagen.kernels.sparse_mla_bwd.spec import config_for as bwd_config_for
from dsagen.reference import sparse_attention as ref
from poison import poison_allocator
from test_sparse_attention import make_ids

ARCH = "sm_90a"
_SHAPES = [(h, d) for h in (64, 128) for d in (512, 576)]           # 16 and 32 heads run the 64-head kernels
REQUIRED_SPECS = ([fwd_config_for(h, d, "bfloat16", None, ARCH, None).spec(h, d, "bfloat16", ARCH) for h, d in _SHAPES]
                  + [bwd_config_for(h, d, "bfloat16", ARCH, None).spec(h, d, "bfloat16", ARCH, deterministic=det)
                     for h, d in _SHAPES for det in (False, True)]
                  + [RowScatterAddSpec(arch=ARCH, width=d) for d in sorted({d for _, d in _SHAPES})])

pytestmark = pytest.mark.gpu
DEV = "cuda"


# ----------------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """torch.use_deterministic_algorithms(on, warn_only=True) for the block (the autograd mode switch)."""
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def assert_close(name, got, want, tol=1e-2):
    """max |got - want| <= tol * max |want| (bf16 outputs of sums over hundreds of bf16 products)."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"{name}: max abs error {err:.3e} vs max |ref| {scale:.3e}"


def make_case(lead, h, d_qk, n_kv, k, *, seed, sink=True, length=False, adversarial=False):
    """bf16 inputs of either layout (lead (S_q,) or (B, T); kv rows per batch n_kv), the fused forward's out / lse
    and a random dout: the dict of sparse_attention_backward's arguments."""
    gen = torch.Generator().manual_seed(seed)
    rows = 1
    for x in lead:
        rows *= x
    q = (torch.randn((*lead, h, d_qk), generator=gen) * 0.5).bfloat16().to(DEV)
    kv = (torch.randn((*lead[:-1], n_kv, d_qk), generator=gen) * 0.5).bfloat16().to(DEV)
    ids = make_ids(rows, k, n_kv, gen, adversarial=adversarial).reshape(*lead, k).to(DEV)
    attn_sink = torch.randn(h, generator=gen).to(DEV) if sink else None
    topk_length = None
    if length:
        topk_length = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int32)
        topk_length[0] = k // 2                                         # shorter than the width
        topk_length = topk_length.reshape(lead).to(DEV)
    c = refresh(dict(q=q, kv=kv, topk_idxs=ids, attn_sink=attn_sink, topk_length=topk_length))
    c["dout"] = torch.randn(c["out"].shape, generator=gen).bfloat16().to(DEV)
    return c


def refresh(c):
    """The case's out and lse from the fused forward of its current inputs (after a test edits ids or lengths)."""
    c["out"], c["lse"], _ = dsagen.sparse_attention(c["q"], c["kv"], c["topk_idxs"], attn_sink=c["attn_sink"],
                                                    topk_length=c["topk_length"], impl="fused")
    return c


def fused(c, **kw):
    return dsagen.sparse_attention_backward(c["q"], c["kv"], c["out"], c["dout"], c["lse"], c["topk_idxs"],
                                            attn_sink=c["attn_sink"], topk_length=c["topk_length"], impl="fused",
                                            **kw)


def reference(c):
    """The public op's reference in FP64 on the case's inputs (the same out / lse / dout)."""
    d = lambda t: None if t is None else t.double()
    return dsagen.sparse_attention_backward(d(c["q"]), d(c["kv"]), d(c["out"]), d(c["dout"]), d(c["lse"]),
                                            c["topk_idxs"], attn_sink=d(c["attn_sink"]),
                                            topk_length=c["topk_length"], impl="reference")


def check(c, **kw):
    poison_allocator()
    dq, dkv, d_sink = fused(c, **kw)
    rq, rkv, rsink = reference(c)
    assert dq.dtype == c["q"].dtype and dkv.dtype == c["kv"].dtype
    assert_close("dq", dq, rq)
    assert_close("dkv", dkv, rkv)
    if rsink is None:
        assert d_sink is None
    else:
        assert d_sink.dtype == torch.float32 and d_sink.shape == c["attn_sink"].shape
        assert_close("d_sink", d_sink, rsink)
    return dq, dkv, d_sink


def unreferenced_rows(c) -> torch.Tensor:
    """A bool mask over the flat kv rows that no valid slot names."""
    ids, kv = c["topk_idxs"], c["kv"]
    n = kv.shape[-2]
    flat = ids.reshape(-1, ids.shape[-1]).long()
    valid = (flat >= 0) & (flat < n)
    if c["topk_length"] is not None:
        valid &= torch.arange(flat.shape[1], device=DEV) < c["topk_length"].reshape(-1, 1).clamp(0, flat.shape[1])
    if ids.dim() == 3:                                                  # batched: b * N + i
        flat = flat + (torch.arange(ids.shape[0], device=DEV) * n).repeat_interleave(ids.shape[1]).view(-1, 1)
    hit = torch.zeros(kv.numel() // kv.shape[-1], dtype=torch.bool, device=DEV)
    hit[flat[valid]] = True
    return ~hit


# ----------------------------------------------------------------------------------------------------
# the public op against the reference


@pytest.mark.parametrize("h,d_qk,sink,length", [(64, 576, True, False), (128, 512, False, True),
                                                (128, 576, True, True), (64, 512, True, True),
                                                (16, 576, True, True), (32, 512, False, False)])
def test_public_op_matches_reference(h, d_qk, sink, length):
    check(make_case((13,), h, d_qk, 600, 200, seed=h + d_qk + 2 * sink + length, sink=sink, length=length))


@pytest.mark.parametrize("h", [64, 128])
def test_adversarial_ids_and_empty_rows(h):
    """-1, negative and out-of-range ids (up to 2**31 - 1), duplicates, an all-invalid row (row 1), a row of length
    0: zero gradients where nothing is valid, and kv rows no valid slot names get exactly zero."""
    c = make_case((9,), h, 576, 300, 130, seed=h, adversarial=True, length=True)
    c["topk_length"][4] = 0
    dq, dkv, d_sink = check(refresh(c))
    assert not dq[1].any() and not dq[4].any()
    dead = unreferenced_rows(c)
    assert dead.any() and not dkv[dead].any()


def test_duplicate_ids_are_distinct_slots():
    c = make_case((6,), 64, 576, 80, 128, seed=3)
    c["topk_idxs"][:, 64:] = c["topk_idxs"][:, :64]                      # every id twice per row
    check(refresh(c))


@pytest.mark.parametrize("deterministic", [False, True])
def test_single_query_row(deterministic):
    check(make_case((1,), 128, 576, 3000, 512, seed=5), deterministic=deterministic)


@pytest.mark.parametrize("h,d_qk", [(64, 576), (128, 512)])
def test_batched_layout(h, d_qk):
    """Local ids (-1, >= N: never aliasing the next batch), topk_length [B, T]: against the reference, and
    deterministic bitwise equal to the flat op on the flattened inputs and b * N + i ids."""
    b, t, n, k = 2, 5, 300, 96
    c = make_case((b, t), h, d_qk, n, k, seed=21 + h, length=True, adversarial=True)
    c["topk_idxs"][0, 0, :8] = n + torch.arange(8, device=DEV, dtype=torch.int32)   # valid rows of batch 1 if offset
    c["topk_length"][0, 0] = k
    dq, dkv, d_sink = check(refresh(c), deterministic=True)
    assert dq.shape == c["q"].shape and dkv.shape == c["kv"].shape
    assert not dkv.reshape(b * n, d_qk)[unreferenced_rows(c)].any()
    ids = c["topk_idxs"].long()
    flat_ids = torch.where((ids >= 0) & (ids < n), ids + torch.arange(b, device=DEV).view(b, 1, 1) * n, -1)
    f = dict(q=c["q"].reshape(b * t, h, d_qk), kv=c["kv"].reshape(b * n, d_qk), out=c["out"].reshape(b * t, h, -1),
             dout=c["dout"].reshape(b * t, h, -1), lse=c["lse"].reshape(b * t, h),
             topk_idxs=flat_ids.int().reshape(b * t, k), attn_sink=c["attn_sink"],
             topk_length=c["topk_length"].reshape(b * t))
    fq, fkv, fsink = fused(f, deterministic=True)
    assert torch.equal(dq, fq.reshape(dq.shape)) and torch.equal(dkv, fkv.reshape(dkv.shape))
    assert torch.equal(d_sink, fsink)


@pytest.mark.parametrize("h", [64, 128])
def test_deterministic_bitwise_with_and_without_workspace(h):
    """Few kv rows, so every id recurs in many slots: two runs bitwise equal, and a NaN-filled caller workspace
    (from the public helper) gives the same bits."""
    c = make_case((17,), h, 576, 48, 256, seed=11 + h, adversarial=True, length=True)
    a = check(c, deterministic=True)
    b = fused(c, deterministic=True)
    ws = dsagen.sparse_attention_backward_workspace(c["q"], c["kv"], c["topk_idxs"], deterministic=True)
    assert ws.dtype == torch.float32 and ws.device.type == "cuda" and ws.dim() == 1
    ws.fill_(float("nan"))
    w = fused(c, deterministic=True, workspace=ws)
    for x, y, z in zip(a, b, w):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_workspace_size_and_errors():
    c = make_case((7,), 32, 512, 200, 100, seed=13)
    for det in (False, True):
        ws = dsagen.sparse_attention_backward_workspace(c["q"], c["kv"], c["topk_idxs"], deterministic=det)
        assert ws.numel() == bwd_host.workspace_numel(7, 32, 200, 100, 512, det)
        check(c, deterministic=det, workspace=ws.fill_(float("nan")))
    with pytest.raises(ValueError, match="workspace must hold at least"):
        fused(c, workspace=ws[:100])
    with pytest.raises(ValueError, match="workspace must be contiguous"):
        fused(c, workspace=torch.empty((ws.numel(), 2), device=DEV)[:, 0])
    with pytest.raises(ValueError, match="workspace must be on"):
        fused(c, workspace=ws.cpu())


def test_unsupported_inputs_raise_not_implemented():
    c = make_case((3,), 64, 576, 100, 64, seed=17)
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v) for k, v in c.items()}
    with pytest.raises(NotImplementedError, match="dtype"):
        fused(f32)
    with pytest.raises(NotImplementedError, match="d_v"):
        c2 = dict(c, out=c["out"][..., :256], dout=c["dout"][..., :256])
        fused(c2, d_v=256)


# ----------------------------------------------------------------------------------------------------
# autograd of sparse_attention(impl="fused")


def _leaves(c):
    return [c["q"].detach().clone().requires_grad_(), c["kv"].detach().clone().requires_grad_(),
            c["attn_sink"].detach().clone().requires_grad_()]


def _loss(out, w):
    return (out.float() * w).sum()


def _autograd(c, impl, w, compile=False):
    """Gradients of q, kv and the sink of the loss (out * w).sum() (forward compiled when `compile`; the backward
    then runs the graph AOTAutograd compiled for it)."""
    leaves = _leaves(c)

    def loss(q, kv, sink):
        out, _, _ = dsagen.sparse_attention(q, kv, c["topk_idxs"], attn_sink=sink, topk_length=c["topk_length"],
                                            impl=impl)
        return _loss(out, w)

    (torch.compile(loss, fullgraph=True) if compile else loss)(*leaves).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("lead", [(11,), (2, 6)], ids=["flat", "batched"])
def test_autograd_is_the_public_backward_and_matches_reference(lead):
    """Deterministic autograd gradients are bitwise the public op's on the forward's out / lse with dout = w; they
    are close to the FP64 reference backward and to autograd through impl="reference"."""
    c = make_case(lead, 64, 576, 400, 160, seed=31 + len(lead), length=True, adversarial=True)
    w = torch.randn(c["out"].shape, device=DEV)
    with deterministic_algorithms(True):
        g = _autograd(c, "fused", w)
    c["dout"] = w.to(torch.bfloat16)                                   # the gradient of out.float() * w
    want = fused(c, deterministic=True)
    for name, x, y in zip(("dq", "dkv", "d_sink"), g, want):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    r = reference(c)
    for name, x, y in zip(("dq", "dkv", "d_sink"), g, r):
        assert_close(name, x, y)
    g_ref = _autograd(c, "reference", w)
    for name, x, y in zip(("dq", "dkv", "d_sink"), g, g_ref):
        assert_close(name + " vs impl=reference", x, y)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_compile_forward_backward(deterministic):
    """torch.compile(fullgraph=True) of a forward + backward step: the custom ops dsagen::sparse_attention_fwd and
    dsagen::sparse_attention_bwd in the graphs; gradients as eager (bitwise when deterministic; FP32 atomics reorder
    the dkv sums otherwise)."""
    c = make_case((9,), 64, 512, 500, 192, seed=41, length=True)
    w = torch.randn(c["out"].shape, device=DEV)
    with deterministic_algorithms(deterministic):
        eager = _autograd(c, "fused", w)
        torch._dynamo.reset()
        got = _autograd(c, "fused", w, compile=True)
    for name, x, y in zip(("dq", "dkv", "d_sink"), got, eager):
        if deterministic:
            assert torch.equal(x, y), name
        else:
            assert_close(name, x, y, tol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_forward_backward(deterministic):
    """A forward + backward step captured in a CUDA graph (grads set to None before capture, so backward allocates
    them from the graph's pool), replayed on new inputs: the gradients of an eager step on those inputs."""
    c = make_case((8,), 128, 576, 700, 256, seed=43, length=True, adversarial=True)
    w = torch.randn(c["out"].shape, device=DEV)
    leaves = _leaves(c)

    def step():
        out, _, _ = dsagen.sparse_attention(leaves[0], leaves[1], c["topk_idxs"], attn_sink=leaves[2],
                                            topk_length=c["topk_length"], impl="fused")
        _loss(out, w).backward()

    with deterministic_algorithms(deterministic):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                                    # warm up: kernels loaded, pools primed
            for _ in range(2):
                for x in leaves:
                    x.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        first = [x.grad.clone() for x in leaves]
        for x in leaves:
            x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        gen = torch.Generator().manual_seed(44)
        with torch.no_grad():
            leaves[0].copy_(torch.randn(leaves[0].shape, generator=gen).to(DEV) * 0.5)
            leaves[2].copy_(torch.randn(leaves[2].shape, generator=gen).to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [x.grad.clone() for x in leaves]
        c2 = dict(c, q=leaves[0].detach(), attn_sink=leaves[2].detach())
        eager = _autograd(c2, "fused", w)
    assert not torch.equal(replayed[0], first[0])
    for name, x, y in zip(("dq", "dkv", "d_sink"), replayed, eager):
        if deterministic:
            assert torch.equal(x, y), name
        else:
            assert_close(name, x, y, tol=1e-3)


def test_cuda_graph_of_the_public_ops_with_a_workspace():
    """The explicit forward + backward (no autograd) captured with a caller-owned workspace, replayed on new q:
    the eager result on those inputs (deterministic, bitwise)."""
    c = make_case((6,), 64, 576, 400, 128, seed=47, length=True)
    q, kv, ids, sink, tl, dout = c["q"], c["kv"], c["topk_idxs"], c["attn_sink"], c["topk_length"], c["dout"]
    ws = dsagen.sparse_attention_backward_workspace(q, kv, ids, deterministic=True)

    def step():
        out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
        return dsagen.sparse_attention_backward(q, kv, out, dout, lse, ids, attn_sink=sink, topk_length=tl,
                                                deterministic=True, workspace=ws, impl="fused")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = step()
    q.copy_((torch.randn(q.shape, generator=torch.Generator().manual_seed(48)) * 0.5).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for name, x, y in zip(("dq", "dkv", "d_sink"), g_out, want):
        assert torch.equal(x, y), name


# ----------------------------------------------------------------------------------------------------
# a training step


class DsaLayer(torch.nn.Module):
    """A small DeepSeek sparse-attention layer: q and latent kv projections, sparse MQA over the indexer's top-k
    ids with a learned per-head sink, output projection."""

    def __init__(self, dim: int, heads: int, d_qk: int, d_v: int, impl: str):
        super().__init__()
        self.heads, self.d_qk, self.d_v, self.impl = heads, d_qk, d_v, impl
        self.wq = torch.nn.Linear(dim, heads * d_qk, bias=False)
        self.wkv = torch.nn.Linear(dim, d_qk, bias=False)
        self.wo = torch.nn.Linear(heads * d_v, dim, bias=False)
        self.sink = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x: torch.Tensor, topk_idxs: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.heads, self.d_qk)
        kv = self.wkv(x)
        out, _, _ = dsagen.sparse_attention(q, kv, topk_idxs, attn_sink=self.sink.float(), impl=self.impl)
        return self.wo(out.reshape(t, self.heads * self.d_v))


def causal_topk(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random causal indexer: token i picks k ids in [0, i] (repeats possible), -1 in slots past i."""
    pos = torch.arange(t).view(t, 1)
    ids = (torch.rand((t, k), generator=gen) * (pos + 1)).long()
    ids = torch.where(torch.arange(k).view(1, k) <= pos, ids, -1)
    return ids.to(torch.int32)


def test_training_step_matches_reference_layer():
    gen = torch.Generator().manual_seed(51)
    t, dim, heads, k = 256, 256, 64, 128
    fused_layer = DsaLayer(dim, heads, 576, 512, "fused")
    with torch.no_grad():
        for p in fused_layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 1.0))
    fused_layer.to(DEV)
    for m in (fused_layer.wq, fused_layer.wkv, fused_layer.wo):         # bf16 projections, FP32 sink
        m.bfloat16()
    ref_layer = copy.deepcopy(fused_layer)
    ref_layer.impl = "reference"
    x = torch.randn((t, dim), generator=gen).to(DEV, torch.bfloat16)
    target = torch.randn((t, dim), generator=gen).to(DEV)
    ids = causal_topk(t, k, gen).to(DEV)
    losses = []
    for layer in (fused_layer, ref_layer):
        loss = torch.nn.functional.mse_loss(layer(x, ids).float(), target)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-2 * abs(losses[1])
    for (name, p), (_, r) in zip(fused_layer.named_parameters(), ref_layer.named_parameters()):
        assert p.grad is not None and r.grad is not None, name
        assert p.grad.dtype == p.dtype
        assert_close(name, p.grad, r.grad)
