"""CPU tests of the fused indexer_scores: the dense_scores form of the lightning indexer's score kernel and the mask /
LSE kernel (specs, config, renders, ABI), the host's launch split, the op's argument checks, and (marked `compile`)
cross-compilation for sm_90a with SASS checks."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.jit.render import render
from dsagen.kernels.lightning_indexer.scores_host import check_supported, launch_ranges
from dsagen.kernels.lightning_indexer.spec import (IndexerScoreSpec, IndexerScoresMaskSpec, config_for,
                                                   scores_config_for)
from dsagen.spec import SpecError

ARCH = "sm_90a"


def test_config_is_the_lightning_indexers_score_kernel_in_dense_form():
    cfg = scores_config_for(64, 128, "bfloat16", ARCH)
    li = config_for(64, 128, "bfloat16", ARCH)
    assert cfg.score == IndexerScoreSpec(arch=ARCH, num_heads=64, head_dim=128, dtype="bfloat16", stages=4,
                                         dense_scores=True, longest_first=True)
    fp8 = scores_config_for(64, 128, "float8_e4m3fn", ARCH).score
    assert (fp8.consumers, fp8.longest_first, fp8.q_tiles) == (4, True, 2)
    assert cfg.score.stages == li.score.stages and cfg.chunk_rows == li.chunk_rows
    assert cfg.launch_rows == 8192 and cfg.launch_rows % 128 == 0
    assert cfg.specs() == (cfg.score, cfg.mask) and cfg.mask == IndexerScoresMaskSpec(arch=ARCH, threads=256)
    assert cfg.score.name() == "lightning_indexer_score_dense_scores1_longest_first1_sm_90a"
    assert li.score.name() == "lightning_indexer_score_sm_90a"          # the default spec keeps its name
    assert scores_config_for(64, 128, "bfloat16", ARCH) is cfg


def test_mask_spec_validation():
    assert IndexerScoresMaskSpec(arch=ARCH).can_implement() == (True, "")
    for bad in (32, 100, 2048):
        with pytest.raises(SpecError, match="threads"):
            IndexerScoresMaskSpec(arch=ARCH, threads=bad).check()
    with pytest.raises(SpecError, match="sm_90a only"):
        IndexerScoresMaskSpec(arch="sm_100a").check()


def test_templates_render():
    src = render(scores_config_for(32, 64, "float16", ARCH).score)
    assert "DENSE_SCORES = True\n" in src and "H = 32\n" in src and "D = 64\n" in src
    src = render(IndexerScoresMaskSpec(arch=ARCH, threads=512))
    assert "THREADS = 512\n" in src
    assert "from dsagen.kernels.lightning_indexer.mask_lse_sm90 import build" in src
    assert "PARAMS, LAUNCH, kernel, host = build(THREADS)" in src


def test_dense_score_kernel_abi():
    """dense_scores adds q_off (int32 pointer), has_off and fill (the filler warp's switch) after the lightning
    indexer's params, and the slab's declared alignment drops to 4 bytes (rows of the caller's matrix); everything
    else is the default kernel's."""
    from dsagen.kernels.lightning_indexer import score_sm90

    _, _, params, host_args, launch = score_sm90.build(64, 128, "bfloat16", 4, True)
    _, _, base, base_host, base_launch = score_sm90.build(64, 128, "bfloat16", 4)
    assert params[-3:] == [{"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},
                           {"name": "has_off", "kind": "i32"}, {"name": "fill", "kind": "i32"}]
    slab = next(p for p in params if p["name"] == "slab")
    assert slab["align"] == 4 and next(p for p in base if p["name"] == "slab")["align"] == 16
    assert [p for p in params[:-3] if p["name"] != "slab"] == [p for p in base if p["name"] != "slab"]
    assert host_args[8:] == params[2:] and base_host[8:] == base[2:]
    assert launch == base_launch


def test_mask_kernel_abi():
    from dsagen.kernels.lightning_indexer import mask_lse_sm90

    built = mask_lse_sm90.build(256)
    assert [p["name"] for p in built.params] == ["out", "lse", "cu_q", "cu_k", "q_off", "n_docs", "T", "S", "rows",
                                                 "width", "ratio", "has_off", "want_lse", "fill", "n_ctas",
                                                 "ld"]
    assert built.launch["grid"] == ["min(rows, n_ctas)", 1, 1] and built.launch["block"] == [256, 1, 1]
    assert built.params[0]["align"] == 4 and built.params[1]["align"] == 4


@pytest.mark.parametrize("b,sq,qc,per", [(3, 7, 2, 2), (2, 8, 2, 3), (1, 5, 16, 1), (4, 1, 1, 1), (2, 9, 16, 4),
                                         (5, 1024, 2, 512)])
def test_launch_ranges_map_rows(b, sq, qc, per):
    """Every token of every batch element lands on its output row b * S_q + t, once (the host's launch split); a
    launch never spans a batch boundary unless qc divides S_q."""
    rows = []
    n_tblk = -(-sq // qc)
    for blk0, nblk, row0 in launch_ranges(b, sq, qc, per):
        assert 1 <= nblk <= per
        if sq % qc:
            assert blk0 // n_tblk == (blk0 + nblk - 1) // n_tblk
        for blk in range(blk0, blk0 + nblk):
            for j in range(qc):
                t = (blk % n_tblk) * qc + j
                if t < sq:
                    assert row0 + (blk - blk0) * qc + j == (blk // n_tblk) * sq + t
                    rows.append(row0 + (blk - blk0) * qc + j)
    assert sorted(rows) == list(range(b * sq))


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def test_fused_limits():
    """check_supported (shape / dtype only, so also under torch.compile): ValueError naming the argument."""
    check_supported(_t(1, 4, 64, 128), _t(1, 4, 128), _t(1, 4, 64), False)
    check_supported(_t(4, 8, 64), _t(4, 64), _t(4, 8), True)
    with pytest.raises(ValueError, match="q_indexer in bfloat16 or float16"):
        check_supported(_t(1, 4, 64, 128, dtype=torch.float32), _t(1, 4, 128), _t(1, 4, 64), False)
    with pytest.raises(ValueError, match="weights in q_indexer's dtype"):
        check_supported(_t(1, 4, 64, 128), _t(1, 4, 128), _t(1, 4, 64, dtype=torch.float32), False)
    with pytest.raises(ValueError, match="heads H in"):
        check_supported(_t(1, 4, 12, 128), _t(1, 4, 128), _t(1, 4, 12), False)
    with pytest.raises(ValueError, match="head dim D in"):
        check_supported(_t(1, 4, 64, 96), _t(1, 4, 96), _t(1, 4, 64), False)
    big = torch.empty((1, 2**20 + 1, 8, 64), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="S_q <= 2\\*\\*20"):
        check_supported(big, _t(1, 4, 64), torch.empty((1, 2**20 + 1, 8), dtype=torch.bfloat16, device="meta"),
                        False)
    with pytest.raises(ValueError, match="total_k <= 2\\*\\*20"):
        check_supported(_t(4, 8, 64), torch.empty((2**20 + 1, 64), dtype=torch.bfloat16, device="meta"), _t(4, 8),
                        True)


def test_op_arguments():
    """out / lse_out: shape, dtype, contiguity and lse_out without return_lse, named in the errors (reference)."""
    q, k, w = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 8), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="out must have shape"):
        dsagen.indexer_scores(q, k, w, out=torch.empty(2, 5, 6), impl="reference")
    with pytest.raises(TypeError, match="out must have dtype"):
        dsagen.indexer_scores(q, k, w, out=torch.empty(2, 5, 7, dtype=torch.float64), impl="reference")
    with pytest.raises(ValueError, match="out must be contiguous"):
        dsagen.indexer_scores(q, k, w, out=torch.empty(2, 7, 5).transpose(1, 2), impl="reference")
    with pytest.raises(ValueError, match="lse_out is given but return_lse is False"):
        dsagen.indexer_scores(q, k, w, lse_out=torch.empty(2, 5), impl="reference")
    with pytest.raises(ValueError, match="lse_out must have shape"):
        dsagen.indexer_scores(q, k, w, return_lse=True, lse_out=torch.empty(2, 7), impl="reference")
    with pytest.raises(TypeError, match="return_lse"):
        dsagen.indexer_scores(q, k, w, return_lse=1, impl="reference")
    with pytest.raises(ValueError, match="impl='fused' runs generated CUDA kernels"):
        dsagen.indexer_scores(q.bfloat16(), k.bfloat16(), w.bfloat16())


@pytest.mark.parametrize("packed", [False, True])
def test_reference_lse_and_outputs(packed):
    """The reference path: lse = logsumexp over the valid columns (-inf for empty rows: a negative offset, rows
    after the last THD offset), written into the caller's buffers when given."""
    gen = torch.Generator().manual_seed(1)
    kw = dict(ratio=2, q_causal_offsets=torch.tensor([-4, 3], dtype=torch.int32))
    if packed:
        q, k, w = torch.randn(9, 4, 8, generator=gen), torch.randn(8, 8, generator=gen), torch.randn(9, 4, generator=gen)
        kw.update(cu_seqlens_q=torch.tensor([0, 3, 7]), cu_seqlens_k=torch.tensor([0, 5, 8]))
        shape, lshape = (9, 5), (9,)
    else:
        q, k, w = (torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 7, 8, generator=gen),
                   torch.randn(2, 5, 4, generator=gen))
        shape, lshape = (2, 5, 7), (2, 5)
    scores, lse = dsagen.indexer_scores(q, k, w, return_lse=True, impl="reference", **kw)
    assert scores.shape == shape and lse.shape == lshape
    valid = ~torch.isneginf(scores)
    assert torch.equal(torch.isneginf(lse), ~valid.any(-1)) and (~valid.any(-1)).any()
    want = torch.where(valid, scores, torch.zeros(())).exp().mul(valid).sum(-1).log()
    assert torch.allclose(lse[valid.any(-1)], want[valid.any(-1)])
    out, lse_out = torch.full(shape, float("nan")), torch.full(lshape, float("nan"))
    got = dsagen.indexer_scores(q, k, w, return_lse=True, out=out, lse_out=lse_out, impl="reference", **kw)
    assert got[0] is out and got[1] is lse_out and torch.equal(out, scores) and torch.equal(lse_out, lse)


def _sass(cubin: bytes) -> str:
    from dsagen.jit.sass import disassemble, find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return disassemble(cubin)


@pytest.mark.compile
@pytest.mark.parametrize("h,d", [(64, 128), (8, 64)])
def test_dense_score_kernel_keeps_the_pingpong_sass(h, d, tmp_path):
    """The dense_scores form: the same D/16 HGMMA.64x128x16 issued back to back and waited once, setmaxnreg 40 / 152,
    no spills (the offsets only add a load and 64-bit arithmetic in the scheduler warp)."""
    import re

    from dsagen.jit.build import compile_module

    spec = scores_config_for(h, d, "bfloat16", ARCH).score
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin)
    assert sass.count("HGMMA.64x128x16") == d // 16
    assert sass.count("WARPGROUP.DEPBAR") == 1, "wgmma serialized by ptxas"
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    assert " CALL" not in sass, "a subroutine call (64-bit division?) in a setmaxnreg kernel"
    budgets = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == [0x28, 0x98], budgets
    assert ck.record["launch"]["block"] == [512, 1, 1] and ck.record["launch"]["smem"] <= 227 * 1024


@pytest.mark.compile
def test_mask_kernel_compiles(tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import opcode_counts

    spec = IndexerScoresMaskSpec(arch=ARCH)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    ops = dict(opcode_counts(_sass(ck.cubin)))
    assert ops.get("MUFU", 0) > 0 and ops.get("SHFL", 0) > 0 and ops.get("BAR", 0) > 0, ops
    assert not ops.get("LDL") and not ops.get("STL"), f"register spills: {ops}"
    assert not ops.get("CALL"), f"a subroutine call (64-bit division?): {ops}"
    assert ck.record["launch"]["block"] == [256, 1, 1]


@pytest.mark.compile
def test_fp8_score_kernel_uses_qgmma(tmp_path):
    """The FP8 dense_scores form: D/32 QGMMA.64x128x32 E4M3 x E4M3 for the scores, then the head sum as 128/16
    HGMMA.64x8x16 bf16 wgmmas whose A operand is ReLU(S) packed by F2FP.RELU (no FMNMX / FFMA epilogue); each
    product waited once (ptxas did not serialize the wgmmas), the k descales staged by cp.async (LDGSTS), no
    spills."""
    from dsagen.jit.build import compile_module

    spec = scores_config_for(64, 128, "float8_e4m3fn", ARCH).score
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin)
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 128 // 32
    assert sass.count("HGMMA.64x8x16.F32.BF16") == 128 // 16
    assert sass.count("F2FP.RELU.BF16.F32.PACK_AB") == 32
    assert "FFMA" not in sass
    assert sass.count("WARPGROUP.DEPBAR") == 2, "wgmma serialized by ptxas"
    assert "LDGSTS" in sass
    assert " LDL" not in sass and " STL" not in sass, "register spills"


def test_fp8_score_kernel_with_four_consumer_warpgroups(tmp_path):
    """consumers=4 (FP8 only): 640 threads, setmaxnreg 40 / 104, no spills, the same products per tile; the other
    dtypes refuse it, as they refuse other counts. setmaxnreg moves registers inside the CTA's pool (what the launch
    gave every thread), so 128 * (40 + 4 * 104) must fit in 640 x the launch's count (96), else the consumers'
    increase waits forever: 112 did (61440 registers, 62464 asked)."""
    import dataclasses
    import re

    from dsagen.jit.build import compile_module
    from dsagen.kernels.lightning_indexer.spec import IndexerScoreSpec

    spec = dataclasses.replace(scores_config_for(64, 128, "float8_e4m3fn", ARCH).score, consumers=4)
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin)
    assert ck.record["launch"]["block"] == [640, 1, 1]
    regs = sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert regs == [40, 104]
    assert 128 * (regs[0] + 4 * regs[1]) <= 640 * ck.record["regcount"], (regs, ck.record["regcount"])
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 4 and sass.count("HGMMA.64x8x16.F32.BF16") == 8
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    assert "consumers=4 needs dtype" in IndexerScoreSpec(arch=ARCH, dense_scores=True, consumers=4).can_implement()[1]
    assert "consumers=2 must be 3 or 4" in IndexerScoreSpec(arch=ARCH, consumers=2).can_implement()[1]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_longest_first_changes_only_the_scheduler(dtype, tmp_path):
    """longest_first (the snake over the CTAs in reverse item order): the consumers' products, waits and budgets of
    the default form, no spills and no subroutine call (its divisions are 32-bit); the field is in the kernel's
    name."""
    import dataclasses
    import re

    from dsagen.jit.build import compile_module

    base = dataclasses.replace(scores_config_for(64, 128, dtype, ARCH).score, longest_first=False)
    spec = dataclasses.replace(base, longest_first=True)
    assert "longest_first1" in spec.name() and "longest_first" not in base.name()
    sass = _sass(compile_module(spec, render(spec), tmp_path / "lf").cubin)
    ref = _sass(compile_module(base, render(base), tmp_path / "base").cubin)
    for op in ("HGMMA.64x128x16", "QGMMA.64x128x32", "HGMMA.64x8x16", "WARPGROUP.DEPBAR", "F2FP.RELU"):
        assert sass.count(op) == ref.count(op), op
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    assert " CALL" not in sass, "a subroutine call in a setmaxnreg kernel"
    budgets = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", sass))
    assert budgets == sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", ref))


@pytest.mark.compile
def test_fp8_two_q_tiles_per_item(tmp_path):
    """q_tiles=2 (FP8, 4 consumers): each consumer still issues D/32 QGMMA and the 8 head-sum HGMMA per tile, each
    waited once, no spills; 2 Q tiles and 2 head-sum B matrices per item slot in shared memory; the host's token
    blocks are item_tokens (4 tokens at H 64); the spec refuses it elsewhere and the slab pipeline refuses it."""
    import dataclasses

    from dsagen.jit.build import compile_module
    from dsagen.kernels.lightning_indexer.spec import forward_topk_config_for, item_tokens

    spec = scores_config_for(64, 128, "float8_e4m3fn", ARCH).score
    base = dataclasses.replace(spec, q_tiles=1)
    assert spec.q_tiles == 2 and item_tokens(spec) == 4 and item_tokens(base) == 2
    ck = compile_module(spec, render(spec), tmp_path / "build")
    sass = _sass(ck.cubin)
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 4 and sass.count("HGMMA.64x8x16.F32.BF16") == 8
    assert sass.count("WARPGROUP.DEPBAR") == 2, "wgmma serialized by ptxas"
    assert " LDL" not in sass and " STL" not in sass, "register spills"
    base_smem = compile_module(base, render(base), tmp_path / "base").record["launch"]["smem"]
    # per item slot one more Q tile (128 x 128 bytes), head-sum B (8 x 128 bf16) and 128 fp32 weights
    assert ck.record["launch"]["smem"] == base_smem + 2 * (128 * 128 + 8 * 128 * 2 + 128 * 4)
    bf16 = dataclasses.replace(scores_config_for(64, 128, "bfloat16", ARCH).score, q_tiles=2)
    assert "q_tiles=2 needs dtype" in bf16.can_implement()[1]
    assert "q_tiles=3 must be 1 or 2" in dataclasses.replace(base, q_tiles=3).can_implement()[1]
    cfg = forward_topk_config_for(64, 128, "float8_e4m3fn", ARCH)
    with pytest.raises(ValueError, match="q_tiles=2"):
        dataclasses.replace(cfg, score=spec)


def test_fp8_kscale_rows_match_the_host_limit(monkeypatch):
    """The FP8 score kernel stages FP8_KSCALE_ROWS k descales per item slot; the host refuses configs with longer
    work items (spec.FP8_MAX_CHUNK_ROWS) before loading anything."""
    import dataclasses

    import torch

    from dsagen.kernels.lightning_indexer import host, score_sm90
    from dsagen.kernels.lightning_indexer.spec import FP8_MAX_CHUNK_ROWS

    assert score_sm90.FP8_KSCALE_ROWS == FP8_MAX_CHUNK_ROWS
    cfg = dataclasses.replace(scores_config_for(64, 128, "float8_e4m3fn", ARCH), chunk_rows=2 * FP8_MAX_CHUNK_ROWS)
    monkeypatch.setattr(host, "device_arch", lambda index: ARCH)      # no GPU here: only the config checks run
    loads = []
    with pytest.raises(ValueError, match=f"chunk_rows={2 * FP8_MAX_CHUNK_ROWS}"):
        host.loaded_kernels({}, "indexer_scores", 0, 64, 128, torch.float8_e4m3fn, "float8_e4m3fn", cfg, None,
                            lambda c, i: loads.append(c))
    assert loads == []


def test_fp8_spec_limits():
    from dsagen.kernels.lightning_indexer.spec import IndexerScoreSpec

    ok = IndexerScoreSpec(arch=ARCH, num_heads=64, head_dim=128, dtype="float8_e4m3fn", dense_scores=True)
    assert ok.can_implement() == (True, "")
    assert ok.smem_bytes() < IndexerScoreSpec(arch=ARCH, dense_scores=True).smem_bytes()
    bad = IndexerScoreSpec(arch=ARCH, num_heads=64, head_dim=64, dtype="float8_e4m3fn", dense_scores=False)
    msg = bad.can_implement()[1]
    assert "dense_scores=True" in msg and "head_dim=128" in msg
    h8 = IndexerScoreSpec(arch=ARCH, num_heads=8, head_dim=128, dtype="float8_e4m3fn", dense_scores=True)
    assert "num_heads in (16, 32, 64, 128)" in h8.can_implement()[1]     # the head sum's 8 token columns


def test_fp8_fused_path_refuses_8_heads():
    """H = 8 puts 16 tokens in a tile, more than the FP8 kernel's tensor-core head sum holds: the fused path's
    shape check refuses it (a ValueError naming the heads) before anything runs."""
    from dsagen.kernels.lightning_indexer.scores_host import check_supported

    q = torch.zeros(1, 4, 8, 128).to(torch.float8_e4m3fn)
    k = torch.zeros(1, 5, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 indexer_scores supports q_indexer heads H in"):
        check_supported(q, k, torch.zeros(1, 4, 8), packed=False)
    check_supported(torch.zeros(1, 4, 16, 128).to(torch.float8_e4m3fn), k, torch.zeros(1, 4, 16), packed=False)


def test_fp8_arguments_are_validated():
    import dsagen

    q = torch.zeros(1, 4, 64, 128).to(torch.float8_e4m3fn)
    k = torch.zeros(1, 5, 128).to(torch.float8_e4m3fn)
    w, qs, ks = torch.zeros(1, 4, 64), torch.ones(1, 4, 64), torch.ones(1, 5)
    ref = dict(impl="reference")
    with pytest.raises(ValueError, match="q_scale"):
        dsagen.indexer_scores(q, k, w, precision="fp8", k_scale=ks, **ref)
    with pytest.raises(ValueError, match="precision='fp8'"):
        dsagen.indexer_scores(q.float(), k.float(), w, q_scale=qs, k_scale=ks, **ref)
    with pytest.raises(ValueError, match="precision"):
        dsagen.indexer_scores(q, k, w, precision="int8", q_scale=qs, k_scale=ks, **ref)
    with pytest.raises(ValueError, match="k_scale"):
        dsagen.indexer_scores(q, k, w, precision="fp8", q_scale=qs, k_scale=ks[:, :4], **ref)
    with pytest.raises(TypeError, match="q_scale"):
        dsagen.indexer_scores(q, k, w, precision="fp8", q_scale=qs.double(), k_scale=ks, **ref)
    with pytest.raises(TypeError, match="weights"):
        dsagen.indexer_scores(q, k, w.half(), precision="fp8", q_scale=qs, k_scale=ks, **ref)
    with pytest.raises(TypeError, match="q_indexer"):
        dsagen.indexer_scores(q.float(), k, w, precision="fp8", q_scale=qs, k_scale=ks, **ref)


def test_fp8_reference_is_the_unfactored_formula():
    import dsagen

    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 9, 16, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    k = (torch.randn(2, 11, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    w = torch.randn(2, 9, 16, generator=gen)
    qs, ks = torch.rand(2, 9, 16, generator=gen) + 0.1, torch.rand(2, 11, generator=gen) + 0.1
    got = dsagen.indexer_scores(q, k, w, ratio=1, precision="fp8", q_scale=qs, k_scale=ks, impl="reference")
    dot = torch.einsum("bthd,bsd->bths", q.double(), k.double())
    want = (w.double()[..., None] * torch.relu(qs.double()[..., None] * ks.double()[:, None, None] * dot)).sum(2)
    valid = ~torch.isneginf(got)
    assert torch.allclose(got.double()[valid], want[valid], rtol=1e-5, atol=1e-5)
