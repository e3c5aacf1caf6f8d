"""CPU tests of the sparse indexer score recompute family (dsagen/kernels/indexer_score_recompute): spec checks, the
binding, the compiled kernels' SASS (wgmma for S, the gather, no local memory), and the host path with a stand-in
kernel against the reference op."""

from __future__ import annotations

import math
import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.indexer_score_recompute.spec import (IndexerScoreRecomputeConfig, IndexerScoreRecomputeSpec,
                                                         config_for, kernel_heads)
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=32), "num_heads=32 must be 64 or 128"),
    (dict(head_dim=96), "head_dim=96 must be 64 or 128"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(stages=1), "stages=1 must be in 2..8"),
    (dict(ctas_per_sm=5), "ctas_per_sm=5 must be one of 1, 2, 3, 4"),
    (dict(num_heads=128, stages=8), "do not fit an SM"),
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(prefetch_ids="yes"), 'field prefetch_ids must be a bool, got "yes"'),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        IndexerScoreRecomputeSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_binding():
    cfg = config_for(64, 128, "bfloat16", "sm_90a", 132)
    assert cfg == IndexerScoreRecomputeConfig(stages=2, ctas_per_sm=3, prefetch_ids=True) and cfg.n_ctas(132) == 396
    assert config_for(128, 128, "bfloat16", "sm_90a", 132) == IndexerScoreRecomputeConfig()
    assert IndexerScoreRecomputeConfig().n_ctas(132) == 264 and IndexerScoreRecomputeConfig(grid=5).n_ctas(132) == 5
    assert cfg.spec(64, 128, "bfloat16") == IndexerScoreRecomputeSpec(arch="sm_90a", stages=2, ctas_per_sm=3,
                                                                      prefetch_ids=True)
    assert cfg.spec(64, 128, "bfloat16").check().smem_bytes() * 3 <= 228 * 1024
    assert [kernel_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="grid=0"):
        IndexerScoreRecomputeConfig(grid=0)
    src = render(IndexerScoreRecomputeSpec(arch="sm_90a", num_heads=128, head_dim=64, dtype="float16"))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.indexer_score_recompute.recompute_sm90 import build" in src
    assert len(src.split("SYMBOL = ")[1].splitlines()) <= 12
    assert "dsagen.kernels.indexer_score_recompute.recompute_sm90" in helper_modules(src)
    assert "dsagen.kernels.common.sm90.gather" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("h,d", [(64, 128), (128, 64)])
def test_compiles_to_wgmma(h, d, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = IndexerScoreRecomputeSpec(arch="sm_90a", num_heads=h, head_dim=d)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1]
    assert spec.ctas_per_sm * ck.record["launch"]["smem"] <= 227 * 1024
    assert ck.record["regcount"] <= 65536 // (256 * spec.ctas_per_sm)        # two CTAs stay resident per SM
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    # one chain of D / 16 wgmmas per tile: 64 gathered slots x H heads
    assert len(re.findall(rf"HGMMA\.64x{h}x16\.F32\.BF16 ", sass)) == d // 16
    assert re.search(r"LDGSTS\.E\.BYPASS(\.\w+)*\.128", sass)                  # 16-byte cp.async gathers
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1, 0x80", sass)) == 1  # the row statistics, one place
    assert not re.search(r"\b(LDL|STL)\b", sass)                               # no register spills


@pytest.mark.compile
@pytest.mark.parametrize("prefetch", [False, True])
def test_producer_id_loads(prefetch, tmp_path):
    """The producer's per-tile id loads (4 rows per thread) are issued before its wait for a free stage (the SYNCS
    try-wait that precedes the tile's cp.async gathers). With prefetch_ids nothing reads them before that wait, so
    they stay in flight while it waits (they are the next tile's ids); without it the tile's own ids are range-checked
    right after their loads, which stalls on them before the wait."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = IndexerScoreRecomputeSpec(arch="sm_90a", num_heads=64, stages=2, ctas_per_sm=3, prefetch_ids=prefetch)
    ck = compile_module(spec, render(spec), tmp_path)
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    ops = [op.strip() for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", disassemble(ck.cubin))]
    gather = next(i for i, op in enumerate(ops) if re.search(r"LDGSTS.*, P\d$", op))    # the loop's first gather
    wait = max(i for i in range(gather) if "SYNCS.PHASECHK.TRANS64.TRYWAIT" in ops[i])
    loads = [i for i in range(wait) if re.match(r"@!?P\d LDG\.E R\d+, ", ops[i])][-4:]
    assert len(loads) == 4
    dests = {re.match(r"@!?P\d LDG\.E (R\d+),", ops[i]).group(1) for i in loads}
    read_before_wait = any(re.search(rf"\b{r}\b", op.split(",", 1)[1]) for op in ops[loads[0] + 1:wait]
                           if "," in op for r in dests)
    assert read_before_wait is not prefetch


class _StandInKernel:
    """The kernel's contract in torch: out[t, j] = softmax over the row's valid slots of the log2-domain logits
    sum_h w'[t, h] relu(q[t, h] . k[id]) (w' = weights x sm_scale x log2 e), 0 elsewhere."""

    def __init__(self):
        self.calls = []

    def launch(self, q, keys, ids, length, w, out, rows, n_k, topk, ld_q, ld_k, ld_idx, has_length, n_ctas):
        import torch

        self.calls.append(dict(heads=q.shape[1], ids=ids.clone(), w=w.clone()))
        valid = (ids >= 0) & (ids < n_k)
        if has_length:
            valid &= torch.arange(topk).view(1, -1) < length.view(-1, 1)
        rows_k = keys.float()[ids.clamp(0, n_k - 1).long()]                      # (rows, topk, D)
        dots = torch.einsum("rhd,rkd->rhk", q.float(), rows_k).relu()
        logit2 = torch.einsum("rh,rhk->rk", w, dots)
        x = torch.where(valid, logit2, float("-inf"))
        m = x.max(-1, keepdim=True).values
        p = torch.where(valid, torch.exp2(x - torch.where(valid.any(-1, keepdim=True), m, 0.0)), 0.0)
        s = p.sum(-1, keepdim=True)
        out.copy_(torch.where(s > 0, p / torch.where(s > 0, s, 1.0), 0.0))


@pytest.mark.parametrize("global_ids", [False, True])
def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch, global_ids):
    """The host's batch flattening (local ids range-checked per batch), head padding (weight 0) and the weights'
    scale, with a stand-in for the kernel, against the reference op."""
    import torch

    import dsagen
    from dsagen.kernels.indexer_score_recompute import host as isr_host

    kernel = _StandInKernel()
    spec = IndexerScoreRecomputeSpec(arch="sm_90a", num_heads=64, head_dim=128)
    monkeypatch.setattr(isr_host, "_launch_plan", lambda *a, **k: (spec, kernel, 3))
    gen = torch.Generator().manual_seed(3)
    b, s_q, h, d, s_k, k = 2, 3, 16, 128, 9, 6
    q = torch.randn(b, s_q, h, d, generator=gen).bfloat16()
    kk = torch.randn(b, s_k, d, generator=gen).bfloat16()
    w = torch.randn(b, s_q, h, generator=gen).bfloat16()
    ids = torch.randint(-2, s_k + 2, (b, s_q, k), generator=gen, dtype=torch.int32)
    if global_ids:
        ids = torch.where((ids >= 0) & (ids < s_k), ids + torch.arange(b, dtype=torch.int32).view(b, 1, 1) * s_k,
                          ids)
    length = torch.tensor([[6, 2, 0], [5, 6, 1]], dtype=torch.int32)
    kw = dict(topk_length=length, topk_indices_global=global_ids, sm_scale=0.3)
    got = isr_host.run(q, kk, w, ids, length, global_ids, 0.3, IndexerScoreRecomputeConfig())
    want = dsagen.sparse_indexer_score_recompute(q, kk, w, ids, **kw, impl="reference")
    assert got.shape == (b, s_q, k) and got.dtype == torch.float32
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert (got[0, 2] == 0).all()                                               # topk_length 0
    call = kernel.calls[0]
    assert call["heads"] == 64 and (call["w"][:, h:] == 0).all()                # padded heads weigh nothing
    assert torch.allclose(call["w"][:, :h], w.float().view(b * s_q, h) * 0.3 * math.log2(math.e))
    # ids of another batch never alias: each flat id lies in its own batch's rows or is -1
    flat = call["ids"].view(b, s_q, k)
    for bi in range(b):
        ok = flat[bi] >= 0
        assert ((flat[bi][ok] >= bi * s_k) & (flat[bi][ok] < (bi + 1) * s_k)).all()


def test_fused_refuses_what_it_does_not_cover():
    import torch

    from dsagen.kernels.indexer_score_recompute.host import supported_reason

    q = torch.zeros(1, 2, 64, 96, dtype=torch.bfloat16)
    assert "D=96" in supported_reason(q, torch.zeros(1, 3, 96, dtype=torch.bfloat16), torch.zeros(1, 2, 64))
    q = torch.zeros(1, 2, 64, 128)
    assert "float32" in supported_reason(q, torch.zeros(1, 3, 128), torch.zeros(1, 2, 64))
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert "k_indexer has dtype torch.float16" in supported_reason(q, torch.zeros(1, 3, 128, dtype=torch.float16),
                                                                 torch.zeros(1, 2, 64))
    assert supported_reason(q, torch.zeros(1, 3, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 64)) == ""


def test_the_custom_op_and_its_fake(monkeypatch):
    """torch.library.opcheck of dsagen::sparse_indexer_score_recompute_fused (schema, fake tensor, AOT dispatch) on
    the CPU, the kernel a stand-in: the fake's output matches the op's."""
    import torch

    from dsagen.kernels.indexer_score_recompute import host as isr_host

    spec = IndexerScoreRecomputeSpec(arch="sm_90a", num_heads=64, head_dim=128)
    monkeypatch.setattr(isr_host, "_launch_plan", lambda *a, **k: (spec, _StandInKernel(), 3))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 16, 128, generator=gen).bfloat16()
    k = torch.randn(2, 9, 128, generator=gen).bfloat16()
    w = torch.randn(2, 3, 16, generator=gen).bfloat16()
    ids = torch.randint(-1, 9, (2, 3, 6), generator=gen, dtype=torch.int32)
    for length in (None, torch.tensor([[6, 2, 0], [5, 6, 1]], dtype=torch.int32)):
        torch.library.opcheck(isr_host._fused_op, (q, k, w, ids, length, False, 0.3))


def test_empty_shapes_give_zeros_without_a_launch(monkeypatch):
    import torch

    from dsagen.kernels.indexer_score_recompute import host as isr_host

    monkeypatch.setattr(isr_host, "_launch_plan", lambda *a, **k: pytest.fail("no launch for an empty call"))
    bf = torch.bfloat16
    for b, s_q, s_k, k in ((1, 0, 5, 4), (1, 3, 5, 0), (2, 3, 0, 4)):
        q, w = torch.randn(b, s_q, 64, 128).to(bf), torch.randn(b, s_q, 64).to(bf)
        out = isr_host.run(q, torch.randn(b, s_k, 128).to(bf), w, torch.zeros(b, s_q, k, dtype=torch.int32), None,
                           False, 1.0)
        assert out.shape == (b, s_q, k) and out.dtype == torch.float32 and not out.any()
