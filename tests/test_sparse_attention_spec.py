"""CPU tests of the fused sparse attention forward's spec, template, kernel module and compiled kernel (no GPU):
validation reasons, the rendered module and the kernel module it binds, and (marked `compile`, needs CuTe-DSL) a
real sm_90a cross-compilation whose SASS must show the design: HGMMA for both products (SS for QK^T, RS and SS for
PV), LDGSTS gathers with cp.async mbarrier arrivals, setmaxnreg, and no local-memory spills."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

import dsagen.kernels.sparse_mla as sparse_mla
from dsagen.jit.render import helper_modules, render
from dsagen.spec import SpecError, get_preset
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdConfig, SparseAttnFwdSpec, config_for


def _compiled_sass(spec, tmp_path):
    """Cross-compile `spec` for sm_90a and check what every kernel of this op must show: 384 threads and a
    setmaxnreg budget that is the spec's and cannot deadlock (setmaxnreg only redistributes the registers the CTA
    launched with; asking for more spins forever). Returns (launch record, SASS, opcode counts); skips the test
    when nvdisasm is missing."""
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm, opcode_counts

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


def test_default_spec_is_the_ops_v32_kernel():
    s = SparseAttnFwdSpec(arch="sm_90a").check()
    assert (s.num_heads, s.d_qk, s.d_v, s.dtype) == (128, 576, 512, "bfloat16")
    assert s.regs_producer + s.regs_qk + s.regs_pv == 504
    assert s in get_preset("deepseek-v3.2", "sm_90a")                       # the op's H128 / D576 kernel
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
    (dict(regs_qk=248), "exceeds 504"),
    (dict(regs_producer=56), "exceeds 504"),
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
              SparseAttnFwdSpec(arch="sm_90a", regs_qk=224, regs_pv=232),
              SparseAttnFwdSpec(arch="sm_90a", regs_producer=40)]
    keys = {base.canonical_json()} | {o.canonical_json() for o in others}
    assert len(keys) == 1 + len(others)
    assert len({base.symbol()} | {o.symbol() for o in others}) == 1 + len(others)


def test_config_selection():
    """config_for picks one frozen SparseAttnFwdConfig for every shape, call size and SM count; spec_for turns it
    into the kernel spec of the (padded) head count; the fused module keeps no tuning state of its own."""
    import dataclasses as dc

    import torch

    import dsagen.kernels.sparse_mla.host as fsa

    op = SparseAttnFwdConfig()
    assert (op.regs_producer, op.regs_qk, op.regs_pv, op.block_n, op.stages, op.grid) == (48, 232, 224, 64, 2,
                                                                                         "persistent")
    for h in (64, 128):
        for d in (512, 576):
            for dt in ("bfloat16", torch.float16):
                for rows in (None, 1, 64, 128, 4096, 32768):        # decode batches and prefill alike
                    for sms in (None, 132, 78):
                        assert config_for(h, d, dt, rows, "sm_90a", sms) == op, (h, d, dt, rows, sms)
    with pytest.raises(dc.FrozenInstanceError):
        op.grid = 7
    assert fsa.spec_for(128, 576, torch.bfloat16) == SparseAttnFwdSpec(arch="sm_90a")
    assert fsa.spec_for(100, 576, torch.bfloat16) == SparseAttnFwdSpec(arch="sm_90a")           # padded to 128
    assert fsa.spec_for(16, 512, torch.float16) == SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512,
                                                                     dtype="float16")             # padded to 64
    other = dc.replace(op, regs_producer=40, regs_qk=240)
    assert fsa.spec_for(64, 576, torch.bfloat16, config=other) == SparseAttnFwdSpec(
        arch="sm_90a", num_heads=64, regs_producer=40, regs_qk=240)
    assert op.spec(128, 576, "bfloat16") == SparseAttnFwdSpec(arch="sm_90a")
    for name in ("SCHEDULE", "OPTIONS", "GRID", "DEFAULT_GRID", "L2_HINT", "ablated_forward"):
        assert not hasattr(fsa, name), name


@pytest.mark.parametrize("name", ["schedule", "l2_hint", "vec_store", "stream_hint", "q_prefetch", "ablate"])
def test_removed_fields_are_gone(name):
    """The rejected schedules and options and the timing-only ablations are not spec fields (notes, "Tried and
    rejected"): a spec naming one is refused."""
    with pytest.raises(TypeError):
        SparseAttnFwdSpec(arch="sm_90a", **{name: 1})
    with pytest.raises(SpecError, match=name):
        SparseAttnFwdSpec.from_canonical({"op": "sparse_attention_fwd", "fields": {"arch": "sm_90a", name: 1}})


def test_grid_choice():
    """SparseAttnFwdConfig.grid gives the kernel's n_ctas (its grid is min(items, n_ctas)): "persistent" one CTA per
    SM, an int at most that many; anything else is refused."""
    assert SparseAttnFwdConfig().n_ctas(132) == 132
    assert SparseAttnFwdConfig(grid=7).n_ctas(132) == 7
    for bad in (0, -3, True, "all", "items", 2.5):
        with pytest.raises(ValueError, match="grid"):
            SparseAttnFwdConfig(grid=bad)


def _kernel_source() -> str:
    """The text of the kernel module (plain CuTe-DSL Python; read, not imported: no DSL needed)."""
    return (Path(sparse_mla.__file__).parent / "fwd_sm90.py").read_text()


def _class_constant(text: str, name: str):
    """The literal value of a class-level constant `name` of SparseMlaFwdSm90 in the kernel module's text."""
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "SparseMlaFwdSm90")
    return next(ast.literal_eval(n.value) for n in cls.body
                if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == [name])


@pytest.mark.parametrize("d_qk", [512, 576])
def test_render(d_qk):
    """The rendered module binds the spec's values to the kernel class and declares the ABI; the kernel's design
    lives in the kernel module, whose hashes the key covers."""
    src = render(SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=d_qk))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.sparse_mla.fwd_sm90 import build" in src
    assert "PARAMS, LAUNCH, kernel, host = build(num_heads=64, " in src and f"d_qk={d_qk}," in src
    assert {"dsagen.kernels.sparse_mla.fwd_sm90", "dsagen.kernels.common.sm90.gather",
            "dsagen.kernels.common.sm90.softmax"} <= set(helper_modules(src))
    assert len(src.split("SYMBOL = ")[1].splitlines()) <= 12                 # the body only binds the spec
    kern = _kernel_source()
    assert "{%" not in kern and "{{" not in kern                              # plain Python, no template
    for name in ("BAR_MAX_A = 1", "BAR_MAX_B = 2", "BAR_P_A = 3", "BAR_P_B = 4", "BAR_EPI_A = 5", "BAR_EPI_B = 6",
                 "kmax, ntiles = row_slots(a.p_len, a.has_length, a.topk, tok, self.BN)",
                 "npairs = (ntiles + 1) // 2", "half_mbar"):
        assert name in kern
    # the CTAs loop over the items: grid min(items, n_ctas), the Q hand-over barrier, phases from the pair count
    assert kern.count("for item in cutlass.range(bidx, n_items, nctas, unroll=1):") == 2     # producer, consumers
    assert 'items = f"s_q * {fwd.HB} * n_splits" if split_kv else f"s_q * {fwd.HB}"' in kern
    assert ('BuiltKernel.of(params(dtype, lse_prefix, kv_fp8, split_kv), fwd, f"min({items}, n_ctas)", fwd.CLUSTER)'
            in kern)
    assert "q_free" in kern and "g = gp + k" in kern
    # the producer fills the halves V0L, V1R, V0R, V1L: free[0][L], free[1][R], free[0][R], free[1][L]
    assert "mbarrier_wait(bars.hbar + (4 + 2 * s + h), free_phase)" in kern
    assert [4 + 2 * s + h for s, h in _class_constant(kern, "FILL_ORDER")] == [4, 7, 5, 6]
    # the P tiles: P0 in stage 0's RoPE tile when D_QK > D_V (one extra tile for P1), two tiles otherwise
    assert "p_elems = M * BN if self.P_IN_ROPE else 2 * M * BN" in kern and "self.P_IN_ROPE = d_qk > d_v" in kern
    # Q loads and O stores carry the evict_first policy; O goes out as 16-byte stores after the quad transpose
    assert kern.count("cp_async_rows(") == 1 and kern.count("store_row_v4(") == 1               # both consumers
    assert kern.count("l2_evict_first_policy()") == 2                          # producer (Q), consumers (O)


@pytest.mark.compile
def test_every_build_has_its_own_kernel():
    """Each rendered module builds its own kernel: two builds, of one spec's values or of two, never share a kernel,
    host or declaration object (the module sets the kernel's symbol name on the function object)."""
    from dsagen.kernels.sparse_mla.fwd_sm90 import build

    fields = dict(num_heads=128, d_qk=576, d_v=512, dtype="bfloat16", block_n=64, stages=2, regs_producer=48,
                  regs_qk=232, regs_pv=224)
    builds = [build(**fields), build(**fields), build(**dict(fields, num_heads=64, d_qk=512, dtype="float16"))]
    for i in range(4):                                        # params, launch, kernel, host
        assert len({id(b[i]) for b in builds}) == len(builds), i
    assert builds[0].launch["grid"][0] == "min(s_q * 2, n_ctas)" and builds[2].launch["grid"][0] == (
        "min(s_q * 1, n_ctas)")
    assert builds[0].launch["smem"] > builds[2].launch["smem"]           # a 576-wide Q and stages
    assert builds[2].params[0] == {"name": "q", "kind": "ptr", "dtype": "float16", "align": 16}


@pytest.mark.compile
@pytest.mark.parametrize("spec", [SparseAttnFwdSpec(arch="sm_90a"),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, d_qk=512),
                                  SparseAttnFwdSpec(arch="sm_90a", num_heads=64, dtype="float16")],
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
    # O as 16-byte stores (16 per consumer thread and item); the only 4-byte stores are lse and max_logits
    assert len(re.findall(r"STG\.E\.128 ", sass)) == 32 and len(re.findall(r"STG\.E ", sass)) == 4
    # KNOWN: this kernel spills a few loop-invariant values (addresses) to local memory (L1), reloaded once per
    # pair; bound them so that a change which spills in the inner loops shows up
    assert ops["LDL"] + ops["STL"] <= 100, (ops["LDL"], ops["STL"])


def _ptxas_wgmma_serialisation(spec, tmp_path) -> list[str]:
    """ptxas -v's "wgmma.mma_async instructions are serialized" messages (C7514 / C7515: every wgmma of the kernel
    then waits for the previous one) for `spec`'s PTX, from the CUDA toolkit's ptxas. The DSL's PTX declares a newer
    .version than a CUDA 13.0 ptxas reads; its instructions are not newer, so the line is rewritten. Skips without
    a ptxas that assembles it."""
    import shutil
    import subprocess

    from dsagen.jit.build import compile_module

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
    spec = SparseAttnFwdSpec(arch="sm_90a", **fields)
    assert _ptxas_wgmma_serialisation(spec, tmp_path) == []


def test_host_passes_the_prefix_arguments_only_to_the_lse_prefix_kernel(monkeypatch):
    """The fused host with a stand-in kernel (CPU tensors): indexer_topk > 0 plans the lse_prefix spec and appends
    (lse_indexer, n_prefix) to the launch; 0 launches the plain kernel with its 18 arguments; other values are
    refused before anything runs."""
    import torch

    import dsagen.kernels.sparse_mla.host as fwd_host

    calls, plans = [], []

    class Kernel:
        def launch(self, *args):
            calls.append(args)

    def plan(h, d_qk, dtype, device, rows, want_kernel, config=None, lse_prefix=False, kv_fp8=False, split_kv=False):
        plans.append(lse_prefix)
        return SparseAttnFwdSpec(arch="sm_90a", num_heads=64, lse_prefix=lse_prefix), Kernel(), 4

    monkeypatch.setattr(fwd_host, "_launch_plan", plan)
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    ids = torch.zeros(2, 256, dtype=torch.int32)
    kw = dict(attn_sink=None, topk_length=None, softmax_scale=0.1, d_v=512)
    out, lse, m, lse_ix = fwd_host._launch(q, kv, ids, **kw, indexer_topk=128)
    assert plans == [True] and len(calls[0]) == 20 and calls[0][-1] == 128 and calls[0][-2].shape == (2, 64)
    assert lse_ix.shape == (2, 16)                                  # padded heads sliced back
    assert len(fwd_host._launch(q, kv, ids, **kw)) == 3 and plans[-1] is False and len(calls[-1]) == 18
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        fwd_host.sparse_attention(q, kv, ids, **kw, indexer_topk=100)
    with pytest.raises(ValueError, match="indexer_topk=512"):
        fwd_host.sparse_attention(q, kv, ids, **kw, indexer_topk=512)


def test_decode_passes_the_fp8_cache_rows_to_the_kv_fp8_kernel(monkeypatch):
    """sparse_attention_decode's fused host with a stand-in kernel (CPU tensors): an FP8 cache (uint8, or its
    float8_e4m3fn view) plans the kv_fp8 spec and launches with the cache as one pool of 656-byte rows (its row count
    and byte stride as n_kv and ld_kv, no copy of a row-strided view); a BF16 cache plans the plain kernel; a cache
    with no rows returns out 0 and lse +inf without a launch."""
    import torch

    import dsagen.kernels.sparse_mla.host as fwd_host
    from dsagen.kernels.sparse_mla import decode_host

    calls, plans = [], []

    class Kernel:
        def launch(self, *args):
            calls.append(args)

    def plan(h, d_qk, dtype, device, rows, want_kernel, config=None, lse_prefix=False, kv_fp8=False, split_kv=False):
        plans.append(kv_fp8)
        return SparseAttnFwdSpec(arch="sm_90a", num_heads=64, kv_fp8=kv_fp8, split_kv=split_kv), Kernel(), 4

    monkeypatch.setattr(fwd_host, "_launch_plan", plan)
    monkeypatch.setattr(decode_host, "device_index", lambda d: 0)
    monkeypatch.setattr(decode_host, "device_sm_count", lambda i: 132)
    q = torch.zeros(2, 3, 64, 576, dtype=torch.bfloat16)
    ids = torch.zeros(2, 3, 128, dtype=torch.int32)
    kw = dict(attn_sink=None, topk_length=None, softmax_scale=None, d_v=512)
    wide = torch.zeros(5, 8, 1, 672, dtype=torch.uint8)
    for cache in (wide[..., :656], wide[..., :656].view(torch.float8_e4m3fn)):
        out, lse = decode_host.sparse_attention_decode(q, cache, ids, **kw)
        kv, scalars = calls[-1][1], calls[-1][8:]
        assert plans[-1] is True and kv.dtype == torch.uint8 and kv.shape == (40, 656)
        assert kv.data_ptr() == wide.data_ptr() and scalars[1] == 40 and scalars[4] == 672     # n_kv, ld_kv bytes
        assert out.shape == (2, 3, 64, 512) and lse.shape == (2, 3, 64)
    decode_host.sparse_attention_decode(q, torch.zeros(5, 8, 1, 576, dtype=torch.bfloat16), ids, **kw)
    assert plans[-1] is False and calls[-1][8 + 4] == 576
    n = len(calls)
    out, lse = decode_host.sparse_attention_decode(q, wide[:0, ..., :656], ids, **kw)
    assert len(calls) == n and (out == 0).all() and torch.isposinf(lse).all() and out.shape == (2, 3, 64, 512)


def test_decode_splits_the_slots_of_small_batches(monkeypatch):
    """split_plan: ranges of a multiple of 128 slots (at most 32) so that rows x ranges items cover the SMs, none
    when the rows' items fill half of them or the rows are short; the decode host with stand-in kernels launches the
    split_kv kernel (its n_splits and split_slots appended, no sink) into FP32 partials, then the combine kernel with
    the sink."""
    import torch

    import dsagen.kernels.sparse_mla.host as fwd_host
    from dsagen.kernels.sparse_mla import decode_host

    plan_of = decode_host.split_plan
    assert plan_of(1, 128, 2048, 132) == (16, 128)          # 2 items: 16 ranges of 2 tiles
    assert plan_of(32, 128, 2048, 132) == (2, 1024)         # 64 items: 2 ranges (128 items in one wave)
    assert plan_of(20, 128, 2048, 132) == (3, 768)          # 40 items: 3 ranges (120 items), not 4 (160)
    assert plan_of(2, 16, 640, 132) == (5, 128)             # 16 heads run as 64
    assert plan_of(1, 64, 16384, 132) == (32, 512)          # at most 32 ranges
    assert plan_of(70, 128, 2048, 132) is None and plan_of(1, 128, 255, 132) is None and plan_of(0, 64, 512, 8) is None

    launches, specs = [], []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def launch(self, *args):
            launches.append((self.name, args))

    def plan(h, d_qk, dtype, device, rows, want_kernel, config=None, lse_prefix=False, kv_fp8=False, split_kv=False):
        specs.append(split_kv)
        return SparseAttnFwdSpec(arch="sm_90a", num_heads=64, split_kv=split_kv), Kernel("fwd"), 4

    monkeypatch.setattr(fwd_host, "_launch_plan", plan)
    monkeypatch.setattr(fwd_host, "get_kernel", lambda spec, index: Kernel(spec.op))
    monkeypatch.setattr(fwd_host, "device_index", lambda d: 0)
    monkeypatch.setattr(decode_host, "device_index", lambda d: 0)
    monkeypatch.setattr(decode_host, "device_sm_count", lambda i: 132)
    q = torch.zeros(2, 3, 64, 576, dtype=torch.bfloat16)
    ids = torch.zeros(2, 3, 1024, dtype=torch.int32)
    sink = torch.zeros(64)
    out, lse = decode_host.sparse_attention_decode(q, torch.zeros(5, 8, 1, 576, dtype=torch.bfloat16), ids,
                                                   attn_sink=sink, topk_length=None, softmax_scale=None, d_v=512)
    assert specs == [True] and [n for n, _ in launches] == ["fwd", "sparse_attention_combine"]
    fwd_args, comb_args = launches[0][1], launches[1][1]
    assert fwd_args[-2:] == (8, 128) and fwd_args[8 + 8] == 0                 # n_splits, split_slots; no sink
    assert fwd_args[5].shape == (6 * 8, 64, 512) and fwd_args[5].dtype == torch.float32     # the partials
    assert comb_args[0] is fwd_args[5] and comb_args[1] is fwd_args[6] and comb_args[2].shape == (64,)
    assert comb_args[5:] == (6, 64, 8, 1) and comb_args[3].dtype == torch.bfloat16
    assert out.shape == (2, 3, 64, 512) and lse.shape == (2, 3, 64)
    kept = []                                   # the fast path's plan repeats the launches on new tensors
    decode_host.sparse_attention_decode(q, torch.zeros(5, 8, 1, 576, dtype=torch.bfloat16), ids, attn_sink=sink,
                                        topk_length=None, softmax_scale=None, d_v=512, keep_plan=kept.append)
    launches.clear()
    out, lse = kept[0](q.clone(), torch.ones(5, 8, 1, 576, dtype=torch.bfloat16), ids.clone(), sink, None)
    assert [n for n, _ in launches] == ["fwd", "sparse_attention_combine"] and launches[0][1][1].eq(1).all()
    assert launches[0][1][1].shape == (40, 576) and out.shape == (2, 3, 64, 512) and lse.shape == (2, 3, 64)
    for bad in ((33, 128), (2, 100), (0, 128), (7, 128)):           # (7, 128): 896 of the 1024 slots
        with pytest.raises(ValueError, match="split="):
            fwd_host._launch(q.view(6, 64, 576), torch.zeros(40, 576, dtype=torch.bfloat16), ids.view(6, 1024), None,
                             None, 0.1, 512, split=bad)
    with pytest.raises(ValueError, match="rows of 656 bytes"):
        fwd_host._launch(q.view(6, 64, 576), torch.zeros(40, 576, dtype=torch.uint8), ids.view(6, 1024), None,
                         None, 0.1, 512)
    with pytest.raises(ValueError, match="at least one row"):
        fwd_host._launch(q.view(6, 64, 576), torch.zeros(0, 656, dtype=torch.uint8), ids.view(6, 1024), None,
                         None, 0.1, 512)


def test_decode_plan_repeats_the_launch_on_new_tensors(monkeypatch):
    """sparse_attention_decode's fused host with a stand-in kernel (CPU tensors): the call launches the forward
    kernel on the cache as one pool of rows (a row-strided view: no copy) and hands keep_plan a DecodePlan, which
    launches it again on new tensors of the signature (their pointers, the same scalars) with per-sequence
    lengths expanded per query row."""
    import torch

    import dsagen.kernels.sparse_mla.host as fwd_host
    from dsagen.kernels.sparse_mla import decode_host

    calls = []

    class Kernel:
        def launch(self, *args):
            calls.append(args)

    def plan(h, d_qk, dtype, device, rows, want_kernel, *rest):
        return SparseAttnFwdSpec(arch="sm_90a", num_heads=64), Kernel(), 4

    monkeypatch.setattr(fwd_host, "_launch_plan", plan)
    monkeypatch.setattr(decode_host, "device_index", lambda d: 0)
    monkeypatch.setattr(decode_host, "device_sm_count", lambda i: 132)
    q = torch.zeros(2, 3, 64, 576, dtype=torch.bfloat16)
    ids = torch.zeros(2, 3, 128, dtype=torch.int32)
    wide = torch.zeros(5, 8, 1, 640, dtype=torch.bfloat16)
    kept = []
    kw = dict(attn_sink=None, softmax_scale=None, d_v=512)
    decode_host.sparse_attention_decode(q, wide[..., :576], ids, topk_length=torch.tensor([3, 4], dtype=torch.int32),
                                        keep_plan=kept.append, **kw)
    wide2 = torch.ones(5, 8, 1, 640, dtype=torch.bfloat16)
    out, lse = kept[0](q.clone(), wide2[..., :576], ids.clone(), None, torch.tensor([7, 9], dtype=torch.int32))
    first, again = calls
    assert again[1].data_ptr() == wide2.data_ptr() and again[1].shape == (40, 576) and again[1].stride() == (640, 1)
    assert again[8:] == first[8:] and again[3].tolist() == [7, 7, 7, 9, 9, 9]
    assert out.shape == (2, 3, 64, 512) and lse.shape == (2, 3, 64)
