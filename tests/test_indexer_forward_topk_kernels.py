"""CPU tests of the fused indexer_forward_topk: its config (the dense_scores score kernel, the forward top-k plan, the
softmax pass), the slab bound, the forward top-k and softmax kernels' ABI and renders, the op's argument checks, and
(marked `compile`) cross-compilation for sm_90a with SASS checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsagen
from dsagen.jit.render import render
from dsagen.kernels.lightning_indexer.forward_topk_host import MAX_TOPK, check_supported, scratch_bytes, slab_shape
from dsagen.kernels.lightning_indexer.spec import (IndexerTopkSoftmaxSpec, IndexerTopkSpec, config_for,
                                                   forward_topk_config_for, scores_config_for)
from dsagen.spec import SpecError

ARCH = "sm_90a"


def test_config_is_the_lightning_pipeline_in_forward_form():
    cfg = forward_topk_config_for(64, 128, "bfloat16", ARCH)
    li = config_for(64, 128, "bfloat16", ARCH)
    assert cfg.score == scores_config_for(64, 128, "bfloat16", ARCH).score       # dense_scores form
    assert [(s.forward_topk, s.softmax) for s in cfg.topk.specs()] == [(True, True)] * len(li.topk.specs())
    assert [(s.threads, s.sample) for s in cfg.topk.specs()] == [(s.threads, s.sample) for s in li.topk.specs()]
    assert cfg.softmax is None                                                  # the top-k kernels finish the rows
    assert cfg.specs() == (cfg.score, *cfg.topk.specs())
    sep = forward_topk_config_for(64, 128, "bfloat16", ARCH, finish_in_topk=False)
    assert [s.softmax for s in sep.topk.specs()] == [False] * len(li.topk.specs())
    assert sep.softmax == IndexerTopkSoftmaxSpec(arch=ARCH, threads=256)
    assert sep.specs() == (sep.score, *sep.topk.specs(), sep.softmax)
    with pytest.raises(ValueError, match="finish their rows"):
        dataclasses.replace(cfg, softmax=sep.softmax)
    with pytest.raises(ValueError, match="finish their rows"):
        dataclasses.replace(sep, softmax=None)
    assert (cfg.chunk_rows, cfg.slab_bytes, cfg.slab_max_rows) == (li.chunk_rows, li.slab_bytes, 4096)
    fp8 = forward_topk_config_for(64, 128, "float8_e4m3fn", ARCH)
    assert fp8.score.dtype == "float8_e4m3fn" and fp8.topk == cfg.topk        # the top-k reads FP32 scores


def test_scratch_is_bounded_by_the_slab_cap():
    cfg = forward_topk_config_for(64, 128, "bfloat16", ARCH)
    assert scratch_bytes(64, 32768, 32768) == 128 * 2 ** 20                    # 1024 rows x 32768
    assert scratch_bytes(64, 131072, 131072) == 128 * 2 ** 20                  # 256 rows
    assert scratch_bytes(64, 4096, 4096) == 4 * 4096 * 4096                    # the 4096-row cap: 64 MiB
    assert scratch_bytes(64, 8192, 8192) == 128 * 2 ** 20                      # 4096 rows
    assert slab_shape(64, 4097, 10, cfg) == (10, 4100)                         # ld rounded to 4; no more rows than the call
    assert slab_shape(64, 5, 3, cfg) == (4, 8)                                 # whole token blocks (2 tokens at H 64)
    # the cap in rows of 2**20 candidates (H = 8: token blocks of 16 rows)
    assert slab_shape(8, 2 ** 20, 2 ** 20, forward_topk_config_for(8, 128, "bfloat16", ARCH)) == (32, 2 ** 20)


def test_forward_topk_spec_and_renders():
    spec = IndexerTopkSpec(arch=ARCH, threads=512, sample=True, forward_topk=True)
    assert spec.can_implement() == (True, "")
    assert spec.name() == "lightning_indexer_topk_sample1_forward_topk1_sm_90a"
    src = render(spec)
    assert "FORWARD_TOPK = True" in src and "CAP = " in src and "SOFTMAX = False" in src
    soft = IndexerTopkSpec(arch=ARCH, threads=128, forward_topk=True, softmax=True)
    assert soft.can_implement() == (True, "") and "SOFTMAX = True" in render(soft)
    assert soft.name() == "lightning_indexer_topk_t128_forward_topk1_softmax1_sm_90a"
    assert "forward_topk=True" in IndexerTopkSpec(arch=ARCH, softmax=True).can_implement()[1]
    src = render(IndexerTopkSoftmaxSpec(arch=ARCH, threads=128))
    assert "THREADS = 128\n" in src and "topk_softmax_sm90 import build" in src
    for bad in (32, 100, 2048):
        with pytest.raises(SpecError, match="threads"):
            IndexerTopkSoftmaxSpec(arch=ARCH, threads=bad).check()
    with pytest.raises(SpecError, match="sm_90a only"):
        IndexerTopkSoftmaxSpec(arch="sm_100a").check()


def test_forward_topk_kernel_abi():
    """The forward form: the slab kernel's params with values after out, q_off after cu_k, has_off instead of causal."""
    from dsagen.kernels.lightning_indexer import topk_sm90

    slab, fwd = [p["name"] for p in topk_sm90.params(False)], [p["name"] for p in topk_sm90.params(True)]
    assert fwd == ["slab", "out", "values", "cu_q", "cu_k", "q_off", "n_docs", "T", "S", "n_tblk", "blk0", "qc",
                   "nrows", "topk", "ratio", "has_off", "ld_slab"]
    assert set(slab) - set(fwd) == {"causal"}
    soft = [p["name"] for p in topk_sm90.params(True, softmax=True)]
    assert soft == fwd + ["softmax", "lse", "want_soft", "want_lse", "global_ids"]


def test_check_supported_names_the_limit():
    q = torch.empty(1, 4, 64, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 5, 128, dtype=torch.bfloat16)
    w = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    check_supported(q, k, w, MAX_TOPK, False)
    with pytest.raises(ValueError, match="top_k <= 2\\*\\*20"):
        check_supported(q, k, w, MAX_TOPK + 1, False)
    with pytest.raises(ValueError, match="heads H in"):
        check_supported(torch.empty(1, 4, 12, 128, dtype=torch.bfloat16), k, torch.empty(1, 4, 12,
                                                                                          dtype=torch.bfloat16), 4,
                        False)


def test_op_arguments():
    q, k, w = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 16), torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="impl='fused' runs generated CUDA kernels"):
        dsagen.indexer_forward_topk(q, k, w, 2)
    with pytest.raises(TypeError, match="deterministic"):
        dsagen.indexer_forward_topk(q, k, w, 2, deterministic=1, impl="reference")
    with pytest.raises(ValueError, match="q_scale"):
        dsagen.indexer_forward_topk(q, k, w, 2, precision="fp8", impl="reference")
    a = dsagen.indexer_forward_topk(q, k, w, 3, return_lse=True, impl="reference")
    b = dsagen.indexer_forward_topk(q, k, w, 3, return_lse=True, impl="reference", deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fp8_reference_equals_the_dequantized_call():
    gen = torch.Generator().manual_seed(0)
    q8 = (torch.randn(2, 9, 4, 128, generator=gen) * 4).to(torch.float8_e4m3fn)
    k8 = (torch.randn(2, 7, 128, generator=gen) * 4).to(torch.float8_e4m3fn)
    w = torch.randn(2, 9, 4, generator=gen)
    qs, ks = torch.rand(2, 9, 4, generator=gen) + 0.1, torch.rand(2, 7, generator=gen) + 0.1
    got = dsagen.indexer_forward_topk(q8, k8, w, 5, ratio=1, return_lse=True, impl="reference", precision="fp8",
                                      q_scale=qs, k_scale=ks)
    want = dsagen.indexer_forward_topk(q8.float() * qs[..., None], k8.float() * ks[..., None], w, 5, ratio=1,
                                       return_lse=True, impl="reference")
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def _sass(cubin: bytes) -> str:
    from dsagen.jit.sass import disassemble, find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return disassemble(cubin)


@pytest.mark.compile
def test_forward_kernels_compile(tmp_path):
    """Every forward top-k kernel (both forms: finishing their rows, or not) and the softmax pass: no subroutine
    calls, the top-k's block size and barriers; the 128- and 1024-thread top-k and the softmax pass without spills;
    the finishing forms compute exponentials (MUFU)."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import opcode_counts

    cfg = forward_topk_config_for(64, 128, "bfloat16", ARCH)
    sep = forward_topk_config_for(64, 128, "bfloat16", ARCH, finish_in_topk=False)
    for i, spec in enumerate((*cfg.topk.specs(), *sep.topk.specs(), sep.softmax)):
        ck = compile_module(spec, render(spec), tmp_path / f"b{i}")
        sass = _sass(ck.cubin)
        ops = dict(opcode_counts(sass))
        assert not ops.get("CALL"), (spec.name(), ops)
        if isinstance(spec, IndexerTopkSpec):
            assert ck.record["launch"]["block"] == [spec.threads, 1, 1]
            spills = ops.get("LDL", 0) + ops.get("STL", 0)
            if not spec.sample and not spec.softmax:
                assert not spills, (spec.name(), ops)
            elif not spec.sample:
                # the finishing form at 128 threads (64 registers) keeps a few row values in local memory across
                # the selection: spill code in its prologue and finish, once per row (7 instructions, 2026-12-04)
                assert spills <= 8, (spec.name(), ops)
            assert ("MUFU.EX2" in sass) == spec.softmax, spec.name()
        else:
            assert not ops.get("LDL") and not ops.get("STL") and ops.get("MUFU", 0) > 0, ops


def test_input_views_and_fp8_args():
    """The score kernel's views: BSHD as given (k without its head dim), THD as B = 1, FP8 as uint8, all views of the
    same storage; the FP8 form's trailing arguments carry the descales' pointers and strides (score_sm90.fp8_params
    order), the same with flags computed once for the signature."""
    from dsagen.kernels.lightning_indexer.scores_host import fp8_args, fp8_flags, input_views

    q, k4, w = torch.randn(2, 5, 8, 64), torch.randn(2, 7, 1, 64), torch.randn(2, 5, 8)
    q4, k3, w3, qs3, ks2 = input_views(q, k4, w, None, None, packed=False)
    assert q4 is q and k3.shape == (2, 7, 64) and k3.data_ptr() == k4.data_ptr() and w3 is w
    assert qs3 is None and ks2 is None
    qt, kt, wt = torch.randn(9, 8, 64), torch.randn(6, 1, 64), torch.randn(9, 8)
    q4, k3, w3, qs3, ks2 = input_views(qt, kt, wt, None, None, packed=True)
    assert (q4.shape, k3.shape, w3.shape) == ((1, 9, 8, 64), (1, 6, 64), (1, 9, 8)) and qs3 is None and ks2 is None
    q8, k8 = qt.to(torch.float8_e4m3fn), kt[:, 0].to(torch.float8_e4m3fn)
    qs, ks = torch.rand(9, 8), torch.rand(6)
    q4, k3, w3, qs3, ks2 = input_views(q8, k8, wt, qs, ks, packed=True)
    assert q4.dtype == k3.dtype == torch.uint8 and q4.shape == (1, 9, 8, 64) and q4.data_ptr() == q8.data_ptr()
    extra = fp8_args(w3, qs3, ks2)
    assert extra[0] is w3 and extra[1] == 1                                  # fp32 weights: read through w32
    assert extra[2].shape == (1, 9, 8) and extra[3:6] == (72, 8, 1) and extra[6].shape == (1, 6)
    assert extra[7:] == (6, 1)
    assert fp8_args(w3, qs3, ks2, fp8_flags(w3, qs3, ks2)) == extra


def test_eager_calls_skip_the_custom_op_only_for_real_cuda_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsagen.kernels.lightning_indexer.scores_host import eager

    assert not eager(torch.empty(2))                                         # CPU: never the host loop
    with FakeTensorMode() as mode:
        assert not eager(mode.from_tensor(torch.empty(2)))


def test_loaded_kernels_memoizes_and_checks_the_config(monkeypatch):
    """The family's kernel loader: one load per (device, H, D, dtype) or per given config, NotImplementedError naming
    the op off sm_90a, ValueError for a config whose score kernel is of another shape."""
    from dsagen.kernels.lightning_indexer import host

    arch = {"now": "sm_90a"}
    monkeypatch.setattr(host, "device_index", lambda device: 0)
    monkeypatch.setattr(host, "device_arch", lambda index: arch["now"])
    loads, cache = [], {}

    def load(cfg, index):
        loads.append((cfg, index))
        return ("kernels", cfg)

    args = ("indexer_forward_topk", "cuda", 64, 128, torch.bfloat16, "bfloat16")
    got = host.loaded_kernels(cache, *args, None, forward_topk_config_for, load)
    assert got == ("kernels", forward_topk_config_for(64, 128, "bfloat16", ARCH))
    assert host.loaded_kernels(cache, *args, None, forward_topk_config_for, load) is got and len(loads) == 1
    other = forward_topk_config_for(64, 128, "float16", ARCH)
    with pytest.raises(ValueError, match="does not match the call"):
        host.loaded_kernels(cache, *args, other, forward_topk_config_for, load)
    arch["now"] = "sm_100a"
    with pytest.raises(NotImplementedError, match="the fused indexer_forward_topk has kernels for sm_90a"):
        host.loaded_kernels({}, *args, None, forward_topk_config_for, load)
