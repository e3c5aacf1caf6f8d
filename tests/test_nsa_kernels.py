"""CPU tests of the NSA kernel family (dsagen/kernels/nsa): spec checks, the binding, the shared-memory estimate
against the compiled kernel's, the SASS of the selected-branch forward (wgmmas not serialized, no spills), and the
host's reasons for inputs the kernel does not cover."""

from __future__ import annotations

import re

import pytest
import torch

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.nsa import host as nsa_host
from dsagen.kernels.nsa.spec import NsaSelectFwdSpec, item_tokens, select_fwd_spec_for
from dsagen.spec import SpecError

try:
    from dsagen.kernels.nsa.select_fwd_sm90 import REGS_CONSUMER, SMEM_2_CTAS
except ImportError:                         # no CuTe-DSL: the compile tests skip
    REGS_CONSUMER = SMEM_2_CTAS = None


@pytest.mark.parametrize("kw,needle", [
    (dict(group=3), "group=3 must be one of"),
    (dict(group=128), "group=128 must be one of"),
    (dict(head_dim=96), "head_dim=96 must be one of (64, 128)"),
    (dict(v_dim=256), "v_dim=256 must be one of (64, 128)"),
    (dict(block_size=16), "block_size=16 must be one of (32, 64, 128)"),
    (dict(max_slots=0), "max_slots=0 must be in 1..64"),
    (dict(max_slots=65), "max_slots=65 must be in 1..64"),
    (dict(dtype="float32"), "dtype='float32' must be"),
    (dict(stages=1), "stages=1 must be in 2..4"),
    (dict(block_size=128, stages=4), "needs"),
    (dict(arch="sm_100a"), "sm_90a only"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        NsaSelectFwdSpec(**{"arch": "sm_90a", **kw}).check()


def test_item_tokens_and_op_spec():
    """64 rows per item: 64 // G tokens, at most 16 (G < 4 pads); the op rounds the slots up to 16."""
    assert [item_tokens(g) for g in (1, 2, 4, 8, 16, 32, 64)] == [16, 16, 16, 8, 4, 2, 1]
    assert select_fwd_spec_for(16, 128, 128, 64, 5, "bfloat16", "sm_90a").max_slots == 16
    assert select_fwd_spec_for(16, 128, 128, 64, 17, "bfloat16", "sm_90a").max_slots == 32
    assert select_fwd_spec_for(16, 128, 128, 64, 64, "bfloat16", "sm_90a").max_slots == 64


def test_binding():
    spec = NsaSelectFwdSpec(arch="sm_90a")
    src = render(spec)
    compile(src, "kernel.py", "exec")
    assert 'build(16, 128, 128, 64,\n                                                16, "bfloat16", 2)' in src
    assert "dsagen.kernels.nsa.select_fwd_sm90" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("spec", [NsaSelectFwdSpec(arch="sm_90a"),
                                  NsaSelectFwdSpec(arch="sm_90a", group=1, v_dim=64, block_size=32),
                                  NsaSelectFwdSpec(arch="sm_90a", group=4, block_size=128, max_slots=32)],
                         ids=["g16", "g1_dv64_b32", "g4_b128_s32"])
def test_compiles_without_spills(spec, tmp_path):
    """S (D / 16 steps) and PV (block_size / 16 steps, P from registers, V transposed) each issued at two places
    (the first entry, then the loop that issues the next entry's S before this entry's PV), waited as groups: the
    first S, the next S with this PV in flight (gsb0 0x1), this PV, the last PV; no serialization, no local memory;
    the smem estimate is the kernel's."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1]
    assert ck.record["launch"]["smem"] == spec.smem_bytes()
    # setmaxnreg moves registers within the CTA's pool (what the launch gave its 256 threads): the producer's 40 and
    # the consumer's count must fit in it, or the consumer's increase waits forever
    ctas = 2 if spec.smem_bytes() <= SMEM_2_CTAS else 1
    assert 128 * (40 + REGS_CONSUMER[ctas]) <= ck.record["regcount"] * 256 <= 65536 // ctas
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    s_steps, pv_steps = spec.head_dim // 16, spec.block_size // 16
    assert len(re.findall(rf"HGMMA\.64x{spec.block_size}x16\.F32\.BF16 R\d+, gdesc", sass)) == 2 * s_steps
    pv = rf"HGMMA\.64x{spec.v_dim}x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB"
    assert len(re.findall(pv, sass)) == 2 * pv_steps
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass) == ["0x0", "0x1", "0x0", "0x0"]
    assert not re.findall(r"\b(LDL|STL)\b", sass)


def test_unsupported_inputs_name_the_reason():
    """Checked before any device query: dtype, group, head dims, block size, slot count."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype)
    q, k, v = t(1, 8, 16, 128), t(1, 8, 4, 128), t(1, 8, 4, 128)
    assert "bfloat16 or float16" in nsa_host._unsupported(q.float(), k.float(), v.float(), 16, 64)
    assert "HQ / H = 3" in nsa_host._unsupported(t(1, 8, 12, 128), k, v, 16, 64)
    assert "head dims D = 96" in nsa_host._unsupported(t(1, 8, 16, 96), t(1, 8, 4, 96), v, 16, 64)
    assert "block_size=16" in nsa_host._unsupported(q, k, v, 16, 16)
    assert "65 selected blocks" in nsa_host._unsupported(q, k, v, 65, 64)
