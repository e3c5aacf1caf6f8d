"""CPU tests of the fused sparse attention forward's spec, template and compiled kernel (no GPU):
validation reasons, the rendered module, and (marked `compile`, needs CuTe-DSL) a real sm_90a
cross-compilation whose SASS must show the design: HGMMA for both products (SS for QK^T, RS and SS for
PV), LDGSTS gathers with cp.async mbarrier arrivals, setmaxnreg, and no local-memory spills."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from dsagen.gen.render import helper_modules, render
from dsagen.spec import SpecError, get_preset
from dsagen.spec.families.sparse_attention import (ABLATIONS, HALVES_REGS, SCHEDULE_ABLATIONS,
                                                   SparseAttnFwdSpec)

HALVES = dict(HALVES_REGS, schedule="split_halves")
LEAN = dict(schedule="serial_lean")


def _compiled_sass(spec, tmp_path):
    """Cross-compile `spec` for sm_90a and check what every kernel of this op must show: 384 threads and a
    setmaxnreg budget that is the spec's and cannot deadlock (setmaxnreg only redistributes the registers the CTA
    launched with; asking for more spins forever). Returns (launch record, SASS, opcode counts); skips the test
    when nvdisasm is missing."""
    from dsagen.gen.build import compile_module
    from dsagen.gen.sass import disassemble, find_nvdisasm, opcode_counts

    ck = compile_module(spec, render(spec), tmp_path)
    rec = ck.record
    assert rec["launch"]["block"] == [384, 1, 1]
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    budgets = [int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass)]
    assert sorted(budgets) == sorted([spec.regs_producer, spec.regs_qk, spec.regs_pv]), budgets
    assert sum(budgets) <= 3 * rec["regcount"], (budgets, rec["regcount"])
    return rec, sass, opcode_counts(sass)


def _smem_fits(rec):
    return 200 * 1024 <= rec["launch"]["smem"] + rec["static_smem"] <= 227 * 1024


def test_default_spec_is_the_v32_shape_and_valid():
    s = SparseAttnFwdSpec(arch="sm_90a").check()
    assert (s.num_heads, s.d_qk, s.d_v, s.dtype) == (128, 576, 512, "bfloat16")
    # the op's H128 / D576 kernel
    assert dataclasses.replace(s, **HALVES, vec_store=True, stream_hint=True) in get_preset("deepseek-v3.2", "sm_90a")
    assert not any(isinstance(x, SparseAttnFwdSpec) for x in get_preset("deepseek-v3.2", "sm_100a"))


@pytest.mark.parametrize("kw,needle", [
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(num_heads=32), "pad 16/32 heads"),
    (dict(d_qk=128), "512 or 576"),
    (dict(d_v=256), "d_v=256"),
    (dict(dtype="float32"), "'bfloat16' or 'float16'"),
    (dict(block_n=128), "block_n=128"),
    (dict(stages=3), "stages=3"),
    (dict(regs_qk=250), "multiple of 8"),
    (dict(regs_qk=248, regs_pv=224), "exceeds 504"),
    (dict(schedule="pingpong"), "schedule='pingpong'"),
    (dict(schedule="split"), "schedule='split'"),
    (dict(ablate="no_everything"), "ablate='no_everything'"),
    (dict(ablate="no_pv", **HALVES), "does not exist for schedule 'split_halves'"),
    (dict(ablate="no_ready_fence"), "does not exist for schedule 'serial'"),
    (dict(schedule="split_halves", regs_producer=56), "exceeds 504"),
    (dict(l2_hint=True), "l2_hint=True exists for schedule 'split_halves' only"),
])
def test_invalid_specs_say_why(kw, needle):
    spec = SparseAttnFwdSpec(**{"arch": "sm_90a", **kw})
    ok, why = spec.can_implement()
    assert not ok and needle in why
    with pytest.raises(SpecError, match=re.escape(needle)):
        spec.check()


def test_every_field_changes_the_identity():
    base = SparseAttnFwdSpec(arch="sm_90a")
    others = [SparseAttnFwdSpec(arch="sm_90a", num_heads=64), SparseAttnFwdSpec(arch="sm_90a", d_qk=512),
              SparseAttnFwdSpec(arch="sm_90a", dtype="float16"),
              SparseAttnFwdSpec(arch="sm_90a", regs_qk=240, regs_pv=224),
              SparseAttnFwdSpec(arch="sm_90a", **HALVES), SparseAttnFwdSpec(arch="sm_90a", **LEAN),
              SparseAttnFwdSpec(arch="sm_90a", l2_hint=True, **HALVES)] + [
              SparseAttnFwdSpec(arch="sm_90a", ablate=a) for a in SCHEDULE_ABLATIONS["serial"]]
    keys = {base.canonical_json()} | {o.canonical_json() for o in others}
    assert len(keys) == 1 + len(others)
    assert len({base.symbol()} | {o.symbol() for o in others}) == 1 + len(others)


@pytest.mark.parametrize("d_qk", [512, 576])
def test_render(d_qk):
    src = render(SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=d_qk))
    compile(src, "kernel.py", "exec")
    assert f"D_QK = {d_qk}" in src and "H = 64" in src
    assert ("sP: cute.struct.Align" in src) == (d_qk == 512)   # P aliases the RoPE tile at 576
    assert "dsagen.kernels.attn_sm90" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("spec", [SparseAttnFwdSpec(arch="sm_90a"),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512)],
                         ids=lambda s: s.name())
def test_compiles_to_the_designed_sass(spec, tmp_path):
    rec, sass, ops = _compiled_sass(spec, tmp_path)
    assert rec["launch"]["grid"][0] == f"s_q * {spec.num_heads // 64}"
    assert _smem_fits(rec)
    nkb = spec.d_qk // 64
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ", sass)) == spec.d_qk // 16      # SS QK^T
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 4  # RS PV
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 4   # SS PV
    assert ops["LDGSTS"] == 2 * 4 * nkb               # Q + one KV stage: 4 rows x nkb chunks per thread
    assert "LDGSTS.E.BYPASS" in sass and ops["ARRIVES"] >= 2
    assert ops["USETMAXREG"] == 3
    assert ops["MUFU"] > 0
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"


def test_schedule_selection():
    import torch

    import dsagen.fused.sparse_attention as fsa

    assert SparseAttnFwdSpec(arch="sm_90a").schedule == "serial"
    assert fsa.SCHEDULE is None                                        # each shape's measured-fastest schedule
    halves = SparseAttnFwdSpec(arch="sm_90a", **HALVES, vec_store=True, stream_hint=True)   # the op's options
    assert fsa.spec_for(128, 576, torch.bfloat16) == halves
    assert fsa.spec_for(100, 576, torch.bfloat16) == halves                        # padded to 128 heads
    for h, d in ((64, 576), (64, 512), (128, 512), (16, 576)):
        assert fsa.spec_for(h, d, torch.bfloat16).schedule == "split_halves", (h, d)
    assert fsa.spec_for(128, 576, torch.bfloat16, schedule="serial") == SparseAttnFwdSpec(arch="sm_90a")
    for rows in (None, 1, 128, 4096):                                  # decode batches and prefill alike
        assert fsa.resolved_schedule(128, 576, rows=rows) == "split_halves"
        assert fsa.resolved_schedule(64, 512, rows=rows) == "split_halves"
    assert fsa.spec_for(128, 576, torch.bfloat16, rows=64) == halves
    assert fsa.resolved_schedule(128, 576, "serial_lean", rows=64) == "serial_lean"
    with pytest.raises(ValueError, match="schedule"):
        fsa.spec_for(64, 576, torch.bfloat16, schedule="nope")
    with pytest.raises(ValueError, match="schedule"):                  # removed (see the notes)
        fsa.spec_for(64, 576, torch.bfloat16, schedule="split")


def test_split_halves_spec_and_selection():
    import torch

    import dsagen.fused.sparse_attention as fsa

    s = SparseAttnFwdSpec(arch="sm_90a", **HALVES, vec_store=True, stream_hint=True).check()
    assert s.regs_producer + s.regs_qk + s.regs_pv == 504
    assert fsa.spec_for(128, 576, torch.bfloat16, schedule="split_halves") == s      # the op's options: vec_store
    assert fsa.spec_for(32, 512, torch.bfloat16, schedule="split_halves") == SparseAttnFwdSpec(
        arch="sm_90a", num_heads=64, d_qk=512, **HALVES, vec_store=True, stream_hint=True)
    assert fsa.OPTIONS == {}
    try:
        fsa.OPTIONS = {"vec_store": False, "q_prefetch": True}
        assert fsa.spec_for(128, 576, torch.bfloat16, schedule="split_halves") == SparseAttnFwdSpec(
            arch="sm_90a", **HALVES, stream_hint=True, q_prefetch=True)
        assert fsa.spec_for(128, 576, torch.bfloat16, schedule="serial") == SparseAttnFwdSpec(arch="sm_90a")
        fsa.OPTIONS = {"vec_stor": True}
        with pytest.raises(ValueError, match="vec_stor"):
            fsa.spec_for(128, 576, torch.bfloat16, schedule="split_halves")
    finally:
        fsa.OPTIONS = {}
    assert fsa.L2_HINT is False
    try:
        fsa.L2_HINT = True
        assert fsa.spec_for(128, 576, torch.bfloat16, schedule="split_halves").l2_hint
        assert not fsa.spec_for(128, 576, torch.bfloat16, schedule="serial").l2_hint
    finally:
        fsa.L2_HINT = False


@pytest.mark.parametrize("d_qk", [512, 576])
def test_render_split_halves(d_qk):
    src = render(SparseAttnFwdSpec(arch="sm_90a", d_qk=d_qk, **HALVES))
    compile(src, "kernel.py", "exec")
    for name in ("BAR_MAX_A = 1", "BAR_MAX_B = 2", "BAR_P_A = 3", "BAR_P_B = 4", "BAR_EPI_A = 5", "BAR_EPI_B = 6",
                 "npairs = ((kmax + BN - 1) // BN + 1) // 2", "half_mbar"):
        assert name in src
    # the CTAs loop over the items: grid min(items, n_ctas), the Q hand-over barrier, phases from the pair count
    assert src.count("for item in cutlass.range(bidx, n_items, nctas, unroll=1):") == 3     # producer, A, B
    assert '"grid": ["min(s_q * 2, n_ctas)", 1, 1]' in src and "q_free" in src and "g = gp + k" in src
    # no PipelineCpAsync ring and none of the serial hand-off; the producer fills the halves V0L, V1R, V0R, V1L
    assert "PipelineCpAsync" not in src and "sCorr" not in src and "BAR_P0" not in src
    waits = re.findall(r"mbarrier_wait\(hbar \+ (\d)", src)
    assert waits[:4] == ["4", "7", "5", "6"]                  # producer: free[0][L], free[1][R], free[0][R], free[1][L]
    # the P tiles: P0 in stage 0's RoPE tile at 576 (one extra tile for P1), two tiles at 512
    assert ("MemRange[DT, M * BN]" in src) == (d_qk == 576)


@pytest.mark.compile
@pytest.mark.parametrize("d_qk", [512, 576])
def test_l2_hint_compiles_to_prefetching_gathers(d_qk, tmp_path):
    spec = SparseAttnFwdSpec(arch="sm_90a", d_qk=d_qk, l2_hint=True, **HALVES)
    plain = render(SparseAttnFwdSpec(arch="sm_90a", d_qk=d_qk, **HALVES))
    assert "cp_async_16_l2_hint" in render(spec) and "cp_async_16_l2_hint" not in plain
    _, sass, _ = _compiled_sass(spec, tmp_path)
    nkb = d_qk // 64
    # the KV gather (4 rows x nkb chunks x 2 tiles per thread) prefetches 256-byte L2 lines; Q's gather does not
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.LTC256B\.128 ", sass)) == 2 * 4 * nkb
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128 ", sass)) == 4 * nkb


@pytest.mark.compile
@pytest.mark.parametrize("spec", [SparseAttnFwdSpec(arch="sm_90a", **HALVES),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512, **HALVES),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, dtype="float16", **HALVES)],
                         ids=lambda s: s.name())
def test_split_halves_compiles_to_the_designed_sass(spec, tmp_path):
    rec, sass, ops = _compiled_sass(spec, tmp_path)
    assert _smem_fits(rec)
    t = r"\.BF16" if spec.dtype == "bfloat16" else ""
    ks = spec.d_qk // 16
    # A issues QK^T in its prologue and in its loop body (the last pair is peeled), B once: 3 x ks
    assert len(re.findall(rf"HGMMA\.64x64x16\.F32{t} ", sass)) == 3 * ks
    # A: RS + SS in the loop body and in the peeled last pair; B: RS + SS
    assert len(re.findall(rf"HGMMA\.64x256x16\.F32{t} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 12
    assert len(re.findall(rf"HGMMA\.64x256x16\.F32{t} R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 12
    # no wgmma serialisation: A waits 0 after QK^T (prologue, loop), after P0 V0L (loop, last), after P1 V1L
    # (last), and 1 + 0 around the next QK^T; B waits 0 after QK^T, after P1 V1R (frees V1R before the P0
    # hand-off) and after P0 V0R
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 8 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
    for bar in (1, 2, 3, 4):        # each arrived by one consumer and synced by the other
        assert len(re.findall(rf"BAR\.SYNC\.DEFER_BLOCKING 0x{bar}, 0x100 ", sass)) >= 1
        assert len(re.findall(rf"BAR\.ARV 0x{bar}, 0x100 ", sass)) >= 1
    # the row sums change hands at the end of an item like the maxima: 5 (A arrives, B syncs), 6 (B arrives,
    # A syncs), one round each per item (two syncs of one barrier from two places is a synccheck error)
    for bar in (5, 6):
        assert len(re.findall(rf"BAR\.SYNC\.DEFER_BLOCKING 0x{bar}, 0x100 ", sass)) == 1
        assert len(re.findall(rf"BAR\.ARV 0x{bar}, 0x100 ", sass)) == 1
    assert len(re.findall(r"BAR\.(?:SYNC|ARV|RED)\S* 0x[7-9a-f]\b", sass)) == 0
    assert ops["LDGSTS"] == 4 * (spec.d_qk // 64) + 2 * 4 * (spec.d_qk // 64)   # Q + the two tiles of a pair
    # KNOWN: this schedule spills a few loop-invariant values (addresses) to local memory (L1), reloaded once per
    # pair; bound them so that a change which spills in the inner loops shows up
    assert ops["LDL"] + ops["STL"] <= 100, (ops["LDL"], ops["STL"])


# ---------------------------------------------------------------- timing-only ablations (spec option `ablate`)
def _default_renders():
    for h in (64, 128):
        for d in (512, 576):
            for dt in ("bfloat16", "float16"):
                for extra in ({}, HALVES, LEAN):
                    yield SparseAttnFwdSpec(arch="sm_90a", num_heads=h, d_qk=d, dtype=dt, **extra)


def test_ablations_leave_the_real_kernels_alone():
    """The `ablate` blocks render nothing for ablate="": the real kernels' source has no trace of them, and every
    ablation renders valid Python whose docstring says it is timing only."""
    import torch

    import dsagen.fused.sparse_attention as fsa

    assert SparseAttnFwdSpec(arch="sm_90a").ablate == ""
    for spec in _default_renders():
        src = render(spec)
        assert "ABLATION" not in src and "ablate" not in src.lower()
        for a in SCHEDULE_ABLATIONS[spec.schedule]:
            abl = render(SparseAttnFwdSpec(**{**spec.canonical()["fields"], "ablate": a}).check())
            compile(abl, "kernel.py", "exec")
            assert f'ABLATION "{a}": a TIMING-ONLY variant' in abl
    # the op never selects an ablation; spec_for does only when asked
    assert fsa.spec_for(128, 576, torch.bfloat16).ablate == ""
    assert fsa.spec_for(128, 576, torch.bfloat16, schedule="serial", ablate="no_pv") == SparseAttnFwdSpec(
        arch="sm_90a", ablate="no_pv")
    with pytest.raises(ValueError, match="ablate"):
        fsa.spec_for(128, 576, torch.bfloat16, ablate="no_everything")


_ABLATION_SPECS = [SparseAttnFwdSpec(arch="sm_90a", ablate=a) for a in SCHEDULE_ABLATIONS["serial"]]


@pytest.mark.compile
@pytest.mark.parametrize("spec", _ABLATION_SPECS, ids=lambda s: s.name())
def test_ablations_compile_to_what_they_claim(spec, tmp_path):
    """Each ablated kernel compiles for sm_90a with no spills and a setmaxnreg budget that cannot deadlock, and
    its SASS lacks exactly the stage it leaves out (counts against the real kernel of the same schedule)."""
    rec, sass, ops = _compiled_sass(spec, tmp_path)
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"
    qk = len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ", sass))
    pv = len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16 ", sass))
    ex2 = sass.count("MUFU.EX2")
    ldg = len(re.findall(r"\bLDG\.E\b", sass))
    full_pv = 8                                               # serial: 4 RS + 4 SS
    full_ldg = 4 + 3 + 16                                     # producer ids + params / sink / length + masks
    expect = {
        "no_gather": dict(qk=36, pv=full_pv, ldgsts=2 * 4 * 9),
        "no_math": dict(qk=0, pv=0, ldgsts=2 * 4 * 9),
        "no_softmax": dict(qk=36, pv=full_pv, ldgsts=2 * 4 * 9),
        "no_pv": dict(qk=36, pv=0, ldgsts=2 * 4 * 9),
        "no_mask": dict(qk=36, pv=full_pv, ldgsts=2 * 4 * 9),
    }[spec.ablate]
    assert (qk, pv, ops["LDGSTS"]) == (expect["qk"], expect["pv"], expect["ldgsts"]), sass.count("HGMMA")
    if spec.ablate in ("no_math", "no_softmax"):
        assert ex2 <= 2 and ldg < full_ldg - 8                 # no exp2 per element, no mask id loads
    else:
        assert ex2 >= 34                                      # the softmax is there
    if spec.ablate == "no_mask":
        assert ldg < full_ldg - 8
    if spec.ablate == "no_gather":
        # the KV gather sits behind a run-time `t < STAGES` branch: the producer loop still has its LDGSTS once
        assert "ARRIVES.LDGSTSBAR" in sass


def test_split_halves_ablations_leave_the_real_kernel_alone():
    real = render(SparseAttnFwdSpec(arch="sm_90a", **HALVES))
    assert "ABLATION" not in real and "if k < 1" not in real
    assert set(SCHEDULE_ABLATIONS["split_halves"]) <= set(ABLATIONS)
    gather = render(SparseAttnFwdSpec(arch="sm_90a", ablate="no_gather", **HALVES))
    assert gather.count("if k < 1:") == 5                    # the ids of a pair and each of its four halves
    fence = render(SparseAttnFwdSpec(arch="sm_90a", ablate="no_ready_fence", **HALVES))
    assert real.count("fence_proxy") - fence.count("fence_proxy") == 6       # one per qk_half use (A 4, B 2)
    for src in (gather, fence):
        compile(src, "kernel.py", "exec")


@pytest.mark.compile
@pytest.mark.parametrize("ablate", SCHEDULE_ABLATIONS["split_halves"])
def test_split_halves_ablations_compile(ablate, tmp_path):
    """The split_halves probes compile with a setmaxnreg budget that cannot deadlock; no_ready_fence drops the six
    ready-path MEMBARs (2 in A's prologue, 2 in its loop, 2 in B), keeping the three P-store fences."""
    _, sass, ops = _compiled_sass(SparseAttnFwdSpec(arch="sm_90a", ablate=ablate, **HALVES), tmp_path)
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ", sass)) == 3 * 36
    assert sass.count("MEMBAR.ALL.CTA") == (3 if ablate == "no_ready_fence" else 9)
    assert ops["LDL"] + ops["STL"] <= 100, (ops["LDL"], ops["STL"])



def test_serial_lean_spec_and_render():
    """schedule "serial_lean" is serial's producer and WG2 with WG1's lean, QK^T-ahead loop; the serial render does
    not change with it (the lean code sits under its own template branch)."""
    import torch

    import dsagen.fused.sparse_attention as fsa

    spec = SparseAttnFwdSpec(arch="sm_90a", **LEAN).check()
    assert (spec.regs_producer, spec.regs_qk, spec.regs_pv) == (40, 248, 216)      # serial's budget
    assert fsa.spec_for(128, 576, torch.bfloat16, schedule="serial_lean") == spec
    assert fsa.spec_for(64, 512, torch.bfloat16, schedule="serial") == SparseAttnFwdSpec(
        arch="sm_90a", num_heads=64, d_qk=512)
    src = render(spec)
    compile(src, "kernel.py", "exec")
    assert "ntiles = cutlass.max(ntiles, Int32(1))" in src and "StMatrix8x8x16bOp" in src
    assert "PipelineCpAsync" in src and "BAR_P0" in src                          # serial's ring and hand-off
    serial = render(SparseAttnFwdSpec(arch="sm_90a"))
    assert "serial_lean" not in serial and "tree_reduce" not in serial and "StMatrix" not in serial


@pytest.mark.compile
@pytest.mark.parametrize("spec", [SparseAttnFwdSpec(arch="sm_90a", **LEAN),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512, **LEAN),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, dtype="float16", **LEAN),
                                  SparseAttnFwdSpec(arch="sm_90a", ablate="no_gather", **LEAN)],
                         ids=lambda s: s.name())
def test_serial_lean_compiles_to_the_designed_sass(spec, tmp_path):
    """WG1 issues QK^T(t+1) right behind P V_L(t) with no wait between them and waits with wait_group(1) (the
    pipelined loop) or 0 (prologue QK^T, peeled last tile); row maxima by FMNMX, no NaN-propagating FSETP/FSEL
    max chain; P packed once (the RS operand registers are the stmatrix source) and stored with 4 STSM per tile."""
    rec, sass, ops = _compiled_sass(spec, tmp_path)
    assert _smem_fits(rec)
    t = r"\.BF16" if spec.dtype == "bfloat16" else ""
    ks = spec.d_qk // 16
    assert len(re.findall(rf"HGMMA\.64x64x16\.F32{t} ", sass)) == 2 * ks            # prologue + loop QK^T
    rs = re.findall(rf"HGMMA\.64x256x16\.F32{t} R\d+, (R\d+), gdesc\[UR\d+\]\.tnspB", sass)
    assert len(rs) == 8                                                             # loop + last tile P V_L
    assert len(re.findall(rf"HGMMA\.64x256x16\.F32{t} R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 4   # WG2 P V_R
    assert ops["STSM"] == 8
    stsm_src = re.findall(r"STSM\.16\.M88\.4 \[R\d+\], (R\d+)", sass)
    assert set(stsm_src) == set(rs), (stsm_src, rs)                   # P packed once: same registers
    # no wgmma serialisation: loop: wait<0> (S ready), wait<1> after QK^T(t+1); tail: wait<0> x2; WG2: wait<0>
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 4
    lines = sass.splitlines()
    i_pv = [i for i, l in enumerate(lines) if re.search(rf"HGMMA\.64x256x16\.F32{t} R\d+, R\d+, gdesc.*gsb0", l)][0]
    i_qk = [i for i, l in enumerate(lines) if i > i_pv and re.search(rf"HGMMA\.64x64x16\.F32{t} ", l)][0]
    assert not any("DEPBAR" in l for l in lines[i_pv:i_qk]), "a wait between P V_L(t) and QK^T(t+1)"
    assert ops["FMNMX"] >= 2 * 2 * 16 and ops["FSETP"] <= 16      # serial: ~74 FSETP in one softmax alone
    if not spec.ablate:
        # producer: a tile's ids are loaded a tile ahead: no id LDG between a stage wait and the gather it guards
        prod = sass[sass.index("USETMAXREG.DEALLOC"):sass.index("USETMAXREG.TRY_ALLOC")]
        waits = [m.end() for m in re.finditer(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT", prod)]
        assert waits
        for w in waits:
            nxt = prod.find("LDGSTS", w)
            assert nxt < 0 or "LDG.E" not in prod[w:nxt], "id loads after the stage wait"
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"


def test_split_halves_grid_choice(monkeypatch):
    """fused_sa.GRID picks the most CTAs a split_halves launch uses (the kernel's n_ctas; its grid is
    min(items, n_ctas)): None -> the kernel heads' DEFAULT_GRID, "items" -> one CTA per item, an int -> that many;
    anything else is refused. ("persistent" reads the device's SM count: GPU tests.)"""
    import torch

    import dsagen.fused.sparse_attention as fsa

    cpu = torch.device("cpu")
    assert fsa.GRID is None and fsa.DEFAULT_GRID == {128: "persistent", 64: "persistent"}
    monkeypatch.setattr(fsa, "DEFAULT_GRID", {128: "persistent", 64: "items"})
    assert fsa._grid_ctas(cpu, 64) == 2**31 - 1
    monkeypatch.setattr(fsa, "GRID", 7)
    assert fsa._grid_ctas(cpu, 128) == 7
    monkeypatch.setattr(fsa, "GRID", "items")
    assert fsa._grid_ctas(cpu, 128) == 2**31 - 1
    for bad in (0, -3, True, "all", 2.5):
        monkeypatch.setattr(fsa, "GRID", bad)
        with pytest.raises(ValueError, match="GRID"):
            fsa._grid_ctas(cpu, 64)


def _ptxas_wgmma_serialisation(spec, tmp_path) -> list[str]:
    """ptxas -v's "wgmma.mma_async instructions are serialized" messages (C7514 / C7515: every wgmma of the kernel
    then waits for the previous one) for `spec`'s PTX, from the CUDA toolkit's ptxas. The DSL's PTX declares a newer
    .version than a CUDA 13.0 ptxas reads; its instructions are not newer, so the line is rewritten. Skips without
    a ptxas that assembles it."""
    import shutil
    import subprocess

    from dsagen.gen.build import compile_module

    ptxas = shutil.which("ptxas") or next((p for p in ("/usr/local/cuda/bin/ptxas", "/usr/local/cuda-13.0/bin/ptxas")
                                           if os.path.exists(p)), None)
    if ptxas is None:
        pytest.skip("no ptxas")
    compile_module(spec, render(spec), tmp_path)
    ptx = sorted(tmp_path.rglob("*.ptx"))
    if not ptx:
        pytest.skip("the build kept no PTX")
    src = tmp_path / "k.ptx"
    src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx[0].read_text(), count=1, flags=re.M))
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"ptxas could not assemble the PTX: {r.stderr.strip()[:200]}")
    return [line for line in (r.stdout + r.stderr).splitlines() if "C7514" in line or "C7515" in line]


@pytest.mark.compile
@pytest.mark.parametrize("fields", [dict(), dict(num_heads=64, d_qk=512)], ids=["h128_d576", "h64_d512"])
def test_split_halves_wgmma_not_serialised(fields, tmp_path):
    """The op's split_halves kernels keep their wgmmas asynchronous: no non-wgmma instruction
    touches an accumulator register while a wgmma is in flight, and no wgmma is in flight where a branch merges
    (measured 2026-11-29: a violation made ptxas serialise every wgmma, 0.73-0.81x)."""
    from dsagen.spec.families.sparse_attention import op_spec_fields

    spec = SparseAttnFwdSpec(arch="sm_90a", **{**op_spec_fields("split_halves"), **fields})
    assert _ptxas_wgmma_serialisation(spec, tmp_path) == []
