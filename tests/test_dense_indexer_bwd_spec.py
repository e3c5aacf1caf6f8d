"""CPU tests of the dense indexer backward kernel (indexer_bwd/dense_sm90.py): spec checks, the binding, the
compiled kernels' SASS, and the host path with a stand-in kernel that computes the kernel's contract in torch."""

from __future__ import annotations

import math
import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.indexer_bwd.spec import DenseIndexerBwdConfig, DenseIndexerBwdSpec, dense_config_for
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=32), "num_heads=32 must be 64"),
    (dict(head_dim=256), "head_dim=256 must be 64 or 128"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(stages=5), "stages=5 must be in 2..4"),
    (dict(regs_consumer=240), "exceeds 256"),
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(kl_loss=True, deterministic=True), "kl_loss=True needs deterministic=False"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        DenseIndexerBwdSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_binding():
    cfg = dense_config_for(128, "bfloat16", "sm_90a", 132)
    assert cfg == DenseIndexerBwdConfig() and cfg.n_ctas(132) == 264
    assert cfg.spec(128, "bfloat16") == DenseIndexerBwdSpec(arch="sm_90a")
    with pytest.raises(ValueError, match="grid=0"):
        DenseIndexerBwdConfig(grid=0)
    src = render(DenseIndexerBwdSpec(arch="sm_90a", head_dim=64))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.indexer_bwd.dense_sm90 import build" in src
    assert "dsagen.kernels.indexer_bwd.dense_sm90" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("d, kl_loss", [(128, False), (64, False), (128, True)])
def test_compiles_to_wgmma_and_atomics(d, kl_loss, tmp_path):
    """The sparse form's products per tile (S, dQ, dK halves), 16-byte FP32 atomics for dK, no spills, budgets
    inside the CTA pool (two CTAs of 256 threads at 128 registers); the kl_loss kernel also has the loss's log2
    (libdevice's: FFMA polynomial, no MUFU.LG2) and its 4 partials' butterfly shuffles."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = DenseIndexerBwdSpec(arch="sm_90a", head_dim=d, kl_loss=kl_loss)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1]
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    assert "HGMMA" in sass and "REDG.E.ADD.F32x4" in sass.replace(".STRONG.GPU", "")
    if kl_loss:
        counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("FFMA", "SHFL.BFLY")}
        base_spec = DenseIndexerBwdSpec(arch="sm_90a", head_dim=d)
        base = disassemble(compile_module(base_spec, render(base_spec), tmp_path / "plain").cubin)
        plain = {op: len(re.findall(rf"\b{op}\b", base)) for op in counts}
        assert counts["FFMA"] > plain["FFMA"] and counts["SHFL.BFLY"] == plain["SHFL.BFLY"] + 2, (counts, plain)
    assert not re.findall(r"(LDL|STL)", sass)                                      # no spills
    budgets = sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == sorted([spec.regs_producer, spec.regs_consumer])
    assert 128 * (spec.regs_producer + spec.regs_consumer) <= 256 * ck.record["regcount"]


class _StandInKernel:
    """The dense backward kernel's contract (dense_sm90's docstring) in torch, for the host paths on the CPU."""

    kl_loss = False                                  # the kl_loss kernel's stand-in sets it

    def launch(self, q, keys, attn, index, norm, lse, cs, w, dq, dw, dk, q_off, loss, rows, T, S, ratio, has_off,
               ld_k, ld_s, n_ctas):
        import torch

        slots = dk.dim() == 3                        # the deterministic kernel: per-slot rows [rows, S, D]
        if not slots:
            dk.zero_()
        for tok in range(rows):
            b, t = divmod(tok, T)
            off = int(q_off[b]) if has_off else 0
            hi = min(max((off + t + 1) // ratio, 0), S) if off + t + 1 > 0 else 0
            kr = keys[b * S:b * S + hi].float()
            inv = 1.0 / norm[tok] if norm[tok] > 0 else 0.0
            has = 1.0 if norm[tok] > 0 else 0.0
            tgt = attn[tok, :hi] * inv
            di = cs[0] * (torch.exp(index[tok, :hi] - lse[tok]) * has - tgt)                     # [hi]
            if self.kl_loss:                         # the row's KL sum as 4 partials (here all in the first)
                pos = tgt > 0
                kl = torch.where(pos, tgt * (torch.log(torch.where(pos, tgt, 1.0)) - (index[tok, :hi] - lse[tok])),
                                 0.0).sum()
                loss[tok] = torch.stack([kl, kl.new_zeros(()), kl.new_zeros(()), kl.new_zeros(())])
            s = kr @ q[tok].float().T                                                            # [hi, H]
            dw[tok] = (di[:, None] * torch.relu(s)).sum(0)
            g = (di[:, None] * w[tok][None, :] * (s > 0)).to(q.dtype).float()
            dq[tok] = (g.T @ kr).to(dq.dtype)
            if slots:
                dk[tok, :hi] = g @ q[tok].float()
            else:
                dk[b * S:b * S + hi] += g @ q[tok].float()


def _bshd_case(seed: int):
    """B 2, S_q 5, 16 heads (padded to 64 by the host), D 64, S_k 7, ratio 2, offsets -3 (empty first rows) and 40
    (every key): (q, w, k, attn, norm, index, lse, offsets) with the dense recomputes' -inf masks and L1 norms."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    b, s_q, h, d, s_k = 2, 5, 16, 64, 7
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    w = torch.randn(b, s_q, h, generator=gen).bfloat16()
    k = torch.randn(b, s_k, d, generator=gen).bfloat16()
    off = torch.tensor([-3, 40], dtype=torch.int32)
    vis = torch.stack([torch.arange(s_k)[None, :] < torch.clamp((int(o) + torch.arange(s_q) + 1) // 2, 0, s_k)[:, None]
                       for o in off])
    attn = torch.rand(b, s_q, s_k, generator=gen).masked_fill(~vis, -math.inf)
    index = torch.randn(b, s_q, s_k, generator=gen).masked_fill(~vis, -math.inf)
    norm = torch.where(vis, attn, 0.0).sum(-1)
    return q, w, k, attn, norm, index, torch.logsumexp(index, dim=-1), off


def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """dense_host's flattening, head padding (zero weights), the folded c * sm_scale with grad_loss, offsets and the
    dense score rows, with a stand-in for the kernel that computes its contract (dense_sm90's docstring) in torch,
    against the reference op: B 2, 16 heads padded to 64, ratio 2, offsets that empty rows and pass every key."""
    import torch

    import dsagen
    from dsagen.kernels.indexer_bwd import dense_host

    spec = DenseIndexerBwdSpec(arch="sm_90a", head_dim=64)
    monkeypatch.setattr(dense_host, "_launch_plan",
                        lambda *a, **k: (spec, _StandInKernel(), 3, DenseIndexerBwdConfig()))
    q, w, k, attn, norm, index, lse, off = _bshd_case(6)
    grad = torch.tensor(1.7)
    kw = dict(grad_loss=grad, sm_scale=0.3, loss_coeff=0.5, ratio=2, q_causal_offsets=off)
    got = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw)
    want = dsagen.dense_indexer_backward(q, w, k, attn, norm, index, lse, impl="reference", **kw)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        assert torch.allclose(g_.float(), w_.float(), rtol=2e-2, atol=2e-2 * max(w_.float().abs().max().item(), 1e-6))


def test_kl_block_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """kl_block_backward: the kl_loss kernel's launch (its per-row KL partials summed) and the same
    gradients as dense_indexer_backward; the KL sum against the loss of the reference dense_indexer_kl_backward's
    definition computed here from the score rows: B 2, 16 heads, ratio 2, offsets that empty rows (norm 0)."""
    import torch

    from dsagen.kernels.indexer_bwd import dense_host

    class KLStandIn(_StandInKernel):
        kl_loss = True

    def plan(*a, kl_loss=False):                     # the kl_loss kernel only where the host asks for it
        spec = DenseIndexerBwdSpec(arch="sm_90a", head_dim=64, kl_loss=kl_loss)
        return spec, (KLStandIn() if kl_loss else _StandInKernel()), 3, DenseIndexerBwdConfig()

    monkeypatch.setattr(dense_host, "_launch_plan", plan)
    q, w, k, attn, norm, index, lse, off = _bshd_case(7)
    kw = dict(grad_loss=torch.tensor(1.7), sm_scale=0.3, loss_coeff=0.5, ratio=2, q_causal_offsets=off)
    g_q, g_w, g_k, kl = dense_host.kl_block_backward(q, w, k, attn, norm, index, lse, **kw)
    want = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw)
    assert torch.equal(g_q, want[0]) and torch.equal(g_w, want[1])
    assert g_k.dtype == torch.float32 and torch.equal(g_k.to(k.dtype), want[2])
    tgt = torch.where(torch.isneginf(attn), 0.0, attn).double() / norm.double()[..., None]
    tgt = torch.where(norm[..., None] > 0, tgt, 0.0)
    terms = tgt * (torch.log(tgt) - (index.double() - lse.double()[..., None]))
    assert (norm == 0).any()                                        # an empty row: it adds nothing
    terms = terms[tgt > 0]
    assert kl.shape == () and abs(kl.item() - terms.sum().item()) <= 1e-5 * terms.abs().sum().item()


def test_deterministic_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """deterministic=True: launches over blocks of query rows (slot_bytes fitting 2 rows of S_k x D FP32), each a
    batch of one with the offset shifted to its first row, whose per-slot rows are summed over the rows; the same
    gradients as the reference, B 2, ratio 2, offsets that empty rows and pass every key."""
    import torch

    import dsagen
    from dsagen.kernels.indexer_bwd import dense_host

    launches = []

    class Recording(_StandInKernel):
        def launch(self, *a):
            launches.append((a[13], tuple(a[10].shape), int(a[11][0])))     # rows, slot rows' shape, offset
            super().launch(*a)

    cfg = DenseIndexerBwdConfig(slot_bytes=2 * 7 * 64 * 4)
    spec = cfg.spec(64, "bfloat16", deterministic=True)
    monkeypatch.setattr(dense_host, "_launch_plan", lambda *a, **k: (spec, Recording(), 3, cfg))
    q, w, k, attn, norm, index, lse, off = _bshd_case(12)
    kw = dict(grad_loss=torch.tensor(0.8), sm_scale=0.3, loss_coeff=0.5, ratio=2, q_causal_offsets=off)
    got = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, deterministic=True, **kw)
    want = dsagen.dense_indexer_backward(q, w, k, attn, norm, index, lse, impl="reference", **kw)
    assert launches == [(2, (2, 7, 64), -3), (2, (2, 7, 64), -1), (1, (1, 7, 64), 1),
                        (2, (2, 7, 64), 40), (2, (2, 7, 64), 42), (1, (1, 7, 64), 44)]
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        assert torch.allclose(g_.float(), w_.float(), rtol=2e-2, atol=2e-2 * max(w_.float().abs().max().item(), 1e-6))


def test_packed_segments_on_the_cpu_with_a_stand_in_kernel(monkeypatch):
    """THD: one launch per segment on views of the (total_q, W) score rows (W wider than every segment), c over all
    total_q rows; segments without rows or keys and rows after the last segment get zero gradients; against the
    reference's THD form."""
    import torch

    import dsagen
    from dsagen.kernels.indexer_bwd import dense_host

    spec = DenseIndexerBwdSpec(arch="sm_90a", head_dim=64)
    monkeypatch.setattr(dense_host, "_launch_plan",
                        lambda *a, **k: (spec, _StandInKernel(), 3, DenseIndexerBwdConfig()))
    gen = torch.Generator().manual_seed(9)
    cu_q = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 8, 13], dtype=torch.int32)
    total_q, total_k, h, d, width = 14, 13, 16, 64, 8
    q = torch.randn(total_q, h, d, generator=gen).bfloat16()
    w = torch.randn(total_q, h, generator=gen).bfloat16()
    k = torch.randn(total_k, d, generator=gen).bfloat16()
    off = torch.tensor([2, 0, 5, -1], dtype=torch.int32)
    vis = torch.zeros(total_q, width, dtype=torch.bool)            # the recomputes' masks: segment-local columns
    for b in range(4):
        for r in range(int(cu_q[b]), int(cu_q[b + 1])):
            hi = min(max((int(off[b]) + r - int(cu_q[b]) + 1) // 2, 0), int(cu_k[b + 1] - cu_k[b]))
            vis[r, :hi] = True
    attn = torch.rand(total_q, width, generator=gen).masked_fill(~vis, -math.inf)
    index = torch.randn(total_q, width, generator=gen).masked_fill(~vis, -math.inf)
    norm = torch.where(vis, attn, 0.0).sum(-1)                     # the L1 norms the attention recompute returns
    lse = torch.logsumexp(index, dim=-1)
    kw = dict(grad_loss=torch.tensor(1.3), sm_scale=0.4, loss_coeff=0.7, ratio=2, q_causal_offsets=off,
              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got = dense_host.dense_indexer_backward(q, w, k, attn, norm, index, lse, **kw)
    want = dsagen.dense_indexer_backward(q, w, k, attn, norm, index, lse, impl="reference", **kw)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        assert torch.allclose(g_.float(), w_.float(), rtol=2e-2, atol=2e-2 * max(w_.float().abs().max().item(), 1e-6))
    assert not got[0][12:].any() and not got[1][12:].any() and not got[0][4:9].any()


def test_unsupported_inputs_say_why():
    import torch

    from dsagen.kernels.indexer_bwd import dense_host

    q = torch.zeros(1, 2, 64, 96, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="D=96"):
        dense_host.dense_indexer_backward(q, torch.zeros(1, 2, 64), torch.zeros(1, 3, 96, dtype=torch.bfloat16),
                                          torch.zeros(1, 2, 3), torch.ones(1, 2), torch.zeros(1, 2, 3),
                                          torch.zeros(1, 2))


def test_kl_path_composition_on_the_cpu_with_reference_stand_ins(monkeypatch):
    """kl_host's blocking (whole-row blocks, offsets shifted by the block's first row, loss_coeff scaled to the
    block, d_index_k summed over blocks) with its three launches stood in by the references of the ops they
    compute, against the reference dense_indexer_kl_backward: B 2, ratio 2, offsets, blocks of 3 rows; and the same
    batch packed as THD segments (with an empty one between them)."""
    import torch

    import dsagen
    from dsagen.kernels.attn_score_recompute import dense_host as attn_host
    from dsagen.kernels.indexer_bwd import dense_host as bwd_host
    from dsagen.kernels.indexer_bwd import kl_host
    from dsagen.kernels.lightning_indexer import scores_host

    def scores(iq, ik, w, *, ratio, q_causal_offsets, scale, **_):
        return tuple(dsagen.dense_indexer_score_recompute(iq, ik, w, sm_scale=scale, ratio=ratio,
                                                          q_causal_offsets=q_causal_offsets, impl="reference"))

    def attn(q, k, lse, scale, *, ratio, q_causal_offsets):
        return tuple(dsagen.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio,
                                                       q_causal_offsets=q_causal_offsets, impl="reference"))

    def bwd(iq, w, ik, attn, l1, logits, lse_i, **kw):      # the kernel's contract: gradients and the block's KL
        grads = dsagen.dense_indexer_backward(iq, w, ik, attn, l1, logits, lse_i, impl="reference", **kw)
        tgt = torch.where(torch.isneginf(attn), 0.0, attn) / torch.where(l1 > 0, l1, math.inf)[..., None]
        pos = tgt > 0
        kl = torch.where(pos, tgt * (torch.log(torch.where(pos, tgt, 1.0)) - (logits - lse_i[..., None])), 0.0)
        return grads[0], grads[1], grads[2].double(), kl.sum()

    monkeypatch.setattr(scores_host, "indexer_scores", scores)
    monkeypatch.setattr(attn_host, "dense_attn_score_recompute", attn)
    monkeypatch.setattr(bwd_host, "kl_block_backward", bwd)
    for host in (attn_host, bwd_host):                 # the stand-ins take FP64 and any D
        monkeypatch.setattr(host, "supported_reason", lambda *_: "")
    gen = torch.Generator().manual_seed(8)
    b, s_q, s_k, h, d, h_i, d_i = 2, 7, 9, 4, 16, 4, 8
    q = torch.randn(b, s_q, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s_k, d, generator=gen, dtype=torch.float64)
    iq = torch.randn(b, s_q, h_i, d_i, generator=gen, dtype=torch.float64)
    w = torch.randn(b, s_q, h_i, generator=gen, dtype=torch.float64)
    ik = torch.randn(b, s_k, d_i, generator=gen, dtype=torch.float64)
    off = torch.tensor([-2, 3], dtype=torch.int32)
    scale = d ** -0.5
    vis = torch.stack([torch.arange(s_k)[None, :] < torch.clamp((int(o) + torch.arange(s_q) + 1) // 2, 0, s_k)[:, None]
                       for o in off])
    sc = torch.einsum("bthd,bsd->bths", q, k) * scale
    lse = torch.logsumexp(sc.masked_fill(~vis[:, :, None, :], -math.inf), dim=-1)
    kw = dict(softmax_scale=scale, sm_scale=0.6, loss_coeff=0.8, grad_loss=torch.tensor(1.5, dtype=torch.float64),
              ratio=2, q_causal_offsets=off)
    got = kl_host.dense_indexer_kl_backward(q, k, lse, iq, w, ik, scratch_bytes=2 * 4 * s_k * 3, **kw)
    want = dsagen.dense_indexer_kl_backward(q, k, lse, iq, w, ik, impl="reference", **kw)
    assert kl_host.block_rows(s_q, s_k, 2 * 4 * s_k * 3) == 3
    for g_, w_ in zip(got, want):
        assert torch.allclose(g_.double(), w_.double(), rtol=1e-6, atol=1e-9), (g_, w_)
    # THD: the same two batch elements as segments 0 and 2 around an empty one: the same loss and gradients
    thd = dict(kw, q_causal_offsets=torch.tensor([-2, 0, 3], dtype=torch.int32),
               cu_seqlens_q=torch.tensor([0, 7, 7, 14], dtype=torch.int32),
               cu_seqlens_k=torch.tensor([0, 9, 9, 18], dtype=torch.int32))
    flat = [t.flatten(0, 1) for t in (q, k, lse, iq, w, ik)]
    packed = kl_host.dense_indexer_kl_backward(*flat, scratch_bytes=2 * 4 * s_k * 3, **thd)
    want_thd = dsagen.dense_indexer_kl_backward(*flat, impl="reference", **thd)
    whole = kl_host.dense_indexer_kl_backward(*flat, **thd)        # one block per segment: outputs as returned
    for g_, w_, b_, o_ in zip(packed, want_thd, got, whole):
        assert torch.allclose(g_.double(), w_.double(), rtol=1e-6, atol=1e-9)
        assert torch.allclose(g_.double(), b_.double().reshape(g_.shape), rtol=1e-6, atol=1e-9)
        assert o_.shape == w_.shape and torch.allclose(o_.double(), w_.double(), rtol=1e-6, atol=1e-9)


def test_kl_path_refuses_inputs_outside_the_kernels_before_any_launch(monkeypatch):
    """kl_host names the limit (attention D, indexer H) and launches nothing: no stand-in is ever called."""
    import pytest
    import torch

    from dsagen.kernels.attn_score_recompute import dense_host as attn_host
    from dsagen.kernels.indexer_bwd import kl_host
    from dsagen.kernels.lightning_indexer import scores_host

    def never(*_, **__):
        raise AssertionError("launched")

    monkeypatch.setattr(scores_host, "indexer_scores", never)
    monkeypatch.setattr(attn_host, "dense_attn_score_recompute", never)
    bf = dict(dtype=torch.bfloat16)
    q, k, lse = torch.zeros(1, 4, 64, 256, **bf), torch.zeros(1, 4, 256, **bf), torch.zeros(1, 4, 64)
    iq, w, ik = torch.zeros(1, 4, 64, 128, **bf), torch.zeros(1, 4, 64, **bf), torch.zeros(1, 4, 128, **bf)
    with pytest.raises(NotImplementedError, match="D=256"):
        kl_host.dense_indexer_kl_backward(q, k, lse, iq, w, ik, softmax_scale=0.1)
    q, k = torch.zeros(1, 4, 64, 576, **bf), torch.zeros(1, 4, 576, **bf)
    iq, w = torch.zeros(1, 4, 96, 128, **bf), torch.zeros(1, 4, 96, **bf)
    with pytest.raises(NotImplementedError, match="H=96"):
        kl_host.dense_indexer_kl_backward(q, k, lse, iq, w, ik, softmax_scale=0.1)
