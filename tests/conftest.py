"""Shared test setup: `gpu` tests skip without CUDA; `compile` tests skip without CuTe-DSL."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _has_dsl() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_dsl = pytest.mark.skip(reason="needs CuTe-DSL (pip install -e '.[gen]')")
    has_cuda = torch.cuda.is_available()
    has_dsl = _has_dsl()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(no_gpu)
        if "compile" in item.keywords and not has_dsl:
            item.add_marker(no_dsl)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A private writable cache for one test (and no read-only layers, not even installed kernel wheels; JIT
    allowed)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DSAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("DSAGEN_CACHE_PATH", raising=False)
    monkeypatch.delenv("DSAGEN_DISABLE_JIT", raising=False)
    monkeypatch.setenv("DSAGEN_WHEEL_CACHES", "0")
    monkeypatch.setenv("DSAGEN_CACHE", "rw")
    return root


class _RowScatterStandIn:
    """The row scatter-add kernel's contract in torch (dsagen/kernels/row_scatter_add/scatter.py): for every
    r < n_acc, acc[r] += rows[order[j] - row0] for j from cursor[r] while j < ptr[r + 1] and order[j] < row1, in j
    order; cursor[r] then holds the first j not taken."""

    def launch(self, acc, rows, order, ptr, cursor, row0, row1, n_acc):
        for r in range(n_acc):
            j, end = int(cursor[r]), int(ptr[r + 1])
            while j < end and int(order[j]) < row1:
                acc[r] += rows[int(order[j]) - row0]
                j += 1
            cursor[r] = j


@pytest.fixture
def cpu_row_scatter(monkeypatch):
    """dsagen's row scatter-add (the deterministic backward modes' sum) on CPU tensors: its host code (the reverse
    index) with a torch stand-in for the kernel, for host-path tests that run without a GPU."""
    from dsagen.kernels.row_scatter_add import host as scatter_host

    monkeypatch.setattr(scatter_host, "_kernel", lambda device, width: _RowScatterStandIn())
