"""CPU tests of the standalone indexer top-k family (dsagen/kernels/indexer_topk): spec checks, the plan, the binding
to the lightning indexer's radix top-k (rows=True), the compiled kernels, and the host path with a stand-in kernel
against the reference op (in-place FP32 rows or a zero-padded FP32 copy, per-group lengths, values, edges)."""

from __future__ import annotations

import re

import pytest

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.indexer_topk.spec import IndexerTopkRowsSpec, config_for
from dsagen.kernels.lightning_indexer.topk_limits import INDEXER_TOPK_THREADS, TOPK_COMPACT_CAP
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(threads=256), "threads=256 must be one of (128, 512, 1024)"),
    (dict(threads=128, sample=True), "sample=True needs threads in (512, 1024)"),
    (dict(arch="sm_100a"), "sm_90a only"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        IndexerTopkRowsSpec(**{"arch": "sm_90a", **kw}).check()


def test_plan_and_binding():
    plan = config_for("sm_90a")
    assert {s.threads for s in plan.specs()} == set(INDEXER_TOPK_THREADS)
    assert plan.pick(4096, 4096, 132) == IndexerTopkRowsSpec(arch="sm_90a", threads=128)
    assert plan.pick(32768, 4096, 132) == IndexerTopkRowsSpec(arch="sm_90a", threads=512, sample=True)
    assert plan.pick(131072, 4096, 132) == IndexerTopkRowsSpec(arch="sm_90a", threads=1024, sample=True)
    assert plan.pick(131072, 100, 132) == IndexerTopkRowsSpec(arch="sm_90a", threads=1024, sample=True)
    assert plan.pick(8192, 100, 132) == IndexerTopkRowsSpec(arch="sm_90a", threads=1024)
    for threads, cap in TOPK_COMPACT_CAP.items():
        src = render(IndexerTopkRowsSpec(arch="sm_90a", threads=threads, sample=True))
        compile(src, "kernel.py", "exec")
        assert f"CAP = {cap} " in src and "build(THREADS, SAMPLE, CAP, rows=True)" in src
        assert "dsagen.kernels.lightning_indexer.topk_sm90" in helper_modules(src)


@pytest.mark.compile
def test_compiles(tmp_path):
    from dsagen.jit.build import compile_module

    for spec in config_for("sm_90a").specs():
        ck = compile_module(spec, render(spec), tmp_path / f"{spec.threads}{spec.sample}")
        assert ck.record["launch"]["grid"][0] == "n_rows" and ck.record["launch"]["block"][0] == spec.threads
        assert [p["name"] for p in ck.record["params"]] == ["x", "out", "values", "lens", "n_rows", "n_cols",
                                                             "rows_per_len", "topk", "ld_x", "has_values"]


class _StandInKernel:
    """The kernel's contract in torch: row r's ids of its topk largest among its first clamp(lens[r // rpl], 0,
    n_cols) columns, ascending, ties toward the lower id, -1 padded; it checks that it may read whole vectors."""

    def __init__(self):
        self.inputs = []

    def launch(self, x, out, values, lens, n_rows, n_cols, rpl, topk, ld, has_values):
        import torch

        assert x.dtype == torch.float32 and ld % 4 == 0 and x.shape[1] % 4 == 0 and x.data_ptr() % 16 == 0
        self.inputs.append(x)
        for r in range(n_rows):
            n = max(0, min(int(lens[r // rpl]), n_cols))
            vals = x[r, :n].double()
            order = sorted(range(n), key=lambda i: (-vals[i].item(), i))[:topk]
            ids = sorted(order) + [-1] * (topk - len(order))
            out[r] = torch.tensor(ids[:topk], dtype=torch.int32)
            if has_values:
                values[r] = torch.where(out[r] >= 0, x[r].gather(0, out[r].clamp_min(0).long()), float("-inf"))


@pytest.mark.parametrize("dtype,n_cols", [("float32", 40), ("float32", 37), ("bfloat16", 40), ("float16", 9)])
def test_host_path_on_the_cpu_with_a_stand_in_kernel(monkeypatch, dtype, n_cols):
    import torch

    import dsagen
    from dsagen.kernels.indexer_topk import host as tk_host

    kernel = _StandInKernel()

    class Plan:
        def kernel(self, n, rows):
            return kernel

    monkeypatch.setattr(tk_host, "_device_plan", lambda *a: Plan())
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(6, n_cols, generator=gen) * 4).round().to(getattr(torch, dtype))     # ties
    lens = torch.tensor([n_cols, 3, 0], dtype=torch.int32)                                # 2 rows per length
    for k in (5, n_cols + 3):
        idx, vals = tk_host.run(x, lens, k, True)
        ref = dsagen.indexer_topk(x, lens, k, impl="reference")
        assert idx.dtype == torch.int32 and vals.dtype == x.dtype and idx.shape == (6, k)
        # the same set per row (ascending here), each with its value, -1 / -inf past the valid count
        for r in range(6):
            want = set(ref.indices[r][ref.indices[r] >= 0].tolist())
            got = idx[r][idx[r] >= 0].tolist()
            assert set(got) == want and got == sorted(got) and len(got) == len(want)
            assert (idx[r][len(got):] == -1).all()
        assert torch.equal(vals[idx >= 0], x.gather(1, idx.clamp_min(0).long())[idx >= 0])
        assert torch.isneginf(vals[idx < 0]).all()
    in_place = dtype == "float32" and n_cols % 4 == 0
    assert (kernel.inputs[0].data_ptr() == x.data_ptr()) == in_place
    if not in_place:                                      # a zero-padded FP32 copy
        assert kernel.inputs[0].shape == (6, (n_cols + 3) // 4 * 4) and (kernel.inputs[0][:, n_cols:] == 0).all()
    idx, vals = tk_host.run(x, lens, 4, False)
    assert vals is None and idx.shape == (6, 4)
    assert (tk_host.run(x[:, :0], lens, 3, True)[0] == -1).all()


def test_fused_refuses_float64():
    import torch

    from dsagen.kernels.indexer_topk.host import supported_reason

    assert "float64" in supported_reason(torch.zeros(2, 3, dtype=torch.float64))
    assert supported_reason(torch.zeros(2, 3)) == ""


@pytest.mark.parametrize("return_values", [True, False])
def test_the_custom_op_and_its_fake(monkeypatch, return_values):
    """torch.library.opcheck of dsagen::indexer_topk_fused (schema, fake tensor, AOT dispatch) on the CPU, the kernel
    a stand-in: the fake's outputs match the op's."""
    import torch

    from dsagen.kernels.indexer_topk import host as tk_host

    kernel = _StandInKernel()

    class Plan:
        def kernel(self, n, rows):
            return kernel

    monkeypatch.setattr(tk_host, "_device_plan", lambda *a: Plan())
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(9))
    torch.library.opcheck(tk_host._fused_op, (x, torch.tensor([12, 5], dtype=torch.int32), 3, return_values))
