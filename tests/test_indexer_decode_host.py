"""CPU tests of the fused decode-time indexer's host (dsagen/kernels/lightning_indexer/decode_host.py): the views of
the paged FP8 cache the score kernel reads (values and descales where quantize_index_k_fp8 put them), the page
encoding of the selected positions, the limits, the paged spec and its place in the model's kernels, and the launch
plumbing with stand-in kernels (the paged score kernel gets the block table, its stride and the page count)."""

from __future__ import annotations

import pytest
import torch

from dsagen.kernels.lightning_indexer import decode_host
from dsagen.kernels.lightning_indexer.spec import IndexerScoreSpec, decode_config_for, forward_topk_config_for
from dsagen.reference.kv_cache import dequantize_index_k_fp8, quantize_index_k_fp8
from dsagen.spec import SpecError, get_preset


def test_fp8_views_are_the_caches_values_and_scales():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 64, 128, generator=g)
    cache = quantize_index_k_fp8(k)                                      # [5, 64, 1, 132] uint8
    q = torch.zeros(2, 1, 64, 128).to(torch.float8_e4m3fn)
    kv, w, q_scale, k_scale = decode_host._paged_inputs(q, torch.ones(2, 1, 64), cache)
    assert kv.shape == (5, 64, 128) and kv.dtype == torch.float8_e4m3fn and k_scale.shape == (5, 64)
    assert kv.stride() == (64 * 132, 128, 1) and k_scale.stride() == (64 * 132 // 4, 1)
    assert kv.data_ptr() == cache.data_ptr() and k_scale.data_ptr() == cache.data_ptr() + 64 * 128
    torch.testing.assert_close(kv.float() * k_scale[..., None], dequantize_index_k_fp8(cache), rtol=0, atol=0)
    assert q_scale.eq(1).all() and q_scale.shape == (2, 1, 64) and w.dtype == torch.float32
    bf = torch.zeros(2, 1, 64, 128, dtype=torch.bfloat16)
    kv, w, q_scale, k_scale = decode_host._paged_inputs(bf, torch.ones(2, 1, 64), k.bfloat16())
    assert w.dtype == torch.bfloat16 and q_scale is None and k_scale is None and kv.shape == (5, 64, 128)


def test_page_encoding():
    table = torch.tensor([[7, 2, 9], [4, 0, 1]], dtype=torch.int32)
    ids = torch.tensor([[[0, 63, 64, 130, -1]], [[65, 5, -1, -1, 191]]], dtype=torch.int32)
    want = torch.tensor([[[7 * 64, 7 * 64 + 63, 2 * 64, 9 * 64 + 2, -1]], [[0 * 64 + 1, 4 * 64 + 5, -1, -1, 64 + 63]]],
                        dtype=torch.int32)
    got = decode_host.page_encode(ids, table)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_limits_name_the_argument():
    q = torch.zeros(2, 1, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pages of 64 tokens"):
        decode_host.check_decode_supported(q, torch.zeros(3, 32, 128, dtype=torch.bfloat16),
                                           torch.zeros(2, 4, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="pages per sequence"):
        decode_host.check_decode_supported(q, torch.zeros(3, 64, 128, dtype=torch.bfloat16),
                                           torch.zeros(2, 2**14 + 1, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="heads H"):
        decode_host.check_decode_supported(torch.zeros(2, 1, 6, 128, dtype=torch.bfloat16),
                                           torch.zeros(3, 64, 128, dtype=torch.bfloat16),
                                           torch.zeros(2, 4, dtype=torch.int32), 16)
    decode_host.check_decode_supported(q, torch.zeros(3, 64, 128, dtype=torch.bfloat16),
                                       torch.zeros(2, 4, dtype=torch.int32), 16)


def test_paged_spec():
    with pytest.raises(SpecError, match="paged=True needs dense_scores=True"):
        IndexerScoreSpec(arch="sm_90a", paged=True).check()
    cfg = decode_config_for(64, 128, "float8_e4m3fn", "sm_90a")
    base = forward_topk_config_for(64, 128, "float8_e4m3fn", "sm_90a")
    assert cfg.score.paged and cfg.topk == base.topk and cfg.score.name() != base.score.name()
    names = {s.name() for s in get_preset("deepseek-v3.2", "sm_90a", serving=True)}
    assert {s.name() for s in cfg.specs()} <= names


def test_launch_plumbing(monkeypatch):
    """run(): the paged score kernel gets q, the page view, the weights, the slab, the causal offsets
    cache_seqlens - next_n, and after the FP8 params the block table, its row stride and the page count; the
    top-k kernel writes positions that come back page-encoded."""
    from dsagen.kernels.lightning_indexer import forward_topk_host as fth
    from dsagen.kernels.lightning_indexer import scores_host

    launches = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def launch(self, *args):
            launches.append((self.name, args))
            if self.name == "topk":
                args[1].copy_(torch.tensor([[0, 70, -1, -1]], dtype=torch.int32).expand_as(args[1]))

    class Kernels:
        def __init__(self, config):
            self.config, self.score, self.softmax = config, Kernel("score"), None

        def topk_for(self, longest, rows, num_sms):
            return Kernel("topk")

    monkeypatch.setattr(fth, "_kernels_for", lambda device, h, d, dtype, config=None: Kernels(config))
    monkeypatch.setattr(fth, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(fth, "device_index", lambda device: 0)
    monkeypatch.setattr(scores_host, "dummy_offsets", lambda device: torch.zeros(4, dtype=torch.int32))
    g = torch.Generator().manual_seed(1)
    cache = quantize_index_k_fp8(torch.randn(6, 64, 128, generator=g))
    q = torch.randn(2, 1, 64, 128, generator=g).to(torch.float8_e4m3fn)
    table = torch.tensor([[3, 5], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([100, 7], dtype=torch.int32)
    ids = decode_host.run(q, torch.rand(2, 1, 64, generator=g), cache, table, lens, 4)
    score = [a for n, a in launches if n == "score"][0]
    assert score[-3] is table and score[-2:] == (2, 6) and score[1].data_ptr() == cache.data_ptr()
    q_off = [a for a in score if isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.shape == (2,)]
    assert any(torch.equal(t, lens - 1) for t in q_off)
    assert torch.equal(ids, torch.tensor([[[3 * 64, 5 * 64 + 6, -1, -1]], [[64, 0 * 64 + 6, -1, -1]]],
                                         dtype=torch.int32))
