"""GPU tests of the row scatter-add (dsagen.kernels.row_scatter_add.host.scatter_add_rows and RowScatter, the kernel
of RowScatterAddSpec), the deterministic sum of the backward modes: bitwise equal to the same FP32 additions made
one at a time in row order by torch, bitwise the same run to run and however the rows are split into calls or into
the slices of one RowScatter; invalid targets skipped; rows without a contribution untouched; widths 128 / 512 /
576; accumulator row counts that are not a multiple of the warps per CTA; an empty call.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import pytest
import torch

from dsagen.kernels.row_scatter_add.host import RowScatter, scatter_add_rows
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec

ARCH = "sm_90a"
WIDTHS = (128, 512, 576)
REQUIRED_SPECS = [RowScatterAddSpec(arch=ARCH, width=w) for w in WIDTHS]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def sequential_sum(acc: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """acc + the rows of each target added one at a time in row order, in FP32 (torch, one rank at a time: the
    k-th row of every target is added in the k-th step)."""
    n = acc.shape[0]
    t = target.reshape(-1).long()
    ok = (t >= 0) & (t < n)
    idx = torch.nonzero(ok).flatten()                       # increasing row order
    tv = t[idx]
    order = torch.sort(tv, stable=True).indices
    idx, tv = idx[order], tv[order]
    counts = torch.bincount(tv, minlength=n)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(tv.numel(), device=t.device) - starts[tv]
    out = acc.clone()
    for k in range(int(counts.max()) if counts.numel() else 0):
        sel = rank == k
        out[tv[sel]] += rows[idx[sel]]                      # each target at most once per step
    return out


def make_case(n, m, w, seed, invalid=0.1):
    gen = torch.Generator().manual_seed(seed)
    acc = torch.randn(n, w, generator=gen).to(DEV)
    rows = (torch.randn(m, w, generator=gen) * torch.rand(m, 1, generator=gen) * 100).to(DEV)
    target = torch.randint(0, n, (m,), generator=gen, dtype=torch.int32)
    bad = torch.rand(m, generator=gen) < invalid
    target[bad] = torch.randint(-5, 5, (int(bad.sum()),), generator=gen, dtype=torch.int32) % 7 - 3
    target[bad & (target >= 0)] += n                        # out of range above
    return acc, rows, target.to(DEV)


@pytest.mark.parametrize("w", WIDTHS)
@pytest.mark.parametrize("n,m", [(1, 1), (7, 300), (1000, 20000), (33, 5)])
def test_bitwise_equal_to_the_sequential_fp32_sum(w, n, m):
    acc, rows, target = make_case(n, m, w, seed=n + m + w)
    want = sequential_sum(acc, rows, target)
    got = acc.clone()
    scatter_add_rows(got, rows, target)
    assert torch.equal(got, want)
    untouched = torch.bincount(target[(target >= 0) & (target < n)].long(), minlength=n) == 0
    assert torch.equal(got[untouched], acc[untouched])      # rows without a contribution are not rewritten


def test_run_to_run_and_split_calls_are_bitwise_equal():
    acc, rows, target = make_case(4096, 200000, 576, seed=1, invalid=0.02)
    target = torch.where(target >= 0, target % 64, target)  # 64 hot rows: long groups
    first = acc.clone()
    scatter_add_rows(first, rows, target)
    again = acc.clone()
    scatter_add_rows(again, rows, target)
    split = acc.clone()
    for a, b in [(0, 777), (777, 150000), (150000, 200000)]:
        scatter_add_rows(split, rows[a:b], target[a:b])
    series = acc.clone()
    scatter = RowScatter(target, 4096)                      # one reverse index, the rows in slices (and one empty)
    for a, b in [(0, 31), (31, 31), (31, 99999), (99999, 200000)]:
        scatter.add(series, rows[a:b].contiguous())
    assert torch.equal(first, again) and torch.equal(first, split) and torch.equal(first, series)
    assert torch.equal(scatter.cursor, scatter.ptr[1:])     # every group's rows taken
    ref = acc.double().index_add_(0, target[(target >= 0) & (target < 4096)].long(),
                                  rows[(target >= 0) & (target < 4096)].double())
    assert ((first.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_int64_targets_an_empty_call_and_no_valid_target():
    acc, rows, target = make_case(10, 50, 128, seed=2)
    got = acc.clone()
    scatter_add_rows(got, rows, target.long())
    assert torch.equal(got, sequential_sum(acc, rows, target))
    same = acc.clone()
    scatter_add_rows(same, rows[:0], target[:0])
    scatter_add_rows(same, rows, torch.full_like(target, -1))
    assert torch.equal(same, acc)
