"""dsagen.lightning_indexer's opt-in check of the packed offsets' values (check_offsets; on by default for
impl="reference", off for impl="fused", whose offsets stay on the device): the invariants indexer_scores checks
(start at 0, never decrease, end at or before T / S) plus document spans that agree with compress_ratio.
The GPU side (invalid offsets never make a kernel access memory out of bounds) is
tests/gpu/test_sanitize.py::test_indexer_invalid_offsets_stay_in_bounds under memcheck (scripts/sanitize.sh)."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.ops.lightning_indexer import check_offset_values

T, S, H, D = 64, 48, 4, 16

#: (cu_seqlens, cu_seqlens_k, compress_ratio, what the message names)
INVALID = {
    "decreasing": ([0, 40, 20, 64], [0, 30, 10, 48], 1, "non-decreasing"),
    "negative": ([0, -5, 30, 64], [0, -100, 20, 48], 1, "non-decreasing"),
    "past_end_q": ([0, 30, 65], [0, 30, 48], 1, "T = 64"),
    "past_end_k": ([0, 30, 64], [0, 30, 49], 1, "S = 48"),
    "nonzero_start": ([7, 20, 64], [0, 13, 48], 1, "start at 0"),
    "span_mismatch": ([0, 10, 40, 64], [0, 30, 31, 48], 1, "document 0"),
    "span_mismatch_ratio": ([0, 8, 16], [0, 2, 3], 4, "document 1"),
}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((1, T, H, D), generator=gen)
    k = torch.randn((1, S, D), generator=gen)
    w = torch.randn((1, T, H), generator=gen)
    return q, k, w


def _offsets(case):
    cu, cu_k, ratio, _ = INVALID[case]
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), ratio


@pytest.mark.parametrize("case", list(INVALID))
def test_reference_rejects_invalid_offsets_by_default(case):
    q, k, w = _inputs()
    cu, cu_k, ratio = _offsets(case)
    with pytest.raises(ValueError, match=INVALID[case][3]):
        dsagen.lightning_indexer(q, k, w, 8, causal=True, compress_ratio=ratio, cu_seqlens=cu, cu_seqlens_k=cu_k,
                                 impl="reference")


@pytest.mark.parametrize("case", list(INVALID))
def test_check_off_reads_nothing(case):
    """check_offsets=False: the reference runs on whatever the offsets hold (ids in [-1, S), unspecified)."""
    q, k, w = _inputs()
    cu, cu_k, ratio = _offsets(case)
    out = dsagen.lightning_indexer(q, k, w, 8, causal=True, compress_ratio=ratio, cu_seqlens=cu, cu_seqlens_k=cu_k,
                                   impl="reference", check_offsets=False)
    assert out.shape == (1, T, 8) and ((out >= -1) & (out < S)).all()


def test_fused_checks_only_when_asked():
    """impl="fused" leaves the offsets unread by default (here the CPU tensors are refused for another reason);
    check_offsets=True rejects them before anything else runs."""
    q, k, w = _inputs()
    cu, cu_k, ratio = _offsets("decreasing")
    with pytest.raises(Exception) as unchecked:
        dsagen.lightning_indexer(q, k, w, 8, causal=True, cu_seqlens=cu, cu_seqlens_k=cu_k, impl="fused")
    assert "non-decreasing" not in str(unchecked.value)
    with pytest.raises(ValueError, match="non-decreasing"):
        dsagen.lightning_indexer(q, k, w, 8, causal=True, cu_seqlens=cu, cu_seqlens_k=cu_k, impl="fused",
                                 check_offsets=True)


@pytest.mark.parametrize("ratio", [1, 4])
def test_valid_offsets_pass_and_match_unchecked(ratio):
    lens = [1, 0, 23, 0, 20]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [n // ratio for n in lens]).cumsum(0).to(torch.int32)
    q, k, w = _inputs(1)
    checked = dsagen.lightning_indexer(q, k, w, 8, causal=True, compress_ratio=ratio, cu_seqlens=cu,
                                       cu_seqlens_k=cu_k, impl="reference")
    unchecked = dsagen.lightning_indexer(q, k, w, 8, causal=True, compress_ratio=ratio, cu_seqlens=cu,
                                         cu_seqlens_k=cu_k, impl="reference", check_offsets=False)
    assert torch.equal(checked, unchecked)
    check_offset_values(cu, cu_k, T, S, ratio)        # also directly: no error


def test_offsets_may_end_early():
    """Rows past cu_seqlens[-1] and pool capacity past cu_seqlens_k[-1] are allowed (ends at or before T / S)."""
    check_offset_values(torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32), T, S, 1)


def test_check_offsets_must_be_bool():
    q, k, w = _inputs()
    cu = torch.tensor([0, T], dtype=torch.int32)
    cu_k = torch.tensor([0, S], dtype=torch.int32)
    with pytest.raises(TypeError, match="check_offsets"):
        dsagen.lightning_indexer(q, k, w, 8, cu_seqlens=cu, cu_seqlens_k=cu_k, impl="reference", check_offsets=1)
