"""CPU tests of the row scatter-add family (dsagen/kernels/row_scatter_add): spec checks, the binding, the compiled
kernel's SASS (16-byte loads and stores, no spills), the reverse index, and the host path with the kernel's contract
in torch (tests/conftest.py cpu_row_scatter)."""

from __future__ import annotations

import re

import pytest
import torch

from dsagen.jit.render import helper_modules, render
from dsagen.kernels.row_scatter_add import host as scatter_host
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.spec import SpecError


@pytest.mark.parametrize("kw,needle", [
    (dict(width=130), "width=130 must be a multiple of 4 in 4..4096"),
    (dict(width=0), "width=0 must be"),
    (dict(width=8192), "width=8192 must be"),
    (dict(width=True), "field width must be an int, got true"),
    (dict(warps_per_cta=3), "warps_per_cta=3 must be one of"),
    (dict(unroll=3), "unroll=3 must be one of 1, 2, 4, 8"),
])
def test_invalid_specs_say_why(kw, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        RowScatterAddSpec(**{"arch": "sm_90a", **kw}).check()


def test_binding():
    spec = RowScatterAddSpec(arch="sm_90a", width=128)
    assert spec.name() == "row_scatter_add_width128_sm_90a"
    src = render(spec)
    compile(src, "kernel.py", "exec")
    assert "build(width=128, warps_per_cta=8, unroll=4)" in src
    assert "dsagen.kernels.row_scatter_add.scatter" in helper_modules(src)


@pytest.mark.compile
@pytest.mark.parametrize("width", [576, 512, 128, 36])
def test_compiles_to_16_byte_loads(width, tmp_path):
    from dsagen.jit.build import compile_module
    from dsagen.jit.sass import disassemble, find_nvdisasm

    spec = RowScatterAddSpec(arch="sm_90a", width=width)
    ck = compile_module(spec, render(spec), tmp_path)
    assert ck.record["launch"]["block"] == [256, 1, 1] and ck.record["launch"]["smem"] == 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    sass = disassemble(ck.cubin)
    per_lane = -(-width // 128)                          # 16-byte vectors per lane and row
    # the accumulator row's loads, UNROLL (4) rows' loads per step, and its stores: all 16 bytes wide
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == per_lane * 5
    assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == per_lane
    assert len(re.findall(r"\bSTG\.E\s", sass)) == 1          # the row's cursor
    # 4-byte loads: cursor[r], ptr[r + 1], the slice's end search (one order entry per lane and step), 4 rows' order
    assert len(re.findall(r"\bLDG\.E\s", sass)) == 2 + 1 + 4 and "VOTE.ANY" in sass
    assert not re.findall(r"\b(LDL|STL)\b", sass)
    assert not re.findall(r"\bRED\b|\bATOM", sass)         # no atomics: each row is its own warp's


def test_reverse_index_groups_rows_by_target_in_row_order():
    gen = torch.Generator().manual_seed(3)
    for n, m in [(1, 1), (7, 50), (100, 5), (33, 1000), (70000, 300)]:
        target = torch.randint(-3, n + 3, (m,), generator=gen)
        target[: m // 2] = target[: m // 2] % 5 + n - 5                   # the last rows, repeated
        order, ptr = scatter_host.reverse_index(target.to(torch.int32), n)
        assert order.dtype == ptr.dtype == torch.int32 and ptr.shape == (n + 1,) and order.shape == (m,)
        assert ptr[0] == 0 and (ptr[1:] >= ptr[:-1]).all()
        for r in sorted(set(target.tolist()) & set(range(n))):
            want = [i for i in range(m) if target[i] == r]
            assert order[ptr[r]:ptr[r + 1]].tolist() == want
        assert ptr[n] == int(((target >= 0) & (target < n)).sum())         # empty groups hold nothing
        assert sorted(order.tolist()) == list(range(m))     # a permutation; invalid targets after the groups


def test_scatter_add_rows_adds_in_row_order(cpu_row_scatter):
    gen = torch.Generator().manual_seed(5)
    n, m, w = 9, 40, 12
    acc = torch.randn(n, w, generator=gen)
    rows = torch.randn(m, w, generator=gen)
    target = torch.randint(-2, n + 2, (4, 10), generator=gen)       # any shape of m integers
    want = acc.clone()
    for i, t in enumerate(target.reshape(-1).tolist()):
        if 0 <= t < n:
            want[t] += rows[i]
    scatter_host.scatter_add_rows(acc, rows, target)
    assert torch.allclose(acc, want, rtol=0, atol=1e-5)


def test_scatter_add_rows_refuses_bad_input():
    acc, rows = torch.zeros(4, 8), torch.zeros(3, 8)
    target = torch.zeros(3, dtype=torch.int64)
    cases = [
        ((acc.double(), rows, target), "must be 2-D float32"),
        ((acc, torch.zeros(3, 12), target), "the same width"),
        ((torch.zeros(4, 6), torch.zeros(3, 6), target), "a multiple of 4"),
        ((acc, rows, torch.zeros(3)), "one integer per row"),
        ((acc, rows, torch.zeros(2, dtype=torch.int64)), "one integer per row"),
        ((acc, rows, target), "expected a CUDA device"),
    ]
    for args, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)):
            scatter_host.scatter_add_rows(*args)
    with pytest.raises(ValueError, match="contiguous and 16-byte aligned"):
        scatter_host.scatter_add_rows(torch.zeros(4, 8)[:, :4], torch.zeros(3, 4), target)


def test_row_scatter_slices_add_as_one_call(cpu_row_scatter):
    """A series added in uneven slices through one RowScatter (one reverse index) gives the sums of one call, each
    accumulator row's rows in series order; a slice past the series' end is refused."""
    gen = torch.Generator().manual_seed(7)
    n, m, w = 11, 60, 8
    acc = torch.randn(n, w, generator=gen)
    rows = torch.randn(m, w, generator=gen)
    target = torch.randint(-2, n + 2, (m,), generator=gen)
    want = acc.clone()
    scatter_host.scatter_add_rows(want, rows, target)
    scatter = scatter_host.RowScatter(target, n)
    for a, b in [(0, 7), (7, 7), (7, 30), (30, 31), (31, 60)]:
        scatter.add(acc, rows[a:b])
    assert torch.equal(acc, want)
    assert torch.equal(scatter.cursor, scatter.ptr[1:])                 # every group consumed
    with pytest.raises(ValueError, match="1 rows after 60 of a series of 60"):
        scatter.add(acc, rows[:1])
    with pytest.raises(ValueError, match="must be an integer tensor"):
        scatter_host.RowScatter(torch.zeros(3), n)
