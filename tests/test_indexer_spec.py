"""CPU tests of the fused lightning-indexer kernels: spec validation, rendering, the fused module's
option / range checks, and (marked `compile`) cross-compilation for sm_90a with a SASS check."""

from __future__ import annotations


import pytest
import torch

from dsagen.jit.render import render
from dsagen.spec import get_preset
from dsagen.spec.base import SpecError
from dsagen.kernels.lightning_indexer.spec import (INDEXER_HEAD_DIMS, INDEXER_HEADS, INDEXER_TOPK_THREADS, TOPK_COMPACT_CAP,
                                          IndexerConfig, IndexerScoreSpec, IndexerTopkSpec, TopkPlan, config_for)


def test_score_spec_validation_reasons():
    assert IndexerScoreSpec(arch="sm_90a").can_implement() == (True, "")
    ok, why = IndexerScoreSpec(arch="sm_90a", num_heads=12, head_dim=96, dtype="float32").can_implement()
    assert not ok
    assert "num_heads=12" in why and str(INDEXER_HEADS) in why
    assert "head_dim=96" in why and str(INDEXER_HEAD_DIMS) in why
    assert "dtype='float32'" in why
    ok, why = IndexerScoreSpec(arch="sm_100a").can_implement()
    assert not ok and "sm_90a only" in why
    ok, why = IndexerScoreSpec(arch="sm_90a", stages=8).can_implement()
    assert not ok and "shared memory" in why
    assert IndexerScoreSpec(arch="sm_90a").smem_bytes() <= 220 * 1024
    for h in INDEXER_HEADS:
        for d in INDEXER_HEAD_DIMS:
            assert IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d).can_implement() == (True, "")
    with pytest.raises(SpecError):
        IndexerTopkSpec(arch="sm_90a", threads=100).check()


def test_specs_hold_only_what_changes_the_code():
    """topk, causal, ratio and lengths are run-time arguments (one set of kernels serves them all); the spec fields
    are the kernels' code choices only."""
    import dataclasses

    assert {f.name for f in dataclasses.fields(IndexerScoreSpec)} == {"arch", "num_heads", "head_dim", "dtype", "stages",
                                                                    "dense_scores", "consumers", "longest_first",
                                                                    "q_tiles", "paged"}
    assert {f.name for f in dataclasses.fields(IndexerTopkSpec)} == {"arch", "threads", "sample", "forward_topk",
                                                                   "softmax"}
    a = config_for(64, 128, "bfloat16", "sm_90a")
    assert a.score.name() == "lightning_indexer_score_sm_90a"
    assert IndexerScoreSpec(arch="sm_90a", num_heads=8, head_dim=64).name() == "lightning_indexer_score_h8_d64_sm_90a"
    assert config_for(64, 128, "float16", "sm_90a").score.name() == "lightning_indexer_score_float16_sm_90a"


def test_config_is_frozen_and_picked_by_config_for():
    """Every measured choice is one frozen, hashable IndexerConfig from config_for; a variant is a replaced copy."""
    import dataclasses

    cfg = config_for(64, 128, "bfloat16", "sm_90a")
    assert isinstance(cfg, IndexerConfig) and cfg == config_for(64, 128, "bfloat16", "sm_90a")
    assert (cfg.chunk_rows, cfg.slab_bytes, cfg.slab_max_rows, cfg.score.stages) == (4096, 128 * 2 ** 20, 1024, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_rows = 2048
    other = dataclasses.replace(cfg, chunk_rows=8192)
    assert other != cfg and hash(other) != hash(cfg) and cfg.chunk_rows == 4096
    assert cfg.specs() == (cfg.score, *cfg.topk.specs())
    for spec in cfg.specs():
        assert spec.can_implement() == (True, ""), spec.name()
    from dsagen.kernels.lightning_indexer import host as fused

    for name in ("SPEC_OPTIONS", "CHUNK_ROWS", "SLAB_BYTES", "SLAB_MAX_ROWS"):
        assert not hasattr(fused, name), name


def test_preset_contains_indexer_kernels():
    specs = get_preset("deepseek-v3.2", "sm_90a")
    assert set(config_for(64, 128, "bfloat16", "sm_90a").specs()) <= set(specs)
    names = {s.name() for s in specs}
    assert {"lightning_indexer_score_sm_90a", "lightning_indexer_topk_t128_sm_90a",
            "lightning_indexer_topk_sample1_sm_90a", "lightning_indexer_topk_t1024_sample1_sm_90a",
            "lightning_indexer_topk_t1024_sm_90a"} <= names


def test_topk_plan_picks_by_row_length_and_wave():
    """The plan: 128 threads up to 12288 candidates, 512 + sample up to 65536, else 1024 + sample; when the slab's
    rows fit one wave 1024 threads (+ sample beyond 12288). TopkPlan.single: one kernel for every slab."""
    plan = config_for(64, 128, "bfloat16", "sm_90a").topk
    pick = lambda n, rows: (plan.pick(n, rows, 132).threads, plan.pick(n, rows, 132).sample)   # noqa: E731
    assert pick(1, 1024) == pick(12288, 1024) == (128, False)
    assert pick(12289, 1024) == pick(65536, 133) == (512, True)
    assert pick(65537, 1024) == pick(2 ** 20, 133) == (1024, True)
    assert pick(100, 132) == pick(12288, 1) == (1024, False)
    assert pick(12289, 132) == (1024, True)
    assert len(plan.specs()) == 4
    assert {s.threads for s in plan.specs()} == set(INDEXER_TOPK_THREADS)     # every thread count is in the plan
    one = TopkPlan.single(IndexerTopkSpec(arch="sm_90a", threads=512), IndexerTopkSpec(arch="sm_90a", threads=1024))
    assert [s.threads for s in one.specs()] == [512, 1024]
    assert one.pick(10, 1024, 132).threads == 512 and one.pick(10 ** 6, 100, 132).threads == 1024


def test_slab_max_candidates():
    """The longest row a slab can hold: the ratio-causal limit of its last token for causal unpacked input, S
    otherwise (packed documents, non-causal); T - 1's limit when the slab crosses a batch element."""
    from dsagen.kernels.lightning_indexer.host import slab_max_candidates

    # H=64: 2 tokens per block; T=1000 -> 500 blocks per batch element; S = 1000
    assert slab_max_candidates(0, 10, 2, 500, 1000, 1000, True, 1, False) == 20
    assert slab_max_candidates(0, 10, 2, 500, 1000, 250, True, 4, False) == 5
    assert slab_max_candidates(490, 10, 2, 500, 1000, 1000, True, 1, False) == 1000
    assert slab_max_candidates(495, 10, 2, 500, 1000, 1000, True, 1, False) == 1000     # crosses into b=1
    assert slab_max_candidates(500, 10, 2, 500, 1000, 1000, True, 1, False) == 20       # b=1, tokens 0..19
    assert slab_max_candidates(0, 10, 2, 500, 999, 999, True, 1, False) == 20
    assert slab_max_candidates(495, 5, 2, 500, 999, 999, True, 1, False) == 999         # last block: 1 token
    assert slab_max_candidates(0, 10, 2, 500, 1000, 1000, False, 1, False) == 1000
    assert slab_max_candidates(0, 10, 2, 500, 1000, 1000, True, 1, True) == 1000


@pytest.mark.parametrize("h", INDEXER_HEADS)
@pytest.mark.parametrize("d", INDEXER_HEAD_DIMS)
def test_score_template_renders(h, d):
    """The rendered module binds the spec's values to the kernel of dsagen.kernels.lightning_indexer.score_sm90."""
    src = render(IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d))
    assert f"H = {h}\n" in src and f"D = {d}\n" in src and 'DTYPE = "bfloat16"\n' in src and "STAGES = 4\n" in src
    assert 'SYMBOL = "dsagen_lightning_indexer_score' in src
    assert "from dsagen.kernels.lightning_indexer.score_sm90 import build" in src
    assert "DENSE_SCORES = False\n" in src and "LONGEST_FIRST = False\n" in src and "Q_TILES = 1\n" in src
    assert "PAGED = False\n" in src
    assert ("kernel, host, PARAMS, HOST_ARGS, LAUNCH = build(H, D, DTYPE, STAGES, DENSE_SCORES, CONSUMERS, "
            "LONGEST_FIRST,\n                                                Q_TILES, PAGED)") in src


def test_topk_template_renders():
    src = render(IndexerTopkSpec(arch="sm_90a", threads=512))
    assert "THREADS = 512\n" in src and "SAMPLE = False\n" in src
    assert "from dsagen.kernels.lightning_indexer.topk_sm90 import build, params" in src
    assert "FORWARD_TOPK = False" in src and "PARAMS = params(FORWARD_TOPK, SOFTMAX)\n" in src
    assert "kernel, host, LAUNCH = build(THREADS, SAMPLE, CAP, forward=FORWARD_TOPK, softmax=SOFTMAX)" in src
    fwd = render(IndexerTopkSpec(arch="sm_90a", threads=128, forward_topk=True))
    assert "FORWARD_TOPK = True" in fwd and "indexer_forward_topk's form" in fwd


@pytest.mark.parametrize("h,d,dtype,stages", [(64, 128, "bfloat16", 4), (8, 64, "float16", 2), (128, 128, "bfloat16", 3)])
def test_score_kernel_module_declares_the_abi(h, d, dtype, stages):
    """score_sm90.build: the flat ABI (TMA boxes of 64 columns x the token block, the spec's dtype), the host's own
    arguments, a persistent grid of n_ctas CTAs of 512 threads, and the smem of 2 Q tiles + 2 * stages K tiles."""
    from dsagen.kernels.lightning_indexer import score_sm90

    kernel, host, params, host_args, launch = score_sm90.build(h, d, dtype, stages)
    assert [p["name"] for p in params][:2] == ["q_map", "k_map"] and params[-1] == {"name": "scale", "kind": "f32"}
    assert params[0]["encode"]["box"] == [64, h, 128 // h, 1] and params[1]["encode"]["box"] == [64, 64, 1]
    assert {params[0]["encode"]["dtype"], params[2]["dtype"], host_args[0]["dtype"]} == {dtype}
    assert host_args[8:] == params[2:] and launch["grid"][0] == "n_ctas"
    assert launch["block"] == [512, 1, 1]
    assert 2 * 128 * d * 2 + 2 * stages * 64 * d * 2 <= launch["smem"] <= IndexerScoreSpec(
        arch="sm_90a", num_heads=h, head_dim=d, dtype=dtype, stages=stages).smem_bytes()


def test_topk_kernel_module_sizes_smem_by_threads_and_sample():
    """topk_sm90.build: a CTA of `threads` threads per slab row; 1 KiB of histogram per warp, plus CAP (key, id)
    entries with sample."""
    from dsagen.kernels.lightning_indexer import topk_sm90

    for threads in INDEXER_TOPK_THREADS:
        _, _, plain = topk_sm90.build(threads, False, 0)
        assert plain["block"] == [threads, 1, 1] and plain["grid"] == ["nrows", 1, 1]
        assert threads // 32 * 1024 <= plain["smem"] <= threads // 32 * 1024 + 512
        if threads in TOPK_COMPACT_CAP:
            cap = TOPK_COMPACT_CAP[threads]
            _, _, sampled = topk_sm90.build(threads, True, cap)
            assert sampled["smem"] >= plain["smem"] + 8 * cap


def test_fused_backend_option_and_limits():
    from dsagen.kernels.lightning_indexer.host import check_backend, check_supported, score_ctas, slab_rows

    assert check_backend(None) == "cute" and check_backend({"backend": "cute"}) == "cute"
    with pytest.raises(ValueError, match="backend='triton' is not available"):
        check_backend({"backend": "triton"})
    with pytest.raises(ValueError, match="unknown keys"):
        check_backend({"backend": "cute", "tile": 4})
    q = torch.empty((1, 8, 64, 128), dtype=torch.bfloat16)
    k = torch.empty((1, 8, 128), dtype=torch.bfloat16)
    w = torch.empty((1, 8, 64), dtype=torch.bfloat16)
    check_supported(q, k, w, 2048)
    with pytest.raises(ValueError, match=r"H \(heads\) in \(8, 16, 32, 64, 128\)"):
        check_supported(torch.empty((1, 8, 12, 128), dtype=torch.bfloat16), k, torch.empty((1, 8, 12), dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match=r"D \(head dim\) in \(64, 128\)"):
        check_supported(torch.empty((1, 8, 64, 96), dtype=torch.bfloat16), torch.empty((1, 8, 96), dtype=torch.bfloat16), w, 4)
    with pytest.raises(ValueError, match=r"T <= 2\*\*20"):
        big = torch.empty((1, 2 ** 20 + 1, 64, 128), dtype=torch.bfloat16, device="meta")
        check_supported(big, k, w, 4)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_supported(q.float(), k.float(), w.float(), 4)
    assert score_ctas(1024, 132) == 132 and score_ctas(100, 132) == 100 and score_ctas(0, 132) == 1
    # the slab stays <= the config's slab_bytes (128 MiB) whatever T and S are, and follows the config's caps
    for h in INDEXER_HEADS:
        cfg = config_for(h, 128, "bfloat16", "sm_90a")
        for s in (1, 1000, 32768, 2 ** 20):
            rows = slab_rows(h, s, cfg)
            assert rows % (128 // h) == 0 and rows <= cfg.slab_max_rows
            assert rows * (-(-s // 4) * 4) * 4 <= max(cfg.slab_bytes, (128 // h) * 4 * 2 ** 20)
    import dataclasses

    cfg = config_for(64, 128, "bfloat16", "sm_90a")
    assert slab_rows(64, 32768, cfg) == 1024
    assert slab_rows(64, 32768, dataclasses.replace(cfg, slab_bytes=32 * 2 ** 20)) == 256
    assert slab_rows(64, 1000, dataclasses.replace(cfg, slab_max_rows=2048)) == 2048


def _sass(cubin: bytes, tmp_path=None) -> str:
    from dsagen.jit.sass import disassemble, find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return disassemble(cubin)


def _sass_ops(cubin: bytes, tmp_path=None) -> dict[str, int]:
    from dsagen.jit.sass import opcode_counts

    return dict(opcode_counts(_sass(cubin)))


@pytest.mark.compile
@pytest.mark.parametrize("h,d", [(64, 128), (8, 64), (128, 128)])
def test_score_kernel_compiles_to_hgmma_without_spills(h, d, tmp_path):
    from dsagen.jit.build import compile_module

    spec = IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("HGMMA", 0) >= d // 16, ops          # one 64x128x16 wgmma per 16 of D
    assert ops.get("UTMALDG", 0) > 0 and ops.get("USETMAXREG", 0) > 0, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    assert ck.record["launch"]["block"] == [512, 1, 1]
    assert ck.record["launch"]["smem"] <= 227 * 1024


@pytest.mark.compile
def test_topk_kernel_compiles(tmp_path):
    from dsagen.jit.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a", threads=128)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("ATOMS", 0) > 0 and ops.get("VOTE", 0) > 0, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"


# ------------------------------------------------------------------ top-k (notes/kernels/indexer-topk.md)
def test_topk_option_validation():
    for threads in INDEXER_TOPK_THREADS:
        assert IndexerTopkSpec(arch="sm_90a", threads=threads).can_implement() == (True, "")
        ok, why = IndexerTopkSpec(arch="sm_90a", threads=threads, sample=True).can_implement()
        assert ok == (threads in TOPK_COMPACT_CAP), (threads, why)
        if not ok:
            assert "sample=True needs threads in" in why
    for threads in (64, 256):
        ok, why = IndexerTopkSpec(arch="sm_90a", threads=threads).can_implement()
        assert not ok and f"threads={threads} must be one of" in why
    assert IndexerTopkSpec(arch="sm_90a").name() == "lightning_indexer_topk_sm_90a"       # threads=512
    assert IndexerTopkSpec(arch="sm_90a", threads=1024).name() == "lightning_indexer_topk_t1024_sm_90a"
    assert IndexerTopkSpec(arch="sm_90a").sample is False


def test_topk_sample_render():
    """The rendered module binds sample and TOPK_COMPACT_CAP of the thread count (0 without sample); the kernel
    module branches on them (cutlass.const_expr)."""
    for threads, cap in TOPK_COMPACT_CAP.items():
        src = render(IndexerTopkSpec(arch="sm_90a", threads=threads, sample=True))
        assert f"CAP = {cap} " in src and "SAMPLE = True\n" in src
        plain = render(IndexerTopkSpec(arch="sm_90a", threads=threads))
        assert "CAP = 0 " in plain and "SAMPLE = False\n" in plain


@pytest.mark.compile
@pytest.mark.parametrize("threads", INDEXER_TOPK_THREADS)
def test_topk_kernel_sass(threads, tmp_path):
    """128-bit loads issued back to back (4 in flight per thread), per-warp histogram atomics, ballots only in
    the emit, 3 barriers per radix pass + 1 before the emit, registers within the CTAs-per-SM budget (2 CTAs
    at 512 threads, 1 at 1024, 8 at 128), no spills, the per-warp histograms as the only big smem."""
    from dsagen.jit.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a", threads=threads)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("ATOMS", 0) > 0 and ops.get("VOTE", 0) > 0, ops
    assert sass.count("BAR.SYNC") <= 13, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    ctas = 1 if threads == 1024 else 2 if threads >= 256 else 1024 // threads
    assert ck.record["regcount"] <= 65536 // (ctas * threads), ck.record["regcount"]
    assert ck.record["launch"]["block"] == [threads, 1, 1]
    assert ck.record["launch"]["smem"] <= threads // 32 * 1024 + 512
    lines = sass.splitlines()
    assert any(sum("LDG.E.128" in line for line in lines[i:i + 16]) >= 4 for i in range(len(lines))), \
        "4 vector loads in flight per thread"


@pytest.mark.compile
@pytest.mark.parametrize("threads", list(TOPK_COMPACT_CAP))
def test_topk_sample_sass(threads, tmp_path):
    """sample=True: the CTAs per SM of the register budget still fit in registers AND shared memory
    (233,472 B per SM, 1 KiB reserved per CTA), no spills, 4 vector loads in flight, at most 23 block barriers (the
    plain kernel's 13, one more per pass that may compact (p = 1..3), 3 per sample scan and one for the entry
    counts)."""
    from dsagen.jit.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a", threads=threads, sample=True)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("ATOMS", 0) > 0 and ops.get("VOTE", 0) > 0, ops
    assert sass.count("BAR.SYNC") <= 23, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    ctas = 1 if threads == 1024 else 2
    assert ck.record["regcount"] <= 65536 // (ctas * threads), ck.record["regcount"]
    assert ck.record["launch"]["smem"] <= min(233472 // ctas - 1024, 232448), ck.record["launch"]["smem"]
    lines = sass.splitlines()
    assert any(sum("LDG.E.128" in line for line in lines[i:i + 16]) >= 4 for i in range(len(lines))), \
        "4 vector loads in flight per thread"


# ------------------------------------------------------------------ score kernel (notes/kernels/indexer.md)
@pytest.mark.compile
@pytest.mark.parametrize("h,d,dtype", [(64, 128, "bfloat16"), (64, 128, "float16"), (8, 64, "bfloat16"),
                                       (128, 128, "bfloat16")])
def test_score_kernel_pingpong_sass(h, d, dtype, tmp_path):
    """Ping-pong kernel: D/16 HGMMA.64x128x16 issued back to back and waited once (not serialized), the turn
    barrier arrive (BAR.ARV, 256 threads) between the last HGMMA and the wait, no spills, setmaxnreg 40 / 152
    with 512 threads (40 + 3 x 152 <= 4 x the register count: a larger sum deadlocks), grid = n_ctas."""
    import re

    from dsagen.jit.build import compile_module

    spec = config_for(h, d, dtype, "sm_90a").score
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    assert sass.count("HGMMA.64x128x16") == d // 16
    assert sass.count("WARPGROUP.DEPBAR") == 1, "wgmma serialized by ptxas"
    lines = [line for line in sass.splitlines() if "HGMMA" in line or "BAR.ARV" in line or "WARPGROUP.DEPBAR" in line]
    last = max(i for i, line in enumerate(lines) if "HGMMA" in line)
    assert "BAR.ARV" in lines[last + 1] and "0x100" in lines[last + 1] and "DEPBAR.LE gsb0, 0x0" in lines[last + 2], lines
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    budgets = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == [0x28, 0x98], budgets
    assert 0x28 + 3 * 0x98 <= 4 * ck.record["regcount"]
    assert ck.record["launch"]["block"] == [512, 1, 1] and ck.record["launch"]["grid"][0] == "n_ctas"
    assert ck.record["launch"]["smem"] <= 227 * 1024
