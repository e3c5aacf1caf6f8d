"""GPU tests of the fused forward's indexer prefix (`dsagen.sparse_attention(..., indexer_topk=N, impl="fused")`,
cuDNN frontend DSA §1 Sparse Attention Forward's `indexer_topk` / `lse_indexer`; the lse_prefix kernels of
SparseAttnFwdSpec) against the plain-PyTorch reference:

* lse_indexer for H 64/128 (and 16, padded to 64), D_qk 512/576, N in {128, 512, 2048 when K >= 2048, K}, sink
  on/off, topk_length shorter than N (and 0, equal, longer) on some rows, -1, negative, out-of-range and duplicate
  ids, an all-invalid row (+inf), total_S_q = 1;
* out, lse and max_logits bitwise those of the same call without indexer_topk (the prefix kernel only snapshots
  the running softmax state);
* prefixes whose slots are all invalid while later ones are valid (+inf), N = K against lse, the batched layout
  against the flat one, N outside the fused kernel's multiples of 128 (NotImplementedError, no fallback), autograd
  (lse_indexer non-differentiable) and torch.compile(fullgraph=True).

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under `compute-sanitizer --tool memcheck`
(with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation).
"""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.kernels.sparse_mla.spec import config_for
from dsagen.kernels.sparse_mla_bwd.spec import config_for as bwd_config_for
from poison import poison_allocator
from test_sparse_attention import make_inputs

ARCH = "sm_90a"
_SHAPES = [(h, d) for h in (64, 128) for d in (512, 576)]           # 16 heads run the 64-head kernels
# the forward kernels with and without the prefix (the comparisons against indexer_topk=None), and the backward
# kernel of test_autograd_flows_through_out_only (H64 / D576)
REQUIRED_SPECS = ([config_for(h, d, "bfloat16", None, ARCH, None).spec(h, d, "bfloat16", ARCH, lse_prefix=True)
                   for h, d in _SHAPES]
                  + [config_for(h, d, "bfloat16", None, ARCH, None).spec(h, d, "bfloat16", ARCH) for h, d in _SHAPES]
                  + [bwd_config_for(64, 576, "bfloat16", ARCH, None).spec(64, 576, "bfloat16", ARCH,
                                                                          deterministic=False)])

pytestmark = pytest.mark.gpu
DEV = "cuda"
INF = float("inf")


def prefix_lengths(s_q: int, n: int, k: int) -> torch.Tensor:
    """topk_length per row cycling through: shorter than N (N/2, N-1, 0), N, longer (N+64 clamped to K, K, K+7)."""
    pattern = [n // 2, n - 1, n, 0, min(n + 64, k), k, k + 7]
    return torch.tensor([pattern[r % len(pattern)] for r in range(s_q)], dtype=torch.int32, device=DEV)


def fused_and_reference(q, kv, ids, sink, tl, n):
    """(fused outputs with indexer_topk=n, fused outputs without it, reference outputs with it)."""
    poison_allocator()
    f = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=n, impl="fused")
    f0 = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, impl="fused")
    r = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=n, impl="reference")
    torch.cuda.synchronize()
    return f, f0, r


def check_prefix(q, kv, ids, sink, tl, n):
    f, f0, r = fused_and_reference(q, kv, ids, sink, tl, n)
    assert len(f) == 4 and len(f0) == 3
    lse_idx = f[3]
    assert lse_idx.dtype == torch.float32 and lse_idx.shape == f[1].shape
    for got, want, name in zip(f[:3], f0, ("out", "lse", "max_logits")):
        assert torch.equal(got, want), f"{name} differs from the call without indexer_topk"
    assert not torch.isnan(lse_idx).any() and not torch.isneginf(lse_idx).any()
    torch.testing.assert_close(lse_idx, r[3].float(), atol=2e-4, rtol=1e-4)
    return f


CASES = [  # (s_q, H, D_qk, topk, n_kv, sink, adversarial)
    (4, 64, 576, 2048, 4096, True, True),
    (3, 128, 576, 640, 1500, False, True),
    (5, 64, 512, 512, 1000, True, False),
    (4, 128, 512, 1024, 2000, True, True),
    (1, 128, 576, 2048, 8192, True, False),      # total_S_q = 1
    (1, 64, 512, 256, 300, False, True),         # total_S_q = 1, ids past the 300 rows
    (7, 16, 576, 384, 700, True, True),          # 16 heads padded to 64
]


def _ns(k: int) -> list[int]:
    return sorted({n for n in (128, 512, 2048, k) if n <= k})


@pytest.mark.parametrize("case", CASES, ids=lambda c: "sq{}_h{}_d{}_k{}_kv{}_sink{}_adv{}".format(*c))
@pytest.mark.parametrize("length", [False, True])
def test_lse_indexer_matches_reference_adversarial(case, length):
    s_q, h, d_qk, k, n_kv, sink, adversarial = case
    q, kv, ids, attn_sink, _ = make_inputs(s_q, h, d_qk, k, n_kv, seed=(hash(case) + length) % 2**31, sink=sink,
                                           adversarial=adversarial)
    for n in _ns(k):
        tl = prefix_lengths(s_q, n, k) if length else None
        out, lse, _, lse_idx = check_prefix(q, kv, ids, attn_sink, tl, n)
        if adversarial and s_q >= 3:                                     # row 1 has no valid id
            assert torch.isposinf(lse_idx[1]).all() and torch.isposinf(lse[1]).all()
        if length:
            zero = (tl == 0).nonzero().flatten()
            assert torch.isposinf(lse_idx[zero]).all()


@pytest.mark.parametrize("h,d_qk", _SHAPES)
def test_invalid_prefix_with_valid_later_slots_is_inf_adversarial(h, d_qk):
    """Row 0: the first 128 slots invalid (-1, negative, out of range), later ones valid; row 1: valid; row 2: all
    invalid; row 3: topk_length 100 < N = 128."""
    q, kv, ids, sink, _ = make_inputs(4, h, d_qk, 384, 1000, seed=h + d_qk, sink=True)
    ids[0, :128] = torch.tensor([-1, -5, 1000, 2**31 - 1], dtype=torch.int32, device=DEV).repeat(32)
    ids[2] = -1
    tl = torch.tensor([384, 384, 384, 100], dtype=torch.int32, device=DEV)
    out, lse, _, lse_idx = check_prefix(q, kv, ids, sink, tl, 128)
    assert torch.isposinf(lse_idx[0]).all() and torch.isfinite(lse[0]).all()
    assert torch.isfinite(lse_idx[1]).all() and torch.isfinite(lse_idx[3]).all()
    assert torch.isposinf(lse_idx[2]).all()


@pytest.mark.parametrize("h,d_qk", [(64, 576), (128, 512)])
def test_n_equal_k_is_lse(h, d_qk):
    q, kv, ids, sink, tl = make_inputs(5, h, d_qk, 768, 2000, seed=31 + h, length=True)
    _, lse, _, lse_idx = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=768,
                                                 impl="fused")
    torch.testing.assert_close(lse_idx, lse, atol=1e-5, rtol=1e-6)


def test_batched_layout_equals_flat():
    gen = torch.Generator().manual_seed(37)
    b, t, h, n_kv, k = 2, 3, 64, 400, 256
    q = torch.randn((b, t, h, 576), generator=gen).bfloat16().to(DEV)
    kv = torch.randn((b, n_kv, 576), generator=gen).bfloat16().to(DEV)
    ids = torch.randint(-1, n_kv + 3, (b, t, k), generator=gen, dtype=torch.int32).to(DEV)
    sink = torch.randn(h, generator=gen).to(DEV)
    tl = torch.tensor([[256, 60, 128], [0, 200, 255]], dtype=torch.int32, device=DEV)
    got = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=128, impl="fused")
    local = ids.long()
    offs = torch.arange(b, device=DEV).view(b, 1, 1) * n_kv
    flat_ids = torch.where((local >= 0) & (local < n_kv), local + offs, -1).to(torch.int32).reshape(b * t, k)
    want = dsagen.sparse_attention(q.reshape(b * t, h, 576), kv.reshape(b * n_kv, 576), flat_ids, attn_sink=sink,
                                   topk_length=tl.reshape(b * t), indexer_topk=128, impl="fused")
    assert got[3].shape == (b, t, h)
    for g, w in zip(got, want):
        assert torch.equal(g.reshape(w.shape), w)
    r = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=128, impl="reference")
    torch.testing.assert_close(got[3], r[3].float(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [100, 64, 129, 200])
def test_fused_refuses_prefix_lengths_that_are_not_multiples_of_128(n):
    q, kv, ids, sink, _ = make_inputs(2, 64, 576, 256, 500, seed=41)
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        dsagen.sparse_attention(q, kv, ids, attn_sink=sink, indexer_topk=n, impl="fused")
    with pytest.raises(ValueError, match="indexer_topk"):
        dsagen.sparse_attention(q, kv, ids, attn_sink=sink, indexer_topk=384, impl="fused")   # > K


def test_zero_gives_none_and_the_three_usual_outputs():
    q, kv, ids, sink, _ = make_inputs(3, 64, 512, 256, 500, seed=43)
    f = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, indexer_topk=0, impl="fused")
    f0 = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl="fused")
    assert len(f) == 4 and f[3] is None
    for a, b in zip(f[:3], f0):
        assert torch.equal(a, b)


def test_autograd_flows_through_out_only():
    q, kv, ids, sink, tl = make_inputs(3, 64, 576, 256, 600, seed=47, length=True)
    grads = []
    for n in (128, None):
        qq, kk, ss = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
        outs = dsagen.sparse_attention(qq, kk, ids, attn_sink=ss, topk_length=tl, indexer_topk=n, impl="fused")
        if n is not None:
            assert outs[3].grad_fn is None and not outs[3].requires_grad
        (outs[0].float() * torch.linspace(-1, 1, outs[0].shape[-1], device=DEV)).sum().backward()
        grads.append((qq.grad, kk.grad, ss.grad))
    torch.cuda.synchronize()
    for a, b in zip(*grads):                  # the same out and lse feed both backwards (dkv: atomics' order)
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_torch_compile():
    q, kv, ids, sink, tl = make_inputs(3, 64, 512, 384, 900, seed=53, length=True)

    def f(q, kv, ids, sink, tl):
        out, lse, m, lse_idx = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, topk_length=tl, indexer_topk=256,
                                                       impl="fused")
        return out.float().sum(-1) + lse, lse_idx

    eager = f(q, kv, ids, sink, tl)
    compiled = torch.compile(f, fullgraph=True)(q, kv, ids, sink, tl)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(compiled[1], eager[1], atol=0, rtol=0)
