"""The signature-keyed fast path of eager fused calls (dsagen.ops._fast_path) and its use by indexer_scores, on the
CPU: keys tell apart every property the ops' checks read, and the public op runs a stored plan or takes its full
path (checks included) and stores the plan it returns. The kernels' side runs in tests/gpu/test_indexer_scores.py."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.ops import indexer as ix
from dsagen.ops._fast_path import FastPaths, call_signature, eager_call


def test_signature_tells_apart_what_checks_read():
    base = torch.zeros(4, 8)
    key = call_signature(base, 1, True)
    assert key == call_signature(torch.ones(4, 8), 1, True)            # values never enter
    others = [
        (torch.zeros(8, 4), 1, True),                                    # shape
        (torch.zeros(8, 4).t(), 1, True),                                # strides
        (torch.zeros(4, 8, dtype=torch.float64), 1, True),               # dtype
        (torch.zeros(4, 9)[:, 1:], 1, True),                             # base address modulo 16 (and strides)
        (torch.zeros(4, 8, requires_grad=True), 1, True),                # requires_grad
        (torch.nn.Parameter(torch.zeros(4, 8)), 1, True),                # tensor type
        (base, 1.0, True),                                               # scalar type (1.0 == 1)
        (base, True, True),                                              # bool is not int
        (base, 1, 1),
        (base, 1, None),
    ]
    for args in others:
        assert call_signature(*args) != key, args
    with torch.no_grad():
        assert call_signature(base, 1, True) != key                      # autograd recording


def test_flat_signature_keeps_argument_boundaries():
    """The key is one flat tuple; argument lists whose fields could line up differently still get distinct keys."""
    t = torch.zeros(2)
    lists = [(None, t), (t, None), (None, None, t), (t,), (None, 1), (1, None), (int, 1), (None, int),
             (type(None), None), (None, type(None)), (t, torch.Tensor), (torch.Tensor, t)]
    keys = [call_signature(*args) for args in lists]
    assert len(set(keys)) == len(keys)


def test_signature_of_misaligned_view_differs():
    flat = torch.zeros(64, dtype=torch.uint8)
    assert call_signature(flat[16:48].view(4, 8)) != call_signature(flat[1:33].view(4, 8))
    assert call_signature(flat[16:48].view(4, 8)) == call_signature(flat[32:64].view(4, 8))


def test_signature_none_for_unkeyable_arguments():
    assert call_signature(torch.zeros(2, 2).to_sparse()) is None          # no strides
    paths = FastPaths("op")
    key = call_signature(torch.zeros(2), [1, 2])                          # unhashable: never kept nor found
    paths.put(key, len)
    assert len(paths) == 0 and paths.get(key) is None


def test_fast_paths_store_and_evict():
    paths = FastPaths("op", capacity=2)
    paths.put(None, len)                                                  # no key: nothing kept
    assert len(paths) == 0 and paths.get(None) is None
    paths.put(("a",), len)
    paths.put(("b",), sum)
    paths.put(("a",), max)                                                # replaces, keeps the size
    assert len(paths) == 2 and paths.get(("a",)) is max
    paths.put(("c",), min)                                                # evicts the oldest key
    assert paths.get(("a",)) is None and paths.get(("b",)) is sum and paths.get(("c",)) is min
    paths.clear()
    assert len(paths) == 0


def test_eager_call():
    assert eager_call(torch.zeros(1))
    assert not eager_call(torch.nn.Parameter(torch.zeros(1)))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not eager_call(torch.zeros(1))


def _inputs(b=1, sq=6, sk=6, h=16, d=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, sk, d, generator=g, dtype=torch.bfloat16)
    w = torch.randn(b, sq, h, generator=g, dtype=torch.bfloat16)
    return q, k, w


@pytest.fixture
def fake_fused(monkeypatch):
    """dsagen.indexer_scores' fused host replaced by one that records its calls and hands back a plan that
    records its own (so the public op's wiring runs on the CPU)."""
    calls = {"full": 0, "plan": 0}

    def plan(q, k, w, q_off, out, lse, qs, ks):
        calls["plan"] += 1
        return torch.full((q.shape[0], q.shape[1], k.shape[1]), 2.0), None

    def host(q, k, w, *, keep_plan=None, shapes, **kw):
        calls["full"] += 1
        if keep_plan is not None:
            keep_plan(plan)
        return torch.full(shapes[0], 1.0), None

    monkeypatch.setattr("dsagen.ops._fused.fused_impl", lambda name, device: host)
    ix._SCORES_FAST.clear()
    yield calls
    ix._SCORES_FAST.clear()


def test_indexer_scores_runs_stored_plan(fake_fused):
    q, k, w = _inputs()
    assert dsagen.indexer_scores(q, k, w).eq(1.0).all()                   # full path, stores the plan
    assert fake_fused == {"full": 1, "plan": 0} and len(ix._SCORES_FAST) == 1
    q2, k2, w2 = _inputs()
    assert dsagen.indexer_scores(q2, k2, w2).eq(2.0).all()                # same signature: the plan
    assert fake_fused == {"full": 1, "plan": 1}
    dsagen.indexer_scores(q, k, w, ratio=2)                               # another signature: full path
    assert fake_fused == {"full": 2, "plan": 1} and len(ix._SCORES_FAST) == 2


def test_indexer_scores_bad_input_after_plan_still_checked(fake_fused):
    q, k, w = _inputs()
    dsagen.indexer_scores(q, k, w)
    with pytest.raises(ValueError, match="weights"):
        dsagen.indexer_scores(q, k, w[:, :, :8])
    with pytest.raises(TypeError, match="ratio"):
        dsagen.indexer_scores(q, k, w, ratio=1.0)
    with pytest.raises(ValueError, match="lse_out"):
        dsagen.indexer_scores(q, k, w, lse_out=torch.empty(1, 6))
    assert fake_fused["plan"] == 0


def test_indexer_scores_no_fast_path_for_thd_or_reference(fake_fused):
    q, k, w = _inputs()
    cu = torch.tensor([0, 6], dtype=torch.int32)
    dsagen.indexer_scores(q[0], k[0], w[0], cu_seqlens_q=cu, cu_seqlens_k=cu)
    dsagen.indexer_scores(q[0], k[0], w[0], cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert fake_fused == {"full": 2, "plan": 0} and len(ix._SCORES_FAST) == 0
    ref = dsagen.indexer_scores(q, k, w, impl="reference")
    assert torch.isfinite(ref[0, -1]).all() and len(ix._SCORES_FAST) == 0


def test_lightning_indexer_runs_stored_plan(monkeypatch):
    from dsagen.ops import lightning_indexer as li

    calls = {"full": 0, "plan": 0}

    def plan(q, k, w, cu_q, cu_k):
        calls["plan"] += 1
        return torch.full((q.shape[0], q.shape[1], 4), 2, dtype=torch.int32)

    def host(q, k, w, topk, *, keep_plan=None, **kw):
        calls["full"] += 1
        if keep_plan is not None:
            keep_plan(plan)
        return torch.full((q.shape[0], q.shape[1], topk), 1, dtype=torch.int32)

    monkeypatch.setattr("dsagen.ops._fused.fused_impl", lambda name, device: host)
    li._FAST.clear()
    q, k, w = _inputs()
    try:
        assert dsagen.lightning_indexer(q, k, w, 4, causal=True).eq(1).all()
        assert dsagen.lightning_indexer(*_inputs(), 4, causal=True).eq(2).all()
        assert calls == {"full": 1, "plan": 1}
        with pytest.raises(TypeError, match="causal"):                    # another signature: checked
            dsagen.lightning_indexer(q, k, w, 4, causal=1)
        cu = torch.tensor([0, 6], dtype=torch.int32)
        dsagen.lightning_indexer(q, k, w, 4, causal=True, cu_seqlens=cu, cu_seqlens_k=cu, check_offsets=True)
        assert calls == {"full": 2, "plan": 1} and len(li._FAST) == 1      # check_offsets reads values: no plan
    finally:
        li._FAST.clear()


def test_sparse_attention_runs_stored_plan_without_autograd(monkeypatch):
    from dsagen.ops import sparse_attention as sa

    calls = {"full": 0, "plan": 0}

    def launch(q, kv, ids, sink, length):
        calls["plan"] += 1
        s_q, h = q.shape[:2]
        return torch.full((s_q, h, 512), 2.0), torch.zeros(s_q, h), torch.zeros(s_q, h)

    def host(q, kv, ids, *, keep_plan=None, **kw):
        calls["full"] += 1
        if keep_plan is not None:
            keep_plan(launch)
        s_q, h = q.shape[:2]
        return torch.full((s_q, h, 512), 1.0), torch.zeros(s_q, h), torch.zeros(s_q, h)

    monkeypatch.setattr(sa, "fused_impl", lambda name, device: host)
    sa._FAST.clear()
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 4, 576, generator=g), torch.randn(2, 5, 576, generator=g)
    ids = torch.randint(0, 5, (2, 3, 8), generator=g, dtype=torch.int32)
    try:
        out, lse, mx = dsagen.sparse_attention(q, kv, ids)                       # full path: the plan kept
        assert out.shape == (2, 3, 4, 512) and out.eq(1.0).all() and calls == {"full": 1, "plan": 0}
        out, lse, mx, lse_i = dsagen.sparse_attention(q, kv, ids, indexer_topk=0)  # another signature
        assert lse_i is None and calls == {"full": 2, "plan": 0}
        out, lse, mx = dsagen.sparse_attention(q.clone(), kv.clone(), ids.clone())   # batched layout by the plan
        assert out.shape == (2, 3, 4, 512) and out.eq(2.0).all() and calls == {"full": 2, "plan": 1}
        qg = q.clone().requires_grad_()
        with torch.no_grad():
            dsagen.sparse_attention(qg, kv, ids)                                  # no grad recorded: may keep
        assert calls["plan"] == 1 and len(sa._FAST) == 3
        with pytest.raises(TypeError, match="topk_idxs"):
            dsagen.sparse_attention(q, kv, ids.long())                            # another signature: checked
    finally:
        sa._FAST.clear()


def test_sparse_attention_decode_runs_stored_plan(monkeypatch):
    """dsagen.sparse_attention_decode (fused, eager): the first call of a signature takes the full path (checks, the
    fused host) and keeps the host's plan; a later call of the signature runs the plan; a call of another signature
    is checked again; impl="reference" keeps none."""
    from dsagen.ops import kv_cache as kc

    calls = {"full": 0, "plan": 0}

    def plan(q, kv_cache, indices, attn_sink, topk_length):
        calls["plan"] += 1
        return torch.full((*q.shape[:3], 512), 2.0), torch.zeros(q.shape[:3])

    def host(q, kv_cache, indices, *, keep_plan=None, **kw):
        calls["full"] += 1
        if keep_plan is not None:
            keep_plan(plan)
        return torch.full((*q.shape[:3], 512), 1.0), torch.zeros(q.shape[:3])

    monkeypatch.setattr(kc, "fused_impl", lambda name, device: host)
    kc._DECODE_FAST.clear()
    q = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 576, dtype=torch.bfloat16)
    ids = torch.zeros(2, 1, 128, dtype=torch.int32)
    try:
        out, lse = dsagen.sparse_attention_decode(q, cache, ids)
        assert out.eq(1.0).all() and calls == {"full": 1, "plan": 0}
        out, lse = dsagen.sparse_attention_decode(q.clone(), cache.clone(), ids.clone())
        assert out.eq(2.0).all() and calls == {"full": 1, "plan": 1}
        dsagen.sparse_attention_decode(q, cache, ids, topk_length=torch.ones(2, dtype=torch.int32))
        assert calls == {"full": 2, "plan": 1}
        with pytest.raises(TypeError, match="indices"):
            dsagen.sparse_attention_decode(q, cache, ids.long())                  # another signature: checked
        dsagen.sparse_attention_decode(q, cache, ids, impl="reference")            # the reference: no plan
        assert calls == {"full": 2, "plan": 1} and len(kc._DECODE_FAST) == 2
    finally:
        kc._DECODE_FAST.clear()


def test_indexer_decode_topk_runs_stored_plan(monkeypatch):
    """dsagen.indexer_decode_topk (fused, eager): the first call of a signature takes the full path and keeps the
    host's plan; a later call of the signature runs the plan with the new tensors; another signature is checked
    again; impl="reference" keeps none."""
    from dsagen.ops import kv_cache as kc

    calls = {"full": 0, "plan": 0}

    def plan(q, weights, k_cache, block_table, cache_seqlens):
        calls["plan"] += 1
        return torch.full((*q.shape[:2], 8), 2, dtype=torch.int32)

    def host(q, weights, k_cache, block_table, cache_seqlens, top_k, keep_plan=None):
        calls["full"] += 1
        if keep_plan is not None:
            keep_plan(plan)
        return torch.full((*q.shape[:2], top_k), 1, dtype=torch.int32)

    monkeypatch.setattr(kc, "fused_impl", lambda name, device: host)
    kc._INDEXER_DECODE_FAST.clear()
    q = torch.zeros(2, 1, 64, 128, dtype=torch.bfloat16)
    w = torch.zeros(2, 1, 64)
    cache = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.full((2,), 64, dtype=torch.int32)
    try:
        assert dsagen.indexer_decode_topk(q, w, cache, table, lens, 8).eq(1).all() and calls["full"] == 1
        ids = dsagen.indexer_decode_topk(q.clone(), w.clone(), cache.clone(), table.clone(), lens.clone(), 8)
        assert ids.eq(2).all() and calls == {"full": 1, "plan": 1}
        dsagen.indexer_decode_topk(q, w, cache, table, lens, 16)                   # another top_k: full path
        assert calls == {"full": 2, "plan": 1}
        with pytest.raises(TypeError, match="weights"):
            dsagen.indexer_decode_topk(q, w.double(), cache, table, lens, 8)     # another signature: checked
        dsagen.indexer_decode_topk(q, w, cache, table, lens, 8, impl="reference")  # the reference: no plan
        assert calls == {"full": 2, "plan": 1} and len(kc._INDEXER_DECODE_FAST) == 2
    finally:
        kc._INDEXER_DECODE_FAST.clear()


def test_batched_sparse_attention_ids_by_local_to_global(monkeypatch):
    """The batched layout's flat ids: an eager fused call takes the fused local_to_global (here its reference,
    standing in for the kernel) and gets the same ids as the torch ops of the other paths, as a (B * T, K) view;
    beyond the kernel's 65535 batches the torch ops run."""
    from dsagen.ops import sparse_attention as sa
    from dsagen.reference import indices as ref_indices

    used = []

    def fused_impl(name, device):
        assert name == "local_to_global"
        used.append(name)
        return ref_indices.local_to_global

    monkeypatch.setattr(sa, "fused_impl", fused_impl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-3, 12, (3, 5, 8), generator=g, dtype=torch.int32)
    ids[1, 2] = -1
    fused = sa._flat_ids(ids, 3, 9, fused=True)
    plain = sa._flat_ids(ids, 3, 9)
    assert used == ["local_to_global"] and fused.shape == (15, 8) and fused.dtype == torch.int32
    assert torch.equal(fused, plain)
    assert fused.ge(-1).all() and (fused[5:10].eq(-1) | fused[5:10].ge(9) & fused[5:10].lt(18)).all()
    empty = torch.zeros(2, 3, 0, dtype=torch.int32)                      # K = 0
    assert sa._flat_ids(empty, 2, 4, fused=True).shape == (6, 0)
    wide = torch.zeros(65536, 1, 1, dtype=torch.int32)
    assert torch.equal(sa._flat_ids(wide, 65536, 2, fused=True), torch.arange(65536, dtype=torch.int32)[:, None] * 2)
    assert len(used) == 2                                                # past the grid limit: the torch ops
