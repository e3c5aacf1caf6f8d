"""CPU tests of the sparse indexer backward family (dsagen/kernels/indexer_bwd): spec checks, the binding, the
compiled kernels' SASS (wgmma for every product, the 16-byte atomics or stores, no local memory), and the host path
with a stand-in kernel against the reference op (batch flattening, head padding, the score gradient, the
deterministic chunks)."""

from __future__ import annotations

import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.indexer_bwd.spec import IndexerBwdConfig, IndexerBwdSpec, config_for
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=128), "num_heads=128 must be 64"),
    (dict(head_dim=96), "head_dim=96 must be 64 or 128"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(stages=5), "stages=5 must be in 2..4"),
    (dict(regs_consumer=240), "exceeds 256"),
    (dict(regs_producer=20), "multiple of 8 in [24, 256]"),
    (dict(arch="sm_100a"), "sm_90a only"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        IndexerBwdSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_binding():
    cfg = config_for(128, "bfloat16", "sm_90a", 132)
    assert cfg == IndexerBwdConfig() and cfg.n_ctas(132) == 264 and IndexerBwdConfig(grid=3).n_ctas(132) == 3
    assert cfg.spec(128, "bfloat16", deterministic=True) == IndexerBwdSpec(arch="sm_90a", deterministic=True)
    with pytest.raises(ValueError, match="grid=0"):
        IndexerBwdConfig(grid=0)
    with pytest.raises(ValueError, match="chunk_bytes=1024"):
        IndexerBwdConfig(chunk_bytes=1024)
    with pytest.raises(ValueError, match="bucket_rows=0"):
        IndexerBwdConfig(bucket_rows=0)
    with pytest.raises(ValueError, match="order_min_bytes=-1"):
        IndexerBwdConfig(order_min_bytes=-1)
    assert cfg.ordered(131072, 128, False) and not cfg.ordered(32768, 128, False)
    assert not cfg.ordered(131072, 128, True) and not IndexerBwdConfig(bucket_rows=None).ordered(1 << 20, 128, False)
    src = render(IndexerBwdSpec(arch="sm_90a", head_dim=64, dtype="float16", deterministic=True))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.indexer_bwd.bwd_sm90 import build" in src and "deterministic=True" in src
    assert len(src.split("SYMBOL = ")[1].splitlines()) <= 12
    assert {"dsagen.kernels.indexer_bwd.bwd_sm90", "dsagen.kernels.common.sm90.epilogue"} <= set(helper_modules(src))


@pytest.mark.compile
@pytest.mark.parametrize("d,deterministic", [(128, False), (128, True), (64, False)])
def test_compiles_to_wgmma(d, deterministic, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = IndexerBwdSpec(arch="sm_90a", head_dim=d, deterministic=deterministic)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1] and 2 * ck.record["launch"]["smem"] <= 227 * 1024
    assert ck.record["regcount"] <= 128                                   # two CTAs of 256 threads per SM
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    halves = d // 64
    # S (D / 16 k-steps, 64 slots x 64 heads), dK (4 k-steps per 64-column half), dQ (4 k-steps, 64 heads x D)
    want = {"64x64x16": d // 16 + 4 * halves + (4 if d == 64 else 0), "64x128x16": 4 if d == 128 else 0}
    for shape, n in want.items():
        assert len(re.findall(rf"HGMMA\.{shape}\.F32\.BF16 ", sass)) == n, shape
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x4", sass)) == (0 if deterministic else 2 * halves * 4)
    if deterministic:
        assert len(re.findall(r"\bSTG\.E\.EF\.128 ", sass)) == 2 * halves * 4    # st.global.cs per-slot rows
    assert not re.search(r"\b(LDL|STL)\b", sass)                          # no register spills
    budgets = sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == sorted([spec.regs_producer, spec.regs_consumer])


class _StandInKernel:
    """The kernel's contract in torch: dW, dQ and dK (added at valid ids, or per slot when deterministic) from dI."""

    def __init__(self, deterministic):
        self.deterministic = deterministic
        self.calls = []

    def launch(self, q, keys, ids, d_i, w, dq, dw, dk, rows, n_k, topk, ld_k, perm, ordered, n_ctas):
        import torch

        self.calls.append(dict(rows=rows, heads=q.shape[1], d_i=d_i.clone(), w=w.clone(), ids=ids.clone(),
                               ordered=ordered))
        valid = ids >= 0
        if ordered:                                     # slot j's dI is at perm[j]
            d_i = torch.where(valid, d_i.gather(1, perm.clamp_min(0).long()), 0.0)
        kg = keys.float()[ids.clamp_min(0).long()] * valid[..., None]             # (rows, topk, D)
        dots = torch.einsum("rhd,rkd->rhk", q.float(), kg)
        dw.copy_(torch.einsum("rk,rhk->rh", d_i, dots.relu()))
        g = d_i[:, None, :] * w[..., None] * (dots > 0)                            # (rows, H, topk)
        dq.copy_(torch.einsum("rhk,rkd->rhd", g, kg).to(dq.dtype))
        dkg = torch.einsum("rhk,rhd->rkd", g, q.float())
        if self.deterministic:
            dk[:rows].copy_(dkg)
        else:
            dk.index_add_(0, ids[valid].long(), dkg[valid])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("global_ids", [False, True])
def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch, cpu_row_scatter, deterministic, global_ids):
    import torch

    import dsagen
    from dsagen.kernels.indexer_bwd import host as ib_host

    kernel = _StandInKernel(deterministic)
    cfg = IndexerBwdConfig(chunk_bytes=1 << 20)
    spec = cfg.spec(128, "bfloat16", deterministic=deterministic)
    monkeypatch.setattr(ib_host, "_launch_plan", lambda *a, **k: (spec, kernel, 3, cfg))
    gen = torch.Generator().manual_seed(4)
    b, s_q, h, d, s_k, k = 2, 5, 16, 128, 9, 700                          # 700 slots: 3 rows per 1 MiB chunk
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    kk = torch.randn(b, s_k, d, generator=gen).bfloat16()
    w = torch.randn(b, s_q, h, generator=gen).bfloat16()
    ids = torch.randint(-2, s_k + 2, (b, s_q, k), generator=gen, dtype=torch.int32)
    if global_ids:
        ids = torch.where((ids >= 0) & (ids < s_k), ids + torch.arange(b, dtype=torch.int32).view(b, 1, 1) * s_k,
                          ids)
    tgt = torch.rand(b, s_q, k, generator=gen)
    p = torch.rand(b, s_q, k, generator=gen)
    grad_loss = torch.tensor([0.7])
    kw = dict(grad_loss=grad_loss, sm_scale=0.3, loss_coeff=2.0, topk_indices_global=global_ids)
    before = [t.clone() for t in (q, w, kk, tgt, p, ids)]
    got = ib_host.run(q, w, kk, tgt, p, ids, grad_loss, 0.3, 2.0, global_ids, deterministic, cfg)
    want = dsagen.indexer_backward(q.float(), w.float(), kk.float(), tgt, p, ids, **kw, impl="reference")
    assert [x.dtype for x in got] == [torch.bfloat16, torch.bfloat16, torch.bfloat16]
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape
        assert (g_.float() - w_).abs().max() <= 2e-2 * w_.abs().max()
    assert all(c["heads"] == 64 and (c["w"][:, h:] == 0).all() for c in kernel.calls)
    assert [c["rows"] for c in kernel.calls] == ([2, 2, 2, 2, 2] if deterministic else [10])  # 1 MiB chunks
    # the score gradient: c * sm_scale * (p * sum_J tgt - tgt) on valid slots, 0 elsewhere
    from dsagen.reference.indexer_training import decode_topk_indices

    _, valid = decode_topk_indices(ids, s_k, global_ids)
    t_v, p_v = torch.where(valid, tgt, 0.0), torch.where(valid, p, 0.0)
    want_di = 0.7 * 2.0 / (b * s_q) * 0.3 * (p_v * t_v.sum(-1, keepdim=True) - t_v)
    d_i = torch.cat([c["d_i"] for c in kernel.calls]).view(b, s_q, k)
    assert torch.allclose(d_i, want_di, atol=1e-7) and (d_i[~valid] == 0).all()
    # inputs are not modified
    assert all(torch.equal(x, y) for x, y in zip(before, (q, w, kk, tgt, p, ids)))


def _order_on_the_cpu(idx, n_kv, length, bucket_rows, *, ids_out, win_out, perm_out):
    """The ordering kernel's contract (sparse_mla_bwd/order.py) in torch: each row's valid ids stable-sorted by
    window, then -1; perm the input slot of each, -1 past them."""
    import torch

    valid = (idx >= 0) & (idx < n_kv)
    key = torch.where(valid, idx // bucket_rows, torch.iinfo(torch.int32).max)
    order = torch.sort(key, dim=1, stable=True).indices
    count = valid.sum(1, keepdim=True)
    past = torch.arange(idx.shape[1]).view(1, -1) >= count
    ids_out.copy_(idx.gather(1, order).masked_fill(past, -1))
    perm_out.copy_(order.to(torch.int32).masked_fill(past, -1))
    win_out[:, 0] = 0
    win_out[:, 1] = count[:, 0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_ordered_ids_on_the_cpu_with_a_stand_in_kernel(monkeypatch, cpu_row_scatter, deterministic):
    """A pool whose accumulator reaches order_min_bytes, atomic mode: the kernel gets each row's ids ordered by key
    window and the input slot of each (so that its dI is the slot's own), and the gradients still match the
    reference; a smaller pool, and the deterministic mode at any size, keep the ids as given."""
    import torch

    import dsagen
    from dsagen.kernels.indexer_bwd import host as ib_host

    gen = torch.Generator().manual_seed(6)
    b, s_q, h, d, s_k, k = 1, 6, 8, 64, 40, 2100
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    kk = torch.randn(b, s_k, d, generator=gen).bfloat16()
    w = torch.randn(b, s_q, h, generator=gen).bfloat16()
    ids = torch.randint(-2, s_k + 2, (b, s_q, k), generator=gen, dtype=torch.int32)
    tgt, p = torch.rand(b, s_q, k, generator=gen), torch.rand(b, s_q, k, generator=gen)
    want = dsagen.indexer_backward(q.float(), w.float(), kk.float(), tgt, p, ids, sm_scale=0.3, impl="reference")
    monkeypatch.setattr(ib_host, "slot_windows", _order_on_the_cpu)
    for min_bytes, big_pool in ((s_k * d * 4, True), (s_k * d * 4 + 1, False)):
        ordered = big_pool and not deterministic
        cfg = IndexerBwdConfig(chunk_bytes=1 << 20, bucket_rows=8, order_min_bytes=min_bytes)
        assert cfg.ordered(s_k, d, deterministic) == ordered
        kernel = _StandInKernel(deterministic)
        spec = cfg.spec(d, "bfloat16", deterministic=deterministic)
        monkeypatch.setattr(ib_host, "_launch_plan", lambda *a, **kw: (spec, kernel, 3, cfg))
        got = ib_host.run(q, w, kk, tgt, p, ids, None, 0.3, 1.0, False, deterministic, cfg)
        for g_, w_ in zip(got, want):
            assert (g_.float() - w_).abs().max() <= 2e-2 * w_.abs().max()
        launched = torch.cat([c["ids"] for c in kernel.calls])
        valid = (ids[0] >= 0) & (ids[0] < s_k)
        if ordered:
            windows = torch.where(launched >= 0, launched // 8, 99)
            assert (windows[:, 1:] >= windows[:, :-1]).all()          # ascending windows, -1 after them
            assert torch.equal(launched.sort(1).values, torch.where(valid, ids[0], -1).sort(1).values)
        else:
            assert torch.equal(launched, torch.where(valid, ids[0], -1))
        assert all(c["ordered"] == int(ordered) for c in kernel.calls)
        assert len(kernel.calls) == (6 if deterministic else 1)     # 1 MiB chunks of 2100 x 64 FP32 rows: 1 row


def test_fused_refuses_what_it_does_not_cover():
    import torch

    from dsagen.kernels.indexer_bwd.host import supported_reason

    bf = torch.bfloat16
    assert "H=128" in supported_reason(torch.zeros(1, 2, 128, 128, dtype=bf), torch.zeros(1, 3, 128, dtype=bf))
    assert "D=96" in supported_reason(torch.zeros(1, 2, 64, 96, dtype=bf), torch.zeros(1, 3, 96, dtype=bf))
    assert "float32" in supported_reason(torch.zeros(1, 2, 64, 128), torch.zeros(1, 3, 128))
    assert supported_reason(torch.zeros(1, 2, 64, 128, dtype=bf), torch.zeros(1, 3, 128, dtype=bf)) == ""


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_custom_op_and_its_fake(monkeypatch, cpu_row_scatter, deterministic):
    """torch.library.opcheck of dsagen::indexer_backward_fused (schema, fake tensor, AOT dispatch) on the CPU, the
    kernel a stand-in: the fake's outputs match the op's."""
    import torch

    from dsagen.kernels.indexer_bwd import host as ib_host

    cfg = IndexerBwdConfig(chunk_bytes=1 << 20)
    spec = cfg.spec(128, "bfloat16", deterministic=deterministic)
    monkeypatch.setattr(ib_host, "_launch_plan", lambda *a, **k: (spec, _StandInKernel(deterministic), 3, cfg))
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 64, 128, generator=gen).bfloat16()
    w = torch.randn(1, 4, 64, generator=gen).bfloat16()
    k = torch.randn(1, 7, 128, generator=gen).bfloat16()
    ids = torch.randint(-1, 7, (1, 4, 5), generator=gen, dtype=torch.int32)
    tgt, p = torch.rand(1, 4, 5, generator=gen), torch.rand(1, 4, 5, generator=gen)
    torch.library.opcheck(ib_host._fused_op, (q, w, k, tgt, p, ids, torch.tensor(0.5), 0.3, 1.0, False,
                                              deterministic))


def test_empty_shapes_give_zero_gradients_without_a_launch(monkeypatch):
    import torch

    from dsagen.kernels.indexer_bwd import host as ib_host

    monkeypatch.setattr(ib_host, "_launch_plan", lambda *a, **k: pytest.fail("no launch for an empty call"))
    bf = torch.bfloat16
    for b, s_q, s_k, k in ((1, 0, 5, 4), (1, 3, 5, 0), (2, 3, 0, 4)):
        q, w = torch.randn(b, s_q, 64, 128).to(bf), torch.randn(b, s_q, 64).to(bf)
        kk = torch.randn(b, s_k, 128).to(bf)
        ids = torch.zeros(b, s_q, k, dtype=torch.int32)
        sc = torch.rand(b, s_q, k)
        dq, dw, dk = ib_host.run(q, w, kk, sc, sc, ids, None, 1.0, 1.0, False, False)
        assert dq.shape == q.shape and dw.shape == w.shape and dk.shape == kk.shape
        assert not dq.any() and not dw.any() and not dk.any()
