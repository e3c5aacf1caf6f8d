"""CPU tests of the sparse MLA backward family (dsagen/kernels/sparse_mla_bwd) and of the forward's lse_prefix kernel:
spec checks, config validation, the host's window count and scratch size, the rendered binding, and the compiled
kernels' SASS (tensor cores for every product, the atomic / deterministic dkv path, the grid barrier, no deadlocking
register budgets)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.sparse_mla.spec import SparseAttnFwdSpec
from dsagen.kernels.sparse_mla.fwd_sm90 import params as fwd_params
from dsagen.kernels.sparse_mla_bwd import host as bwd_host
from dsagen.kernels.sparse_mla_bwd.bwd_sm90 import params as bwd_params
from dsagen.kernels.sparse_mla_bwd.spec import (SparseAttnBwdConfig, SparseAttnBwdOrderSpec, SparseAttnBwdSpec,
                                                config_for)
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(num_heads=32), "num_heads=32 must be 64 or 128"),
    (dict(d_qk=256), "d_qk=256 must be 512 or 576"),
    (dict(d_v=256), "d_v=256 must be 512"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(regs_a=244), "must each be a multiple of 8"),
    (dict(regs_a=256, regs_b=256), "exceeds 504"),
    (dict(arch="sm_100a"), "sm_90a only"),
    (dict(chunk_buffers_a=3), "chunk_buffers_a=3 must be 1 or 2"),
    (dict(dkv_l2_evict_last=1), "field dkv_l2_evict_last must be a bool"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        SparseAttnBwdSpec(**{"arch": "sm_90a", **kw}).check()


def test_config_and_its_spec():
    cfg = config_for(128, 576, "bfloat16", "sm_90a", 132)
    assert cfg == SparseAttnBwdConfig() and cfg.bucket_rows == 4096 and cfg.sync_grid
    spec = cfg.spec(128, 576, "bfloat16", "sm_90a", deterministic=True)
    assert spec == SparseAttnBwdSpec(arch="sm_90a", deterministic=True, regs_a=232, regs_b=232)
    assert spec.check() is spec
    assert spec.regs_producer + spec.regs_a + spec.regs_b == 504
    assert cfg.n_ctas(132) == 132 and SparseAttnBwdConfig(grid=7).n_ctas(132) == 7
    with pytest.raises(ValueError, match="grid=0"):
        SparseAttnBwdConfig(grid=0)
    with pytest.raises(ValueError, match="bucket_rows=0"):
        SparseAttnBwdConfig(bucket_rows=0)


def test_windows_and_scratch():
    assert bwd_host.buckets(4096, 4096) == 1 and bwd_host.buckets(4097, 4096) == 2
    assert bwd_host.buckets(10**6, None) == 1
    # accumulator + delta + barrier count + windows, then the ordered ids once the pool needs more than one window
    assert bwd_host.workspace_numel(3, 64, 100, 10, 576, False) == 100 * 576 + 3 * 64 + 4 + 8
    assert bwd_host.workspace_numel(3, 64, 5000, 10, 576, False) == 5000 * 576 + 3 * 64 + 4 + 8 + 32
    one_row = 2 * 10 * 576                                               # H 128: two 64-head blocks per row
    assert (bwd_host.workspace_numel(3, 128, 100, 10, 576, True)
            == bwd_host.workspace_numel(3, 128, 100, 10, 576, False) + 3 * one_row)


def test_the_template_only_binds():
    src = render(SparseAttnBwdSpec(arch="sm_90a", num_heads=64, d_qk=512, deterministic=True))
    compile(src, "kernel.py", "exec")
    assert "from dsagen.kernels.sparse_mla_bwd.bwd_sm90 import build" in src and "deterministic=True" in src
    assert len(src.split("SYMBOL = ")[1].splitlines()) <= 12
    assert {"dsagen.kernels.sparse_mla_bwd.bwd_sm90", "dsagen.kernels.common.sm90.epilogue"} <= set(helper_modules(src))


def test_abi():
    names = [p["name"] for p in bwd_params("bfloat16")]
    assert names[:11] == ["q", "kv", "idx", "win", "sink", "out", "dout", "lse", "dq", "dkv", "delta"]
    assert names[-3:] == ["counter", "sync_grid", "n_ctas"]
    base = fwd_params("bfloat16")
    with_prefix = fwd_params("bfloat16", lse_prefix=True)
    assert with_prefix[:len(base)] == base and [p["name"] for p in with_prefix[len(base):]] == ["lse_prefix", "n_prefix"]


def _sass(spec, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    ck = compile_module(spec, render(spec), tmp_path)
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    return ck.record, disassemble(ck.cubin)


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_compiles_to_tensor_cores_and_its_dkv_path(deterministic, tmp_path):
    spec = SparseAttnBwdSpec(arch="sm_90a", num_heads=64, d_qk=512, deterministic=deterministic)
    rec, sass = _sass(spec, tmp_path)
    assert rec["launch"]["block"] == [384, 1, 1] and rec["launch"]["smem"] <= 227 * 1024
    budgets = [int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass)]
    assert sorted(budgets) == sorted([spec.regs_producer, spec.regs_a, spec.regs_b])
    # S (32 k-steps at D512), dP (32) and the dkv chunks (A: 4 x 8, B: 4 x 8) as m64n64; dQ as 128 / 256 wide
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ", sass)) == 32 + 32 + 64
    assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16 ", sass)) == 8
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)) == 4      # B's RS dQ
    reds = re.findall(r"REDG\.E\.ADD\.F32x4\S* ", sass)
    streamed = re.findall(r"STG\.E\.EF\.128 ", sass)          # st.global.cs: evict-first per-slot rows
    if deterministic:
        assert not reds and len(streamed) == 8 * 8         # 8 chunks x 8 16-byte stores per thread
    else:
        assert len(reds) == 8 * 8 and not streamed         # 8 chunks x 8 16-byte atomics per thread
    assert "LDSM" in sass and "STSM" in sass and "LDGSTS" in sass      # P via ldmatrix, P / dS via stmatrix
    assert re.search(r"REDG\.E\.ADD\.S32\.STRONG\.GPU", sass)           # the grid barrier's count


@pytest.mark.compile
def test_two_chunk_accumulators_in_consumer_a_keep_the_products_and_sends(tmp_path):
    """chunk_buffers_a=2 (at budgets 24 / 256 / 224) issues the same wgmmas and atomics as the op's kernel, A's chunks
    pipelined like B's."""
    one = SparseAttnBwdSpec(arch="sm_90a", num_heads=128, d_qk=576)
    two = SparseAttnBwdSpec(arch="sm_90a", num_heads=128, d_qk=576, chunk_buffers_a=2, regs_producer=24,
                            regs_a=256, regs_b=224)
    counts = []
    for spec in (one, two):
        _, sass = _sass(spec, tmp_path / str(spec.chunk_buffers_a))
        counts.append((len(re.findall(r"HGMMA\.", sass)), len(re.findall(r"REDG\.E\.ADD\.F32x4\S* ", sass))))
    assert counts[0] == counts[1] and counts[0][1] == 9 * 8


@pytest.mark.compile
def test_dkv_atomics_with_an_l2_evict_last_policy(tmp_path):
    """dkv_l2_evict_last=True: the same wgmmas and dKV atomics, each red carrying an L2 evict_last policy (PTX: the
    policy made in the atomic's own asm block; SASS: no more local-memory traffic than the op's kernel)."""
    from dsagen.jit.build import compile_module

    base = SparseAttnBwdConfig().spec(128, 576, "bfloat16")                      # the op's kernel
    hint = SparseAttnBwdConfig(dkv_l2_evict_last=True).spec(128, 576, "bfloat16")
    assert hint == dataclasses.replace(base, dkv_l2_evict_last=True)
    ptx = compile_module(hint, render(hint), tmp_path / "ptx").ptx
    assert ptx.count("red.global.add.L2::cache_hint.v4.f32") == ptx.count("createpolicy.fractional.L2::evict_last")
    assert ptx.count("red.global.add.L2::cache_hint.v4.f32") == 9 * 8
    counts = []
    for spec in (base, hint):
        _, sass = _sass(spec, tmp_path / str(spec.dkv_l2_evict_last))
        counts.append((len(re.findall(r"HGMMA\.", sass)), len(re.findall(r"REDG\.E\.ADD\.F32x4\S* ", sass)),
                       len(re.findall(r" (?:LDL|STL)", sass))))
    assert counts[0] == counts[1] and counts[0][1] == 9 * 8


@pytest.mark.compile
def test_forward_lse_prefix_kernel_fits(tmp_path):
    rec, sass = _sass(SparseAttnFwdSpec(arch="sm_90a", lse_prefix=True), tmp_path)
    assert rec["launch"]["smem"] <= 227 * 1024
    assert len(re.findall(r"STG\.E ", sass)) == 2 * 3          # per head row of the thread: lse, max_logits, lse_prefix


@pytest.mark.parametrize("kw,needle", [
    (dict(warps_per_cta=3), "warps_per_cta=3 must be one of"),
    (dict(max_windows=100), "max_windows=100 must be a multiple of 32"),
    (dict(max_windows=8192), "max_windows=8192 must be a multiple of 32 in 32..4096"),
    (dict(warps_per_cta=32, max_windows=4096), "exceeds 48 KB"),
])
def test_invalid_order_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        SparseAttnBwdOrderSpec(**{"arch": "sm_90a", **kw}).check()


@pytest.mark.compile
def test_order_kernel_compiles_to_warp_matches(tmp_path):
    """The window ordering: one warp per row, match.sync per 32-slot step in both passes, a counter per window and
    warp in shared memory."""
    spec = SparseAttnBwdOrderSpec(arch="sm_90a")
    rec, sass = _sass(spec, tmp_path)
    assert rec["launch"]["block"] == [spec.warps_per_cta * 32, 1, 1]
    assert rec["launch"]["smem"] == spec.warps_per_cta * spec.max_windows * 4
    assert len(re.findall(r"MATCH\.ANY ", sass)) >= 2 and "POPC" in sass
    assert not re.search(r"\b(STL|LDL)\b", sass)


def test_order_kernel_launch_arguments_on_the_cpu(monkeypatch):
    """slot_windows with buckets hands the ordering kernel the ids, the lengths, n_kv and the window size, widened
    to ceil(n_kv / max_windows) rows for a pool of more windows."""
    import torch

    calls = []

    class Kernel:
        def launch(self, *args):
            calls.append(args)

    spec = SparseAttnBwdOrderSpec(arch="sm_90a")
    monkeypatch.setattr(bwd_host, "_order_kernel", lambda index: (Kernel(), spec))
    monkeypatch.setattr(bwd_host, "device_index", lambda device: 0)
    idx = torch.zeros((4, 12), dtype=torch.int32)[:, :10]
    length = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    ids = torch.empty((4, 10), dtype=torch.int32)
    win = torch.empty((4, 2), dtype=torch.int32)
    perm = torch.empty((4, 10), dtype=torch.int32)
    bwd_host.slot_windows(idx, 5000, length, 64, ids_out=ids, win_out=win)
    bwd_host.slot_windows(idx, 5000, None, 8, ids_out=ids, win_out=win, perm_out=perm)
    (a0, a1) = calls
    assert a0[0] is idx and a0[1] is length and a0[2] is ids and a0[3] is win
    assert a0[4:10] == (4, 10, 12, 1, 5000, 64) and a0[11] == 0                      # no perm written
    assert a1[5:10] == (10, 12, 0, 5000, 20) and a1[10] is perm and a1[11] == 1     # 625 windows of 8: 256 of 20
    with pytest.raises(ValueError, match="perm_out needs bucket_rows"):
        bwd_host.slot_windows(idx, 5000, None, None, ids_out=ids, win_out=win, perm_out=perm)


def test_slot_windows_without_buckets_keep_the_ids():
    import torch

    idx = torch.tensor([[3, -1, 7], [1, 2, 99]], dtype=torch.int32)
    win = torch.empty((2, 2), dtype=torch.int32)
    bwd_host.slot_windows(idx, 10, torch.tensor([2, 5], dtype=torch.int32), None, ids_out=idx, win_out=win)
    assert idx.tolist() == [[3, -1, 7], [1, 2, 99]] and win.tolist() == [[0, 2], [0, 3]]
    bwd_host.slot_windows(idx, 10, None, None, ids_out=idx, win_out=win)
    assert win.tolist() == [[0, 3], [0, 3]]


def test_host_launch_arguments_on_the_cpu(monkeypatch, cpu_row_scatter):
    """The host's launch path with stand-in kernels (CPU tensors): the kernel gets the ordering's ids and windows,
    the accumulator and counter are zeroed, heads are padded with lse = +inf, and deterministic mode launches per
    chunk of rows."""
    import torch

    calls = []

    class Kernel:
        def launch(self, *args):
            calls.append(args)
            if args[9].shape != (n_kv, 512):       # deterministic: a per-slot chunk; every slot's row is 1.0
                args[9].fill_(1.0)

    spec = SparseAttnBwdSpec(arch="sm_90a", num_heads=64, d_qk=512)
    cfg = SparseAttnBwdConfig(bucket_rows=8, deterministic_chunk_bytes=1)
    monkeypatch.setattr(bwd_host, "_launch_plan", lambda *a, **k: (spec, Kernel(), 5, cfg, True))
    orders = []

    def order(idx, n_kv, length, bucket_rows, *, ids_out, win_out):     # a stand-in for the ordering kernel
        orders.append((idx, n_kv, length, bucket_rows))
        ids_out.copy_(idx.flip(1))
        win_out[:, 0] = 0
        win_out[:, 1] = torch.arange(idx.shape[0])

    monkeypatch.setattr(bwd_host, "slot_windows", order)
    gen = torch.Generator().manual_seed(1)
    s_q, h, n_kv, k = 3, 16, 30, 20
    q = torch.randn(s_q, h, 512, generator=gen).bfloat16()
    kv = torch.randn(n_kv, 512, generator=gen).bfloat16()
    out = torch.randn(s_q, h, 512, generator=gen).bfloat16()
    lse = torch.randn(s_q, h, generator=gen)
    idx = torch.randint(-3, n_kv + 3, (s_q, k), generator=gen, dtype=torch.int32)
    length = torch.tensor([20, 7, 0], dtype=torch.int32)
    dq, dkv, d_sink = bwd_host._launch(q, kv, out, out, lse, idx, None, length, 0.1, 512, False, None)
    (args,) = calls
    ids, win, lse_p, counter, sync = args[2], args[3], args[7], args[19], args[20]
    assert dq.shape == q.shape and dkv.shape == kv.shape and d_sink is None
    assert args[11:14] == (s_q, n_kv, k) and sync == 1 and args[-1] == 5 and (counter == 0).all()
    assert torch.isinf(lse_p[:, h:]).all() and torch.equal(lse_p[:, :h], lse)      # padded heads: P = 0
    ((o_idx, o_kv, o_len, o_bucket),) = orders
    assert o_idx is idx and o_kv == n_kv and torch.equal(o_len, length) and o_bucket == 8
    assert torch.equal(ids, idx.flip(1)) and win[:, 1].tolist() == [0, 1, 2]    # the kernel gets the ordered ids
    calls.clear()
    _, dkv, _ = bwd_host._launch(q, kv, out, out, lse, idx, None, length, 0.1, 512, True, None)
    assert [c[11] for c in calls] == [1, 1, 1]                   # 1-byte chunks: one query row per launch
    # only the slots inside each row's window with an id in [0, n_kv) are summed (row t's window: t slots)
    want = torch.zeros(n_kv)
    for t in range(s_q):
        for slot_id in idx.flip(1)[t, :t].tolist():
            if 0 <= slot_id < n_kv:
                want[slot_id] += 1
    assert torch.equal(dkv.float(), want.view(-1, 1).expand(n_kv, 512))
