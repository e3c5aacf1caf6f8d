"""CPU tests of the fused lightning-indexer kernels: spec validation, rendering, the fused module's
option / range checks, and (marked `compile`) cross-compilation for sm_90a with a SASS check."""

from __future__ import annotations


import pytest
import torch

from dsagen.gen.render import render
from dsagen.spec import get_preset
from dsagen.spec.base import SpecError
from dsagen.spec.families.indexer import (INDEXER_HEAD_DIMS, INDEXER_HEADS, IndexerScoreSpec, IndexerTopkSpec,
                                          indexer_specs)


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
    with pytest.raises(SpecError):
        IndexerTopkSpec(arch="sm_90a", threads=100).check()


def test_specs_are_independent_of_run_time_arguments():
    """topk, causal, ratio and lengths are run-time arguments: one pair of kernels serves them all."""
    a = indexer_specs("sm_90a", 64, 128)
    assert a == indexer_specs("sm_90a", 64, 128, "bfloat16")
    fields = set(IndexerScoreSpec.__dataclass_fields__) | set(IndexerTopkSpec.__dataclass_fields__)
    assert not fields & {"topk", "causal", "compress_ratio", "seqlen", "T", "S"}
    assert a[0].name() == "lightning_indexer_score_consumers3_sm_90a"
    assert IndexerScoreSpec(arch="sm_90a", num_heads=8, head_dim=64).name() == "lightning_indexer_score_h8_d64_sm_90a"


def test_default_consumers_follow_the_options():
    """indexer_specs picks 3 consumer warpgroups unless the options pin consumers or select an ablation probe
    (which 3 does not support)."""
    def consumers(**opts):
        return indexer_specs("sm_90a", 64, 128, score_options=opts)[0].consumers

    assert consumers() == 3 and consumers(schedule="pingpong") == 3 and consumers(consumers=2) == 2
    for opts in ({"ablate": "no_epilogue"}, {"ablate": "mma_k16", "schedule": "pingpong"}):
        assert consumers(**opts) == 2, opts
        assert indexer_specs("sm_90a", 64, 128, score_options=opts)[0].can_implement() == (True, "")


def test_preset_contains_indexer_kernels():
    specs = get_preset("deepseek-v3.2", "sm_90a")
    assert set(indexer_specs("sm_90a", 64, 128)) <= set(specs)
    names = {s.name() for s in specs}
    assert {"lightning_indexer_topk_t128_sm_90a", "lightning_indexer_topk_compact1_sample1_sm_90a"} <= names


def test_topk_plan_picks_by_row_length_and_wave():
    """The default plan: 128 threads up to 12288 candidates, 512 + compact + sample up to 65536, else 1024 + compact
    + sample; when the slab's rows fit one wave 1024 threads (+ compact + sample beyond 12288). Options give one
    kernel (threads pinned, else 512 / 1024)."""
    from dsagen.spec.families.indexer import topk_plan

    plan = topk_plan("sm_90a")
    pick = lambda n, rows: (plan.pick(n, rows, 132).threads, plan.pick(n, rows, 132).compact,   # noqa: E731
                            plan.pick(n, rows, 132).sample)
    assert pick(1, 1024) == pick(12288, 1024) == (128, False, False)
    assert pick(12289, 1024) == pick(65536, 133) == (512, True, True)
    assert pick(65537, 1024) == pick(2 ** 20, 133) == (1024, True, True)
    assert pick(100, 132) == pick(12288, 1) == (1024, False, False)
    assert pick(12289, 132) == (1024, True, True)
    assert len(plan.specs()) == 4 and indexer_specs("sm_90a", 64, 128)[1:] == plan.specs()
    pinned = topk_plan("sm_90a", {"threads": 64})
    assert pinned.specs() == (IndexerTopkSpec(arch="sm_90a", threads=64),)
    s3 = topk_plan("sm_90a", {"compact": False})
    assert [(s.threads, s.compact) for s in s3.specs()] == [(512, False), (1024, False)]
    assert s3.pick(10, 1024, 132).threads == 512 and s3.pick(10 ** 6, 100, 132).threads == 1024


def test_slab_max_candidates():
    """The longest row a slab can hold: the ratio-causal limit of its last token for causal unpacked input, S
    otherwise (packed documents, non-causal); T - 1's limit when the slab crosses a batch element."""
    from dsagen.fused.lightning_indexer import slab_max_candidates

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
    src = render(IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d))
    assert f"H = {h}\n" in src and f"D = {d}\n" in src and "def row_bounds(" in src
    assert 'SYMBOL = "dsagen_lightning_indexer_score' in src


def test_topk_template_renders():
    src = render(IndexerTopkSpec(arch="sm_90a", threads=512))
    assert "THREADS = 512" in src and "def row_bounds(" in src


def test_fused_backend_option_and_limits():
    from dsagen.fused.lightning_indexer import SLAB_BYTES, check_backend, check_supported, slab_rows

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
    # the slab stays <= SLAB_BYTES (128 MiB) whatever T and S are
    for h in INDEXER_HEADS:
        for s in (1, 1000, 32768, 2 ** 20):
            rows = slab_rows(h, s)
            assert rows % (128 // h) == 0 and rows <= 1024
            assert rows * (-(-s // 4) * 4) * 4 <= max(SLAB_BYTES, (128 // h) * 4 * 2 ** 20)


def _sass(cubin: bytes, tmp_path=None) -> str:
    from dsagen.gen.sass import disassemble, find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return disassemble(cubin)


def _sass_ops(cubin: bytes, tmp_path=None) -> dict[str, int]:
    from dsagen.gen.sass import opcode_counts

    return dict(opcode_counts(_sass(cubin)))


@pytest.mark.compile
@pytest.mark.parametrize("h,d", [(64, 128), (8, 64), (128, 128)])
def test_score_kernel_compiles_to_hgmma_without_spills(h, d, tmp_path):
    from dsagen.gen.build import compile_module

    spec = IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("HGMMA", 0) >= d // 16, ops          # one 64x128x16 wgmma per 16 of D
    assert ops.get("UTMALDG", 0) > 0 and ops.get("USETMAXREG", 0) > 0, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    assert ck.record["launch"]["block"] == [384, 1, 1]
    assert ck.record["launch"]["smem"] <= 227 * 1024


@pytest.mark.compile
def test_topk_kernel_compiles(tmp_path):
    from dsagen.gen.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a")
    ck = compile_module(spec, render(spec), tmp_path / "build")
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("ATOMS", 0) > 0 and ops.get("VOTE", 0) > 0, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"


# ------------------------------------------------------------------ timing ablations (not correct kernels)
def test_ablation_option_validation_and_default_render():
    """ablate=... is a timing-probe option of both kernels; the default ("") renders the real kernel with no
    trace of the ablation code (the GPU-verified default source is unchanged by the option)."""
    from dsagen.spec.families.indexer import INDEXER_SCORE_ABLATIONS, INDEXER_TOPK_ABLATIONS

    for a in INDEXER_SCORE_ABLATIONS:
        for sch in ("pingpong", "persistent"):
            assert IndexerScoreSpec(arch="sm_90a", ablate=a, schedule=sch).can_implement() == (True, "")
    for a in INDEXER_TOPK_ABLATIONS:
        assert IndexerTopkSpec(arch="sm_90a", ablate=a).can_implement() == (True, "")
    for a in ("nothing", "no_store"):              # no_store & co. were probes of the pruned lock-step kernel
        ok, why = IndexerScoreSpec(arch="sm_90a", ablate=a).can_implement()
        assert not ok and "not a score-kernel ablation" in why
    assert (IndexerScoreSpec(arch="sm_90a", ablate="mma_k16").name()
            == "lightning_indexer_score_ablatemma_k16_sm_90a")
    for spec in (IndexerScoreSpec(arch="sm_90a"), IndexerTopkSpec(arch="sm_90a"), IndexerScoreSpec(arch="sm_90a", consumers=3),
                 IndexerScoreSpec(arch="sm_90a", schedule="pingpong"), IndexerTopkSpec(arch="sm_90a", threads=1024)):
        src = render(spec)
        assert "ABLAT" not in src.upper() and "sink" not in src, spec.name()
    assert 'ABLATE = "mma_k16"' in render(IndexerScoreSpec(arch="sm_90a", ablate="mma_k16"))
    assert 'ABLATE = "hist1"' in render(IndexerTopkSpec(arch="sm_90a", ablate="hist1"))


@pytest.mark.compile
@pytest.mark.parametrize("ablate,hgmma,epilogue", [("no_epilogue", 8, False), ("mma_k16", 1, True)])
def test_persistent_ablation_compiles(ablate, hgmma, epilogue, tmp_path):
    """The persistent kernel's probes: no_epilogue keeps the D/16 HGMMAs and drops the FMNMX/stores, mma_k16 keeps
    one HGMMA and the epilogue; both keep the turn barrier, the resources and no spills (2 consumers only)."""
    from dsagen.gen.build import compile_module

    ok, why = IndexerScoreSpec(arch="sm_90a", ablate=ablate, consumers=3).can_implement()
    assert not ok and "not of the ablations" in why
    spec = IndexerScoreSpec(arch="sm_90a", schedule="persistent", ablate=ablate)
    src = render(spec)
    assert f'ABLATE = "{ablate}"' in src
    ck = compile_module(spec, src, tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    ops = _sass_ops(ck.cubin, tmp_path)
    assert sass.count("HGMMA.64x128x16.F32.BF16") == hgmma, ops
    assert sass.count("WARPGROUP.DEPBAR") == 1 and "BAR.ARV" in sass
    assert (ops.get("FMNMX", 0) >= 64) == epilogue, ops
    assert ops.get("STG", 0) <= (4 if epilogue else 1), ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    assert ck.record["launch"]["smem"] == 198656


# ------------------------------------------------------------------ top-k (notes/kernels/indexer-topk.md)
def test_topk_option_validation():
    from dsagen.spec.families.indexer import INDEXER_TOPK_ABLATIONS, INDEXER_TOPK_THREADS

    for threads in INDEXER_TOPK_THREADS:
        for a in INDEXER_TOPK_ABLATIONS:
            assert IndexerTopkSpec(arch="sm_90a", threads=threads, ablate=a).can_implement() == (True, "")
    ok, why = IndexerTopkSpec(arch="sm_90a", ablate="read1_ilp4").can_implement()
    assert not ok and "not a top-k ablation" in why
    assert IndexerTopkSpec(arch="sm_90a").name() == "lightning_indexer_topk_sm_90a"       # threads=512
    assert IndexerTopkSpec(arch="sm_90a", threads=1024).name() == "lightning_indexer_topk_t1024_sm_90a"
    assert IndexerTopkSpec(arch="sm_90a").compact is False
    from dsagen.spec.families.indexer import TOPK_COMPACT_CAP

    for threads in INDEXER_TOPK_THREADS:
        ok, why = IndexerTopkSpec(arch="sm_90a", threads=threads, compact=True).can_implement()
        assert ok == (threads in TOPK_COMPACT_CAP), (threads, why)
    ok, why = IndexerTopkSpec(arch="sm_90a", compact=True, ablate="no_emit").can_implement()
    assert not ok and "compact=True" in why
    ok, why = IndexerTopkSpec(arch="sm_90a", sample=True).can_implement()
    assert not ok and "sample=True needs compact=True" in why
    assert IndexerTopkSpec(arch="sm_90a", compact=True, sample=True).can_implement() == (True, "")


def test_topk_compact_render():
    """compact=True adds the smem entries and their passes; without it the source has none of them."""
    from dsagen.spec.families.indexer import TOPK_COMPACT_CAP

    for threads, cap in TOPK_COMPACT_CAP.items():
        src = render(IndexerTopkSpec(arch="sm_90a", threads=threads, compact=True))
        assert f"CAP = {cap} " in src and "sKey[e] = key" in src and "cmode" in src
        plain = render(IndexerTopkSpec(arch="sm_90a", threads=threads))
        assert "CAP" not in plain and "sKey" not in plain and "cmode" not in plain


#: ablation -> (ATOMS in the kernel?, VOTE (emit) in the kernel?, BAR.SYNC at most)
_TOPK_SASS = {"": (True, True, 13), "hist1": (True, False, 4), "read1": (False, False, 4),
              "no_emit": (True, False, 12)}


@pytest.mark.compile
@pytest.mark.parametrize("threads,ablate", [(512, a) for a in _TOPK_SASS] + [(256, ""), (1024, ""), (1024, "hist1"),
                                                                           (64, ""), (128, ""), (64, "no_emit")])
def test_topk_kernel_sass(threads, ablate, tmp_path):
    """128-bit loads issued back to back (4 in flight per thread), per-warp histogram atomics, ballots only in
    the emit, 3 barriers per radix pass + 1 before the emit, registers within the CTAs-per-SM budget (2 CTAs
    at 256 / 512 threads, 1 at 1024, 1024 / threads at 64 / 128), no spills, the per-warp histograms as the
    only big smem."""
    from dsagen.gen.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a", threads=threads, ablate=ablate)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    ops = _sass_ops(ck.cubin, tmp_path)
    atoms, vote, bars = _TOPK_SASS[ablate]
    assert (ops.get("ATOMS", 0) > 0) == atoms and (ops.get("VOTE", 0) > 0) == vote, ops
    assert sass.count("BAR.SYNC") <= bars, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    ctas = 1 if threads == 1024 else 2 if threads >= 256 else 1024 // threads
    assert ck.record["regcount"] <= 65536 // (ctas * threads), ck.record["regcount"]
    assert ck.record["launch"]["block"] == [threads, 1, 1]
    assert ck.record["launch"]["smem"] <= threads // 32 * 1024 + 512
    lines = sass.splitlines()
    assert any(sum("LDG.E.128" in line for line in lines[i:i + 16]) >= 4 for i in range(len(lines))), \
        "4 vector loads in flight per thread"


@pytest.mark.compile
@pytest.mark.parametrize("threads,sample", [(256, False), (512, False), (1024, False), (512, True), (1024, True)])
def test_topk_compact_sass(threads, sample, tmp_path):
    """compact=True: the CTAs per SM of the register budget still fit in registers AND shared memory
    (233,472 B per SM, 1 KiB reserved per CTA), no spills, 4 vector loads in flight, one barrier more per
    pass that may compact (p = 1..3) than the plain kernel's 13 (sample=True: + 7, 3 per sample scan and one for
    the entry counts)."""
    from dsagen.gen.build import compile_module

    spec = IndexerTopkSpec(arch="sm_90a", threads=threads, compact=True, sample=sample)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    ops = _sass_ops(ck.cubin, tmp_path)
    assert ops.get("ATOMS", 0) > 0 and ops.get("VOTE", 0) > 0, ops
    assert sass.count("BAR.SYNC") <= (23 if sample else 16), ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    ctas = 1 if threads == 1024 else 2 if threads >= 256 else 1024 // threads
    assert ck.record["regcount"] <= 65536 // (ctas * threads), ck.record["regcount"]
    assert ck.record["launch"]["smem"] <= min(233472 // ctas - 1024, 232448), ck.record["launch"]["smem"]
    lines = sass.splitlines()
    assert any(sum("LDG.E.128" in line for line in lines[i:i + 16]) >= 4 for i in range(len(lines))), \
        "4 vector loads in flight per thread"


# ------------------------------------------------------------------ ping-pong / persistent schedules
def test_schedule_option_validation_and_render():
    """schedule: pingpong or persistent (the default); both render the ping-pong template and differ only in the
    grid the host passes. (The former "lockstep" schedule was pruned: notes/kernels/indexer.md.)"""
    from dsagen.fused.lightning_indexer import score_ctas
    from dsagen.spec.families.indexer import INDEXER_SCORE_SCHEDULES

    assert IndexerScoreSpec(arch="sm_90a").schedule == "persistent"
    for sch in INDEXER_SCORE_SCHEDULES:
        for h in INDEXER_HEADS:
            for d in INDEXER_HEAD_DIMS:
                assert IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d, schedule=sch).can_implement() == (True, "")
    ok, why = IndexerScoreSpec(arch="sm_90a", schedule="round_robin").can_implement()
    assert not ok and "schedule='round_robin'" in why
    ok, why = IndexerScoreSpec(arch="sm_90a", schedule="lockstep").can_implement()
    assert not ok and "schedule='lockstep'" in why
    src = render(IndexerScoreSpec(arch="sm_90a", schedule="pingpong"))
    assert "BAR_WG0 = 1" in src and "def row_bounds(" in src and '"n_ctas"' in src
    assert IndexerScoreSpec(arch="sm_90a").smem_bytes() <= 220 * 1024
    for sch in ("pingpong", "persistent"):
        assert IndexerScoreSpec(arch="sm_90a", schedule=sch, consumers=3).can_implement() == (True, "")
    ok, why = IndexerScoreSpec(arch="sm_90a", consumers=4).can_implement()
    assert not ok and "consumers=4 must be 2 or 3" in why
    assert "THREADS = 512" in render(IndexerScoreSpec(arch="sm_90a", consumers=3))
    assert score_ctas("pingpong", 1024, 132) == 1024
    assert score_ctas("persistent", 1024, 132) == 132 and score_ctas("persistent", 100, 132) == 100


@pytest.mark.compile
@pytest.mark.parametrize("h,d,sched,opts", [(64, 128, "persistent", {}), (8, 64, "persistent", {}),
                                            (128, 128, "pingpong", {}),
                                            (64, 128, "persistent", {"consumers": 3}), (8, 64, "pingpong", {"consumers": 3})])
def test_pingpong_schedule_compiles(h, d, sched, opts, tmp_path):
    """Ping-pong kernel: D/16 HGMMA.64x128x16 issued back to back and waited once (not serialized), the
    turn barrier arrive (BAR.ARV, 256 threads) between the last HGMMA and the wait, no spills, setmaxnreg 40 / 232 (consumers=3: 40 / 152 with 512 threads), grid = n_ctas."""
    import re

    from dsagen.gen.build import compile_module

    spec = IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d, schedule=sched, **opts)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    assert sass.count("HGMMA.64x128x16") == d // 16
    assert sass.count("WARPGROUP.DEPBAR") == 1, "wgmma serialized by ptxas"
    lines = [line for line in sass.splitlines() if "HGMMA" in line or "BAR.ARV" in line or "WARPGROUP.DEPBAR" in line]
    last = max(i for i, line in enumerate(lines) if "HGMMA" in line)
    assert "BAR.ARV" in lines[last + 1] and "0x100" in lines[last + 1] and "DEPBAR.LE gsb0, 0x0" in lines[last + 2], lines
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    budgets = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", sass))
    consumers = opts.get("consumers", 2)
    consumer_regs = 0xE8 if consumers == 2 else 0x98
    assert budgets == [0x28, consumer_regs], budgets
    assert 0x28 + consumers * consumer_regs <= (1 + consumers) * ck.record["regcount"]   # a larger sum deadlocks
    assert ck.record["launch"]["block"] == [128 * (1 + consumers), 1, 1] and ck.record["launch"]["grid"][0] == "n_ctas"
    assert ck.record["launch"]["smem"] <= 227 * 1024


def test_lean_epilogue_option_validation():
    """lean_epilogue: an option of both schedules (any consumers), not of the ablation probes; indexer_specs keeps
    the 3-consumer default with it. free_issue: an option of both schedules."""
    for sch in ("pingpong", "persistent"):
        for c in (2, 3):
            assert IndexerScoreSpec(arch="sm_90a", schedule=sch, consumers=c, lean_epilogue=True).can_implement() == (True, "")
    ok, why = IndexerScoreSpec(arch="sm_90a", lean_epilogue=True, ablate="mma_k16").can_implement()
    assert not ok and "lean_epilogue is an option of the real kernel" in why
    spec = indexer_specs("sm_90a", 64, 128, score_options={"lean_epilogue": True})[0]
    assert spec.consumers == 3 and spec.name() == "lightning_indexer_score_consumers3_lean_epilogue1_sm_90a"
    src = render(spec)
    assert "def quad_reduce_scatter(" in src and "KEEP = max(1, NV // 4)" in src and "gt & (KSLOTS - 1)" in src
    assert "def quad_reduce_scatter(" not in render(IndexerScoreSpec(arch="sm_90a", consumers=3))
    assert IndexerScoreSpec(arch="sm_90a", consumers=3, lean_epilogue=True, free_issue=True).can_implement() == (True, "")
    for sch in ("pingpong", "persistent"):
        assert IndexerScoreSpec(arch="sm_90a", schedule=sch, free_issue=True).can_implement() == (True, "")
    assert "barrier_id" not in render(IndexerScoreSpec(arch="sm_90a", consumers=3, free_issue=True))


@pytest.mark.compile
@pytest.mark.parametrize("h,d,opts", [(64, 128, {"consumers": 3}), (8, 64, {"consumers": 3}), (16, 128, {"consumers": 3}),
                                      (32, 64, {"consumers": 3}), (128, 128, {"consumers": 3}),
                                      (64, 128, {"consumers": 2, "schedule": "pingpong"}),
                                      (64, 128, {"consumers": 3, "free_issue": True}), (8, 64, {"consumers": 3, "free_issue": True})])
def test_lean_epilogue_compiles(h, d, opts, tmp_path):
    """Lean epilogue SASS per 64-row tile: D/16 HGMMA waited once, the quad reduce-scatter's 3 NV / 4 SHFL (NV = 2 x
    128 // H sums per thread; 2 at H=128), one STG per kept sum (max(1, NV / 4)), no spills."""
    from dsagen.gen.build import compile_module

    spec = IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d, lean_epilogue=True, **opts)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    nv = 2 * 128 // h
    assert sass.count("HGMMA.64x128x16") == d // 16
    assert sass.count("WARPGROUP.DEPBAR") == 1, "wgmma serialized by ptxas"
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    lines = sass.splitlines()
    first = next(i for i, line in enumerate(lines) if "HGMMA" in line)
    last = next(i for i in range(first, len(lines)) if "BSYNC" in lines[i])      # end of the tile's epilogue
    assert sum("SHFL.BFLY PT," in line for line in lines[first:last]) == (3 * nv // 4 if nv >= 4 else 2)
    assert sass.count("STG.E ") == max(1, nv // 4), sass.count("STG.E ")
    if opts.get("free_issue"):                           # no turn barriers: only the prologue's CTA barrier
        assert sass.count("BAR.SYNC") == 1 and "BAR.ARV" not in sass
    assert ck.record["launch"]["block"] == [128 * (1 + opts.get("consumers", 2)), 1, 1]


def test_mma_head_sum_option():
    """mma_head_sum: bfloat16 only, not with lean_epilogue / ablate; indexer_specs turns it on for bfloat16
    (DEFAULT_MMA_HEAD_SUM) and drops it for float16."""
    from dsagen.spec.families.indexer import DEFAULT_MMA_HEAD_SUM

    assert IndexerScoreSpec(arch="sm_90a", mma_head_sum=True).can_implement() == (True, "")
    for bad in ({"dtype": "float16"}, {"lean_epilogue": True}, {"ablate": "no_epilogue", "schedule": "persistent"}):
        ok, why = IndexerScoreSpec(arch="sm_90a", mma_head_sum=True, **bad).can_implement()
        assert not ok and "mma_head_sum" in why, bad
    assert indexer_specs("sm_90a", 64, 128)[0].mma_head_sum == DEFAULT_MMA_HEAD_SUM
    assert not indexer_specs("sm_90a", 64, 128, "float16", score_options={"mma_head_sum": True})[0].mma_head_sum
    assert not indexer_specs("sm_90a", 64, 128, score_options={"lean_epilogue": True})[0].mma_head_sum
    assert not indexer_specs("sm_90a", 64, 128, score_options={"mma_head_sum": False})[0].mma_head_sum
    src = render(IndexerScoreSpec(arch="sm_90a", mma_head_sum=True))
    assert "acc_as_frg_a" in src and "sWb[nn, col, slot]" in src
    assert "sWb" not in render(IndexerScoreSpec(arch="sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("h,d", [(64, 128), (8, 64), (128, 128)])
def test_mma_head_sum_sass(h, d, tmp_path):
    """The head sum as wgmma: per tile D/16 HGMMA.64x128x16 (scores) + 8 HGMMA.64xNx16 (N = 8, 16 at H=8) with
    A from registers, issued in the next turn ahead of the next tile's scores (so it never waits behind another
    warpgroup's scores), ReLU fused into the bf16 packing (F2FP.RELU, 32 per tile), no FMNMX / spills."""
    from dsagen.gen.build import compile_module

    spec = IndexerScoreSpec(arch="sm_90a", num_heads=h, head_dim=d, consumers=3, mma_head_sum=True)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin, tmp_path)
    n2 = 16 if h == 8 else 8
    assert sass.count("HGMMA.64x128x16") == d // 16
    assert sass.count(f"HGMMA.64x{n2}x16.F32.BF16 R") == 16        # register A: in the turn + the item's flush
    assert sass.count("F2FP.RELU.BF16.F32.PACK_AB") == 32 and "FMNMX" not in sass
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    lines = [ln for ln in sass.splitlines() if "HGMMA" in ln or "DEPBAR" in ln or "BAR.ARV" in ln]
    first = next(i for i, ln in enumerate(lines) if f"64x{n2}x16" in ln)
    # in the turn: the previous tile's head sum, then the scores, the turn passed, then wait for the head sum only
    assert all(f"64x{n2}x16" in ln for ln in lines[first:first + 8]), lines[first:first + 20]
    assert all("64x128x16" in ln for ln in lines[first + 8:first + 8 + d // 16]), lines[first:first + 20]
    assert "BAR.ARV" in lines[first + 8 + d // 16] and "DEPBAR.LE gsb0, 0x1" in lines[first + 9 + d // 16]
    assert sum("DEPBAR" in ln for ln in lines) == 3, "wgmma serialized by ptxas"
    assert ck.record["launch"]["smem"] <= 227 * 1024
