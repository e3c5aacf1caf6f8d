"""Edge cases of the public ops' arguments: a top-k width whose outputs cannot be allocated is a
ValueError naming the argument and the size, raised before anything is allocated, for impl="reference"
and impl="fused" alike (the width is checked before the op dispatches)."""

from __future__ import annotations

import pytest
import torch

import dsagen
from dsagen.validate import MAX_TOPK, check_topk, device_memory_bytes

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
IMPLS = ["reference", "fused"]


def _rows_beyond_memory(device: str, slot_bytes: int) -> int:
    """A row count for which MAX_TOPK slots of slot_bytes per row exceed the device's whole memory."""
    return device_memory_bytes(torch.device(device)) // (MAX_TOPK * slot_bytes) + 1


def _free(shape, device, dtype=torch.float32):
    """A tensor of `shape` that costs one element (a broadcast view): the rows are never materialized."""
    return torch.zeros((1,) * len(shape), device=device, dtype=dtype).expand(*shape)


def _indexer_topk(device, impl, width, rows):
    return dsagen.indexer_topk(_free((rows, 4), device), torch.full((1,), 4, dtype=torch.int32, device=device),
                               width, impl=impl)


def _indexer_forward_topk(device, impl, width, rows):
    return dsagen.indexer_forward_topk(_free((1, rows, 1, 8), device), _free((1, 4, 8), device),
                                       _free((1, rows, 1), device), width, impl=impl)


def _nsa(device, impl, width, rows):
    x = _free((1, rows, 1, 8), device)
    return dsagen.native_sparse_attention(x, x, x, g_cmp=_free((1, rows, 1), device), block_counts=width,
                                          block_size=4, impl=impl)


def _lightning_indexer(device, impl, width, rows):
    return dsagen.lightning_indexer(_free((1, rows, 1, 8), device), _free((1, rows, 8), device),
                                    _free((1, rows, 1), device), width, impl=impl)


# Each case: op name, the width's argument name, call(device, impl, width, rows), bytes per output slot,
# and the outputs' leading shape for `rows` query rows.
_CASES = [
    ("indexer_topk", "top_k", _indexer_topk, 4 + 4, lambda rows: (rows,)),
    ("indexer_forward_topk", "top_k", _indexer_forward_topk, 4 + 4 + 4, lambda rows: (1, rows)),
    ("native_sparse_attention", "block_counts", _nsa, 8, lambda rows: (1, rows, 1)),
    ("lightning_indexer", "topk", _lightning_indexer, 4, lambda rows: (1, rows)),
]
CASES = [pytest.param(*c, id=c[0]) for c in _CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("width", [MAX_TOPK + 1, 2**40, 2**62, 2**63, 2**64])
@pytest.mark.parametrize("op,arg,call,slot_bytes,lead", CASES)
def test_width_beyond_int32_is_a_value_error(op, arg, call, slot_bytes, lead, width, impl, device):
    with pytest.raises(ValueError, match=rf"^{arg} must be <= 2\*\*31 - 1 = 2147483647 \(ids and widths are "
                                         rf"int32\), got {width}$"):
        call(device, impl, width, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,arg,call,slot_bytes,lead", CASES)
def test_outputs_beyond_device_memory_are_a_value_error(op, arg, call, slot_bytes, lead, impl, device):
    rows = _rows_beyond_memory(device, slot_bytes)
    need = rows * MAX_TOPK * slot_bytes
    with pytest.raises(ValueError) as info:
        call(device, impl, MAX_TOPK, rows)
    shape = ", ".join(map(str, (*lead(rows), MAX_TOPK)))
    msg = str(info.value)
    assert msg.startswith(f"{arg}={MAX_TOPK} needs outputs of shape [{shape}] ("), msg
    assert f"({need} bytes), more than the " in msg and msg.endswith(f"of memory on {device}"), msg


@pytest.mark.parametrize("op,arg,call,slot_bytes,lead", CASES)
def test_widths_that_fit_still_work(op, arg, call, slot_bytes, lead):
    """A width above the candidates (padded) and zero are still answers, not errors."""
    if op == "native_sparse_attention":
        out = call("cpu", "reference", 50, 8)
        assert out.shape == (1, 8, 1, 8)
        return
    out = call("cpu", "reference", 50, 8)
    indices = out if isinstance(out, torch.Tensor) else out[0]
    assert indices.shape[-1] == 50 and indices.dtype == torch.int32
    assert (indices[..., 8:] == -1).all()                                # past every row's candidates
    empty = call("cpu", "reference", 0, 8)
    assert (empty if isinstance(empty, torch.Tensor) else empty[0]).shape[-1] == 0


@pytest.mark.parametrize("op,arg,call,slot_bytes,lead", CASES)
def test_negative_and_non_int_widths(op, arg, call, slot_bytes, lead):
    with pytest.raises(ValueError, match=rf"^{arg} must be >= 0, got -1$"):
        call("cpu", "reference", -1, 8)
    for bad in (2.0, True, "8"):
        with pytest.raises(TypeError, match=rf"^{arg} must be an int"):
            call("cpu", "reference", bad, 8)


def test_check_topk_rules():
    cpu = torch.device("cpu")
    mem = device_memory_bytes(cpu)
    assert isinstance(mem, int) and mem > 2**20
    assert device_memory_bytes("cpu") == mem
    assert device_memory_bytes(torch.device("meta")) is None
    assert check_topk("topk", 0, (10**30,), 4, cpu) == 0                  # nothing to allocate
    assert check_topk("k", 2048, (2**40,), 4, torch.device("meta")) == 2048  # unknown memory: no byte check
    rows = mem // 4 + 1
    with pytest.raises(ValueError, match=rf"^k=1 needs outputs of shape \[{rows}, 1\] \(int32\) taking "):
        check_topk("k", 1, (rows,), 4, cpu, what="int32")
    assert check_topk("k", 1, (mem // 8,), 4, cpu) == 1
    assert check_topk("k", 3, (), 4, cpu) == 3
