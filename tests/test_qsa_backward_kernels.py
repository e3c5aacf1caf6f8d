"""CPU tests of the QSA backward (dsagen/kernels/qsa: QsaDqSpec, QsaDkvSpec, host.backward): the specs' checks and
shared memory, the binding, the compiled kernels' SASS (no local memory, the wgmma shapes and waits, the 16-byte
atomics of dk / dv), the host's errors, how the outputs' gradients become dO and delta, the reference's autograd
against a dense FP64 oracle, and the fused host path's autograd (eager and torch.compile, both forms) on CPU with
stand-in kernels that do each kernel's math from exactly the arguments the host launches them with (named by the
kernels' own ABI)."""

from __future__ import annotations

import importlib.util
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

import dsagen
from dsagen.jit.render import helper_modules, render
from dsagen.kernels.qsa import host as qsa_host
from dsagen.kernels.qsa.spec import SMEM_LIMIT, QsaDkvSpec, QsaDqSpec, QsaFwdSpec, backward_specs_for
from dsagen.reference.qsa import bitmap_token_layout
from dsagen.spec import SpecError

# the oracle the GPU tests use (tests/gpu, not on the CPU tests' path)
_ORACLE = importlib.util.spec_from_file_location("qsa_grad_oracle",
                                                  Path(__file__).resolve().parent / "gpu" / "qsa_grad_oracle.py")
oracle = importlib.util.module_from_spec(_ORACLE)
_ORACLE.loader.exec_module(oracle)
dense_oracle, grads, oracle_grads = oracle.dense_oracle, oracle.grads, oracle.oracle_grads

ARCH = "sm_90a"


# ------------------------------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("cls,what", [(QsaDqSpec, "the QSA backward (dq)"), (QsaDkvSpec, "the QSA backward (dk / dv)")])
@pytest.mark.parametrize("kw,needle", [
    (dict(group=65), "group=65 must be in 1..64"),
    (dict(v_dim=96), "v_dim=96 must be one of (64, 128, 256)"),
    (dict(dtype="float32"), "dtype='float32' must be"),
    (dict(stages=4), "stages=4 must be 2 or 3"),
    (dict(stages=3), f"stages=3 needs 263168 bytes of shared memory at head_dim=256, v_dim=256; at most {SMEM_LIMIT}"),
    (dict(arch="sm_100a"), "is implemented for sm_90a only, not sm_100a"),
])
def test_invalid_backward_specs_say_why(cls, what, kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        cls(**{"arch": ARCH, **kw}).check()
    if "arch" in kw:
        assert what + " is implemented" in " ".join(cls(**{"arch": ARCH, **kw}).reasons())


def test_backward_stages_and_shared_memory():
    """The dO tile costs 2 x 64 x Dv bytes beyond the forward's: two stages at D = Dv = 256, three below."""
    for d, dv, stages in ((256, 256, 2), (128, 64, 3), (256, 128, 3), (64, 64, 3)):
        dq, dkv = backward_specs_for(4, d, dv, "float16", ARCH, bitmap=True)
        assert dq.stages == dkv.stages == stages and dq.bitmap and dkv.bitmap
        fwd = QsaFwdSpec(arch=ARCH, group=4, head_dim=d, v_dim=dv, dtype="float16", stages=stages)
        assert dq.check().smem_bytes() == dkv.check().smem_bytes() == fwd.smem_bytes() + 2 * 64 * dv <= SMEM_LIMIT
        assert (dq.op, dkv.op) == ("qsa_dq", "qsa_dkv")


@pytest.mark.parametrize("cls,module", [(QsaDqSpec, "dq_sm90"), (QsaDkvSpec, "dkv_sm90")])
def test_backward_binding(cls, module):
    src = render(cls(arch=ARCH, bitmap=True))
    compile(src, "kernel.py", "exec")
    assert f"from dsagen.kernels.qsa.{module} import build" in src
    assert re.search(r'build\(12, 256, 256, "bfloat16", 2,\s+True\)', src)
    helpers = helper_modules(src)
    for m in (module, "producer_sm90", "bwd_common_sm90"):
        assert f"dsagen.kernels.qsa.{m}" in helpers


# ------------------------------------------------------------------------------------------------- compiled SASS
_COMPILED = [backward_specs_for(12, 256, 256, "bfloat16", ARCH, bitmap=b)[i] for b in (False, True) for i in (0, 1)]
_COMPILED += list(backward_specs_for(4, 128, 64, "float16", ARCH))


@pytest.mark.compile
@pytest.mark.parametrize("spec", _COMPILED, ids=lambda s: f"{s.op}_d{s.head_dim}_{s.dtype}_bitmap{int(s.bitmap)}")
def test_backward_compiles_without_spills(spec, tmp_path):
    """dq: S and dP (D / 16 + Dv / 16 SS steps, one group) then dq += dS K (4 RS steps, K transposed), each waited;
    dk / dv: S^T and dP^T (one group), then dv_part (4 RS steps, dO transposed) and dk_part (4, Q transposed), each
    waited, with (D + Dv) / 8 16-byte FP32 atomics per tile; no local memory; the smem size is the spec's."""
    from dsagen.kernels.qsa.bwd_common_sm90 import REGS_CONSUMER, REGS_PRODUCER
    from test_qsa_kernels import compiled_sass

    sass = compiled_sass(spec, tmp_path, REGS_PRODUCER + REGS_CONSUMER)
    mma = "" if spec.dtype == "float16" else r"\.BF16"
    d, dv = spec.head_dim, spec.v_dim
    ss = re.findall(rf"HGMMA\.64x64x16\.F32{mma} R\d+, gdesc", sass)
    assert len(ss) == d // 16 + dv // 16
    rs = Counter(int(n) for n in re.findall(rf"HGMMA\.64x(\d+)x16\.F32{mma} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass))
    assert rs == (Counter({d: 4}) if spec.op == "qsa_dq" else Counter([d] * 4 + [dv] * 4))
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)
    assert waits == ["0x0"] * (2 if spec.op == "qsa_dq" else 3)
    red = re.findall(r"REDG\.E\.ADD\.F32x4", sass)
    assert len(red) == (0 if spec.op == "qsa_dq" else (d + dv) // 8)
    assert not re.findall(r"\b(LDL|STL)\b", sass)


# --------------------------------------------------------------------------------------------------- host checks
def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def test_backward_operands_name_the_argument():
    """check_backward and the backward custom op (torch.ops.dsagen.qsa_indexed_bwd_fused) refuse bad operands before
    any device query; a missing gradient (None) is allowed."""
    q, k, v = _t(8, 12, 256), _t(8, 1, 256), _t(8, 1, 128)
    f32 = torch.float32
    good = dict(out32=_t(8, 12, 128, dtype=f32), lse=_t(12, 8, dtype=f32), d_out=_t(8, 12, 128), d_out32=None,
                d_lse=_t(12, 8, dtype=torch.float64))
    qsa_host.check_backward(q, v, **good)
    for name, bad, needle in (("out32", _t(8, 12, 128), "out_fp32 must be float32 [8, 12, 128]"),
                              ("lse", _t(8, 12, dtype=f32), "lse must be float32 [12, 8]"),
                              ("lse", None, "lse must be float32 [12, 8] on cpu, got None"),
                              ("d_out", _t(8, 12, 256), "d_out must be floating point [8, 12, 128]"),
                              ("d_out32", _t(8, 12, 128, dtype=torch.int32), "d_out_fp32 must be floating point"),
                              ("d_lse", _t(8, 12, dtype=f32), "d_lse must be floating point [12, 8]")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            qsa_host.check_backward(q, v, **{**good, name: bad})
    idx = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="d_out must be"):
        torch.ops.dsagen.qsa_indexed_bwd_fused(q, k, v, idx, good["out32"], good["lse"], _t(8, 12, 64), None, None,
                                               0.1)
    with pytest.raises(ValueError, match="at most 64 query heads per KV head"):
        qsa_host.backward(_t(8, 65, 256), k, v, (idx,), _t(8, 65, 128, dtype=f32), _t(65, 8, dtype=f32), None, None,
                          None, 0.1)


def test_backward_inputs_fold_the_outputs_gradients():
    """dO = d_out + d_out_fp32 (FP32 sum, then the inputs' dtype); delta = sum(dO * out_fp32) - d_lse, [Hq, T]."""
    gen = torch.Generator().manual_seed(1)
    out32 = torch.randn(5, 6, 16, generator=gen)
    d_out, d_out32, d_lse = torch.randn(5, 6, 16, generator=gen).bfloat16(), torch.randn(5, 6, 16, generator=gen), \
        torch.randn(6, 5, generator=gen)
    do, delta = qsa_host.backward_inputs(out32, d_out, d_out32, d_lse, torch.bfloat16)
    full = d_out.float() + d_out32
    assert do.dtype == torch.bfloat16 and torch.equal(do, full.bfloat16())
    torch.testing.assert_close(delta, (full * out32).sum(-1).t() - d_lse)
    assert delta.is_contiguous() and delta.shape == (6, 5)
    do, delta = qsa_host.backward_inputs(out32, None, d_out32, None, torch.float16)
    assert torch.equal(do, d_out32.half())
    torch.testing.assert_close(delta, (d_out32 * out32).sum(-1).t())
    do, delta = qsa_host.backward_inputs(out32, None, None, None, torch.bfloat16)
    assert not do.any() and not delta.any()


# ------------------------------------------------------------------------------------------- oracle and inputs
def bitmap_counts(t: int, bm: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """[T, T] FP64: 1 where query t attends token u under the bitmap API (selected block, same sequence, u <= t)."""
    block, starts, _ = bitmap_token_layout(t, cu, "cpu")
    pos = torch.arange(t)
    allowed = (bm[:, block] != 0) & (pos[None] <= pos[:, None]) & (pos[None] >= starts[:, None])
    return allowed.double()


def make_indexed(t, hq, hkv, d, dv, w, gen, dtype=torch.float64):
    """q, k, v and ids [T, W] with -1 padding, ids past T and below -1, a repeated id, an empty row (row 3)."""
    q = (torch.randn(t, hq, d, generator=gen) * 0.5).to(dtype)
    k = (torch.randn(t, hkv, d, generator=gen) * 0.5).to(dtype)
    v = torch.randn(t, hkv, dv, generator=gen).to(dtype)
    ids = torch.randint(-1, t, (t, w), generator=gen, dtype=torch.int32)
    ids[:, w - 4:] = -1
    ids[1, 0], ids[2, 1], ids[3] = t + 2, -5, -1
    ids[5, 2] = ids[5, 0] = 4
    return q, k, v, ids


@pytest.mark.parametrize("hq,hkv", [(12, 1), (24, 2)])
def test_reference_autograd_matches_dense_oracle(hq, hkv):
    """dsagen.qsa_indexed_forward / qsa_bitmap_forward(impl="reference") differentiated in FP64 (every output in the
    loss) against the dense oracle's autograd: -1 padding, out-of-range and repeated ids, an empty row; the bitmap
    form with packed sequences (empty, shorter than a block) and an empty row."""
    gen = torch.Generator().manual_seed(hq + 7)
    t, d, dv = 23, 32, 16
    q, k, v, ids = make_indexed(t, hq, hkv, d, dv, 12, gen)
    weights = oracle.loss_weights(t, hq, dv, gen, "cpu")
    got = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids, 0.3, impl="reference"), q, k, v, weights)
    want = oracle_grads(q, k, v, oracle.slot_counts(ids, t), 0.3, weights)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    cu = torch.tensor([0, 0, 3, 17, 23], dtype=torch.int32)
    nb = bitmap_token_layout(t, cu, "cpu")[2]
    bm = (torch.rand(t, nb, generator=gen) < 0.5).to(torch.uint8)
    bm[4] = 0
    got = grads(lambda a, b, c: dsagen.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu, impl="reference"), q, k, v,
                weights)
    want = oracle_grads(q, k, v, bitmap_counts(t, bm, cu), 1 / math.sqrt(d), weights)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_autograd_16bit_rounds_once(dtype):
    """impl="reference" on 16-bit inputs with ids drawn per slot (each key in ~200 slots of ~100 rows, repeats
    within rows): its FP32 autograd sums every key's slots before rounding dk / dv to the inputs' dtype once, so each
    gradient element is the FP64 oracle's within one rounding (half an ulp: 2^-8 relative in bf16, 2^-11 in fp16)
    plus a small FP32 term. Gathering the 16-bit rows before the cast would sum the slots in 16 bits (~2% in bf16)."""
    gen = torch.Generator().manual_seed(611)
    t, hq, d, dv, w = 100, 12, 64, 64, 200
    q, k, v, ids = make_indexed(t, hq, 1, d, dv, w, gen, dtype)
    w_out, w_out32, w_lse = oracle.loss_weights(t, hq, dv, gen, "cpu")
    weights = (w_out.to(dtype).float(), w_out32, w_lse)       # out's gradient arrives in `dtype`: exact there
    got = grads(lambda a, b, c: dsagen.qsa_indexed_forward(a, b, c, ids, 0.11, impl="reference"), q, k, v, weights)
    want = oracle_grads(q, k, v, oracle.slot_counts(ids, t), 0.11, weights)
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        err = (a.double() - b).abs()
        bound = half_ulp * b.abs() + 1e-5 * b.abs().max()
        assert (err <= bound).all(), f"{name}: {(err - bound).max().item():.3g} past the bound"


# -------------------------------------------------------------------------- the fused host path with stand-ins
def _abi_names(part: str, dtype: str, bitmap: bool) -> list[str]:
    """The parameter names of the kernel the host launches for `part`, from the kernel modules' own ABI."""
    from dsagen.kernels.qsa import dkv_sm90, dq_sm90, fwd_sm90

    if part == "fwd":
        return [p["name"] for p in fwd_sm90.params(dtype, bitmap)]
    mod = dq_sm90 if part == "dq" else dkv_sm90
    return [p["name"] for p in mod.build(4, 64, 64, dtype, 2, bitmap).params]


def _selection_counts(a: dict) -> torch.Tensor:
    """The [T, T] slot counts the launch's selection arguments describe (the indexed rows up to `width`, or the
    bitmap with its packed offsets and first blocks)."""
    t = a["n_tok"]
    if "idx" in a:
        return oracle.slot_counts(a["idx"][:, :a["width"]], t)
    cu = a["cu"] if a["n_docs"] else None
    if cu is not None:
        assert torch.equal(a["blk0"][1:], torch.cumsum((cu[1:] - cu[:-1] + 3) // 4, 0))
    assert a["n_blocks"] == a["bm"].shape[1] and a["bm"].dtype == torch.uint8
    return bitmap_counts(t, a["bm"], cu)


class StandIn:
    """A kernel of `part` whose launch does the kernel's math in FP64 from its arguments, named by the ABI: the
    forward's outputs from the dense oracle, dq / dk / dv from the backward's formulas (P from the given lse, dS =
    P (dP - delta), dk scaled, dk / dv added into the FP32 buffers)."""

    def __init__(self, part, dtype, bitmap, calls):
        self.part, self.calls = part, calls
        self.names = _abi_names(part, {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], bitmap)

    def launch(self, *args):
        assert len(args) == len(self.names)
        a = dict(zip(self.names, args))
        self.calls.append(self.part)
        cnt = _selection_counts(a)
        q, k, v = a["q"].double(), a["k"].double(), a["v"].double()
        g = q.shape[1] // k.shape[1]
        scale = a["scale_log2"] / math.log2(math.e)
        if self.part == "fwd":
            out, lse = dense_oracle(q, k, v, cnt, scale)
            a["out"].copy_(out)
            a["out32"].copy_(out)
            a["lse"].copy_(lse)
            return
        assert a["scale"] == pytest.approx(scale)
        kh, vh = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("thd,uhd->htu", q, kh) * scale
        lse = a["lse"].double()
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
        d_p = torch.einsum("thd,uhd->htu", a["dout"].double(), vh)
        ds = p * (d_p - a["delta"].double()[..., None]) * cnt[None]
        if self.part == "dq":
            a["dq"].copy_(torch.einsum("htu,uhd->thd", ds, kh) * scale)
            return
        dk = torch.einsum("htu,thd->uhd", ds, q) * scale
        dv = torch.einsum("htu,thd->uhd", p * cnt[None], a["dout"].double())
        t, hkv = k.shape[:2]
        a["dk32"].add_(dk.reshape(t, hkv, g, -1).sum(2).float())
        a["dv32"].add_(dv.reshape(t, hkv, g, -1).sum(2).float())


def _stand_ins(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(qsa_host, "_kernel", lambda device, hq, hkv, d, dv, dtype, bitmap=False, part="fwd":
                        StandIn(part, dtype, bitmap, calls))
    return calls


def _fused_inputs(gen, t=21, hq=12, hkv=1, d=64, dv=64):
    q, k, v, ids = make_indexed(t, hq, hkv, d, dv, 12, gen, torch.float16)
    cu = torch.tensor([0, 5, 5, 7, t], dtype=torch.int32)
    bm = (torch.rand(t, bitmap_token_layout(t, cu, "cpu")[2], generator=gen) < 0.6).to(torch.uint8)
    bm[6] = 0
    return q, k, v, ids, bm, cu


@pytest.mark.parametrize("form", ["indexed", "bitmap"])
def test_fused_host_autograd(monkeypatch, form):
    """The host op with q, k, v requiring grad goes through the custom op and its autograd: one forward launch, then
    dq and dk / dv; the gradients (every output in the loss) are the dense oracle's within fp16 rounding."""
    calls = _stand_ins(monkeypatch)
    gen = torch.Generator().manual_seed(41 if form == "indexed" else 43)
    q, k, v, ids, bm, cu = _fused_inputs(gen)
    weights = oracle.loss_weights(q.shape[0], q.shape[1], v.shape[2], gen, "cpu")
    if form == "indexed":
        fn = lambda a, b, c: qsa_host.qsa_indexed_forward(a, b, c, ids, scale=0.2)   # noqa: E731
        cnt, scale = oracle.slot_counts(ids, q.shape[0]), 0.2
    else:
        fn = lambda a, b, c: qsa_host.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu, scale=None)   # noqa: E731
        cnt, scale = bitmap_counts(q.shape[0], bm, cu), 1 / math.sqrt(q.shape[2])
    got = grads(fn, q, k, v, weights)
    assert calls == ["fwd", "dq", "dkv"]
    want = oracle_grads(q, k, v, cnt, scale, weights)
    for a, b, x in zip(got, want, (q, k, v)):
        assert a.dtype == x.dtype and a.shape == x.shape
        torch.testing.assert_close(a.double(), b, atol=2e-2 * b.abs().max().item(), rtol=0)
    calls.clear()
    with torch.no_grad():
        qsa_host.qsa_indexed_forward(q, k, v, ids, scale=0.2)
    assert calls == ["fwd"]


def test_fused_host_autograd_compiled(monkeypatch):
    """torch.compile(fullgraph=True, aot_eager) of both forms with gradients: the forward and backward custom ops are
    opaque nodes and the gradients equal the eager ones."""
    calls = _stand_ins(monkeypatch)
    gen = torch.Generator().manual_seed(47)
    q, k, v, ids, bm, cu = _fused_inputs(gen, hq=24, hkv=2)
    weights = oracle.loss_weights(q.shape[0], q.shape[1], v.shape[2], gen, "cpu")

    def both(a, b, c):
        x = qsa_host.qsa_indexed_forward(a, b, c, ids, scale=0.2)
        y = qsa_host.qsa_bitmap_forward(a, b, c, bm, cu_seqlens=cu, scale=0.2)
        return tuple(i + j for i, j in zip(x, y))

    eager = grads(both, q, k, v, weights)
    torch._dynamo.reset()
    compiled = grads(torch.compile(both, backend="aot_eager", fullgraph=True), q, k, v, weights)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert calls.count("dq") == calls.count("dkv") == 4
