"""CPU tests of the QSA kernel family (dsagen/kernels/qsa): spec checks, the binding, the shared-memory size
against the compiled kernel's, the SASS of the indexed forward (wgmmas not serialized, no spills), the host's reasons
for inputs the kernel does not cover, and the preset."""

from __future__ import annotations

import re

import pytest
import torch

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.qsa import host as qsa_host
from dsagen.kernels.qsa.spec import SMEM_LIMIT, QsaFwdSpec, spec_for
from dsagen.spec import SpecError, get_preset


@pytest.mark.parametrize("kw,needle", [
    (dict(group=0), "group=0 must be in 1..64"),
    (dict(group=65), "group=65 must be in 1..64"),
    (dict(head_dim=96), "head_dim=96 must be one of (64, 128, 256)"),
    (dict(v_dim=512), "v_dim=512 must be one of (64, 128, 256)"),
    (dict(dtype="float32"), "dtype='float32' must be"),
    (dict(stages=4), "stages=4 must be 2 or 3"),
    (dict(arch="sm_100a"), "sm_90a only"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        QsaFwdSpec(**{"arch": "sm_90a", **kw}).check()


def test_stages_fit_the_shared_memory():
    """Three stages where they fit (D = Dv = 256 just does), every spec_for within the limit."""
    assert spec_for(12, 256, 256, "bfloat16", "sm_90a").stages == 3
    for d in (64, 128, 256):
        for dv in (64, 128, 256):
            spec = spec_for(4, d, dv, "float16", "sm_90a").check()
            assert spec.smem_bytes() <= SMEM_LIMIT


def test_binding():
    spec = QsaFwdSpec(arch="sm_90a")
    src = render(spec)
    compile(src, "kernel.py", "exec")
    assert re.search(r'build\(12, 256, 256, "bfloat16", 2,\s+False\)', src)
    assert "True)" in render(QsaFwdSpec(arch="sm_90a", bitmap=True))
    assert "dsagen.kernels.qsa.fwd_sm90" in helper_modules(src)


def test_preset():
    """Serving: both forms' forward; training adds both forms' backward (dq, dk / dv) at two stages."""
    want = [spec_for(12, 256, 256, "bfloat16", "sm_90a", bitmap=b) for b in (False, True)]
    assert get_preset("qsa", "sm_90a", serving=True) == want
    full = get_preset("qsa", "sm_90a")
    assert full[:2] == want
    assert [(s.op, s.bitmap, s.stages) for s in full[2:]] == [("qsa_dq", False, 2), ("qsa_dkv", False, 2),
                                                              ("qsa_dq", True, 2), ("qsa_dkv", True, 2)]
    assert get_preset("qsa", "sm_100a") == []


@pytest.mark.compile
@pytest.mark.parametrize("spec", [spec_for(12, 256, 256, "bfloat16", "sm_90a"), QsaFwdSpec(arch="sm_90a"),
                                  spec_for(4, 128, 64, "float16", "sm_90a"),
                                  spec_for(12, 256, 256, "bfloat16", "sm_90a", bitmap=True)],
                         ids=["g12_st3", "g12_st2", "g4_fp16", "g12_bitmap"])
def test_compiles_without_spills(spec, tmp_path):
    """S (D / 16 steps) and PV (4 steps, P from registers, V transposed) each issued at two places (the first tile,
    then the loop that issues the next tile's S before this tile's PV), waited as groups: the first S, the next S
    with this PV in flight (gsb0 0x1), this PV, the last PV; no local memory; the smem size is the spec's."""
    from dsagen.kernels.qsa.fwd_sm90 import REGS_CONSUMER, REGS_PRODUCER

    sass = compiled_sass(spec, tmp_path, REGS_PRODUCER + REGS_CONSUMER)
    mma = "" if spec.dtype == "float16" else r"\.BF16"          # fp16 inputs print no suffix
    assert len(re.findall(rf"HGMMA\.64x64x16\.F32{mma} R\d+, gdesc", sass)) == 2 * (spec.head_dim // 16)
    pv = rf"HGMMA\.64x{spec.v_dim}x16\.F32{mma} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB"
    assert len(re.findall(pv, sass)) == 2 * 4
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass) == ["0x0", "0x1", "0x0", "0x0"]
    assert not re.findall(r"\b(LDL|STL)\b", sass)


def compiled_sass(spec, tmp_path, regs_split: int) -> str:
    """Compile a QSA kernel's spec into tmp_path, check its launch (256 threads, the spec's shared memory, the
    producer's and consumer's setmaxnreg counts, summing to regs_split, within the CTA's register pool: setmaxnreg
    moves registers inside it) and return its SASS; skips without nvdisasm."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1]
    assert ck.record["launch"]["smem"] == spec.smem_bytes()
    assert 128 * regs_split <= ck.record["regcount"] * 256 <= 65536
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return disassemble(ck.cubin)


def test_unsupported_inputs_name_the_reason():
    """Checked on shapes and dtypes alone (before any device query)."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype)
    k, v = t(8, 1, 256), t(8, 1, 256)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        qsa_host.check_supported(t(8, 12, 256, dtype=torch.float32), k, v)
    with pytest.raises(ValueError, match="at most 64 query heads per KV head"):
        qsa_host.check_supported(t(8, 65, 256), k, v)
    with pytest.raises(ValueError, match="head dim D in"):
        qsa_host.check_supported(t(8, 12, 96), t(8, 1, 96), v)
    with pytest.raises(ValueError, match="v head dim Dv in"):
        qsa_host.check_supported(t(8, 12, 256), k, t(8, 1, 32))
    qsa_host.check_supported(t(8, 24, 256), t(8, 2, 256), t(8, 2, 256))
