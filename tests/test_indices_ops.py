"""compactify and local_to_global: hand-computed cases, random cross-checks against brute-force loops,
and every validation error (CPU, impl="reference")."""

from __future__ import annotations

import pytest
import torch

import dsagen


def brute_compactify(ids, length=None):
    out, lens = [], []
    for r, row in enumerate(ids.tolist()):
        lim = len(row) if length is None else max(0, min(int(length[r]), len(row)))
        keep = [v for v in row[:lim] if v >= 0]
        out.append(keep + [-1] * (len(row) - len(keep)))
        lens.append(len(keep))
    return torch.tensor(out, dtype=torch.int32).view(ids.shape), torch.tensor(lens, dtype=torch.int32)


def test_compactify_hand_case():
    ids = torch.tensor([[3, -1, 5, -1, 7], [-1, -1, -1, -1, -1], [4, 3, 2, 1, 0], [-1, -9, 8, 0, -1]],
                       dtype=torch.int32)
    out, n = dsagen.compactify(ids, impl="reference")
    assert out.tolist() == [[3, 5, 7, -1, -1], [-1] * 5, [4, 3, 2, 1, 0], [8, 0, -1, -1, -1]]
    assert n.tolist() == [3, 0, 5, 2]
    out, n = dsagen.compactify(ids, torch.tensor([2, 5, 0, 9]), impl="reference")
    assert out.tolist() == [[3, -1, -1, -1, -1], [-1] * 5, [-1] * 5, [8, 0, -1, -1, -1]]
    assert n.tolist() == [1, 0, 0, 2]


@pytest.mark.parametrize("rows,k", [(0, 4), (3, 0), (1, 1), (17, 33), (50, 130)])
def test_compactify_random_vs_brute_force(rows, k):
    g = torch.Generator().manual_seed(rows * 31 + k)
    ids = torch.randint(-3, 50, (rows, k), generator=g, dtype=torch.int32)
    length = torch.randint(-2, k + 3, (rows,), generator=g)
    for ln in (None, length):
        out, n = dsagen.compactify(ids, ln, impl="reference")
        exp_out, exp_n = brute_compactify(ids, ln)
        assert torch.equal(out, exp_out) and torch.equal(n, exp_n)


def test_compactify_3d_flattens_rows():
    ids = torch.randint(-1, 9, (2, 3, 5), dtype=torch.int32)
    out, n = dsagen.compactify(ids, torch.full((2, 3), 4), impl="reference")
    assert out.shape == (6, 5) and n.shape == (6,)
    exp_out, exp_n = brute_compactify(ids.view(6, 5), [4] * 6)
    assert torch.equal(out, exp_out) and torch.equal(n, exp_n)


def test_local_to_global_hand_case():
    ids = torch.tensor([[[0, 3, -1, 4]], [[1, -2, 3, 7]]], dtype=torch.int32)
    assert dsagen.local_to_global(ids, 4, impl="reference").tolist() == [[[0, 3, -1, -1]], [[5, -1, 7, -1]]]


def test_local_to_global_random_vs_brute_force():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-4, 40, (3, 6, 11), generator=g, dtype=torch.int32)
    out = dsagen.local_to_global(ids, 32, impl="reference")
    exp = [[[b * 32 + v if 0 <= v < 32 else -1 for v in row] for row in mat] for b, mat in enumerate(ids.tolist())]
    assert out.tolist() == exp and out.dtype == torch.int32 and out.is_contiguous()


@pytest.mark.parametrize("call,exc,match", [
    (lambda: dsagen.compactify(torch.zeros(3, 4, dtype=torch.int64), impl="reference"), TypeError, "topk_idxs"),
    (lambda: dsagen.compactify(torch.zeros(3, dtype=torch.int32), impl="reference"), ValueError, "topk_idxs"),
    (lambda: dsagen.compactify([[1]], impl="reference"), TypeError, "topk_idxs"),
    (lambda: dsagen.compactify(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                               impl="reference"), ValueError, "topk_length"),
    (lambda: dsagen.compactify(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3), impl="reference"),
     TypeError, "topk_length"),
    (lambda: dsagen.compactify(torch.zeros(3, 4, dtype=torch.int32), impl="fast"), ValueError, "impl"),
    (lambda: dsagen.compactify(torch.zeros(3, 4, dtype=torch.int32), impl="fused"), ValueError, "impl='reference'"),
    (lambda: dsagen.local_to_global(torch.zeros(3, 4, dtype=torch.int32), 5, impl="reference"), ValueError,
     "topk_idxs"),
    (lambda: dsagen.local_to_global(torch.zeros(1, 3, 4, dtype=torch.int32), 0, impl="reference"), ValueError,
     "seqlen_k"),
    (lambda: dsagen.local_to_global(torch.zeros(1, 3, 4, dtype=torch.int32), 2.0, impl="reference"), TypeError,
     "seqlen_k"),
    (lambda: dsagen.local_to_global(torch.zeros(4, 1, 1, dtype=torch.int32), 2**30, impl="reference"), ValueError,
     "int32"),
    (lambda: dsagen.local_to_global(torch.zeros(1, 3, 4, dtype=torch.int32), 5, impl="fused"), ValueError,
     "impl='reference'"),
])
def test_validation_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
