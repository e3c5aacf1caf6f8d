"""GPU tests of the foundation: compactify and local_to_global through the whole pipeline (spec ->
template -> cubin in the cache -> runtime), and each runtime capability (TMA descriptors encoded at
launch, dynamic smem above 48 KB, clusters, CUDA-graph capture, arch and param-layout checks).

Build what these need first (CPU, with CuTe-DSL):  dsagen build --spec-file tests/gpu/required_specs.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsagen
from dsagen.spec import CompactifySpec, LocalToGlobalSpec, RuntimeProbeSpec
from poison import POISON_INT32, poison_allocator

ARCH = "sm_90a"
SMEM_BYTES = 200 * 1024
REQUIRED_SPECS = [
    CompactifySpec(arch=ARCH),
    LocalToGlobalSpec(arch=ARCH),
    RuntimeProbeSpec(arch=ARCH, feature="tma"),
    RuntimeProbeSpec(arch=ARCH, feature="smem", smem_bytes=SMEM_BYTES),
    RuntimeProbeSpec(arch=ARCH, feature="cluster"),
    LocalToGlobalSpec(arch="sm_100a"),  # for the arch-mismatch test
]

pytestmark = pytest.mark.gpu


def _random_ids(rows: int, k: int, invalid_frac: float, gen: torch.Generator, hi: int = 1 << 20) -> torch.Tensor:
    ids = torch.randint(0, hi, (rows, k), generator=gen, dtype=torch.int32)
    mask = torch.rand((rows, k), generator=gen) < invalid_frac
    neg = torch.where(torch.rand((rows, k), generator=gen) < 0.5, -1, -7 - ids)  # -1 and other negatives
    return torch.where(mask, neg.to(torch.int32), ids)


SHAPES = [(1, 0), (1, 1), (3, 31), (5, 32), (7, 33), (64, 100), (1000, 2048), (257, 2051), (2, 4097)]


@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("invalid_frac", [0.0, 0.3, 1.0])
def test_compactify_matches_reference(rows, k, invalid_frac):
    gen = torch.Generator().manual_seed(rows * 7919 + k + int(invalid_frac * 10))
    ids = _random_ids(rows, k, invalid_frac, gen)
    if rows > 2:
        ids[1] = -1                                # an all-invalid row
    poison_allocator()
    out, lengths = dsagen.compactify(ids.cuda(), impl="fused")
    ref_out, ref_len = dsagen.compactify(ids, impl="reference")
    assert out.dtype == torch.int32 and lengths.dtype == torch.int32
    assert not (out == POISON_INT32).any() and not (lengths == POISON_INT32).any()
    assert torch.equal(out.cpu(), ref_out) and torch.equal(lengths.cpu(), ref_len)


@pytest.mark.parametrize("rows,k", [(9, 33), (300, 2048), (4, 5)])
def test_compactify_topk_length_and_strided_rows(rows, k):
    gen = torch.Generator().manual_seed(k)
    wide = _random_ids(rows, k + 13, 0.25, gen)
    ids = wide[:, 5:5 + k]                         # row stride k + 13: a non-contiguous view
    length = torch.randint(-3, k + 5, (rows,), generator=gen, dtype=torch.int32)
    length[0] = 0
    poison_allocator()
    out, lengths = dsagen.compactify(ids.cuda(), length.cuda(), impl="fused")
    ref_out, ref_len = dsagen.compactify(ids, length, impl="reference")
    assert torch.equal(out.cpu(), ref_out) and torch.equal(lengths.cpu(), ref_len)


def test_compactify_3d_flattens():
    gen = torch.Generator().manual_seed(3)
    ids = _random_ids(2 * 5, 70, 0.5, gen).view(2, 5, 70)
    length = torch.randint(0, 71, (2, 5), generator=gen)
    out, lengths = dsagen.compactify(ids.cuda(), length.cuda(), impl="fused")
    ref_out, ref_len = dsagen.compactify(ids, length, impl="reference")
    assert out.shape == (10, 70) and lengths.shape == (10,)
    assert torch.equal(out.cpu(), ref_out) and torch.equal(lengths.cpu(), ref_len)


@pytest.mark.parametrize("b,s_q,k,seqlen_k", [(1, 1, 1, 1), (3, 17, 33, 100), (4, 1024, 2048, 65536),
                                                (2, 3, 0, 5), (7, 5, 1031, 4096)])
def test_local_to_global_matches_reference(b, s_q, k, seqlen_k):
    gen = torch.Generator().manual_seed(b * 1000 + k)
    ids = torch.randint(-3, seqlen_k + 3, (b, s_q, k), generator=gen, dtype=torch.int32)
    poison_allocator()
    out = dsagen.local_to_global(ids.cuda(), seqlen_k, impl="fused")
    ref = dsagen.local_to_global(ids, seqlen_k, impl="reference")
    assert out.shape == ids.shape and out.is_contiguous()
    assert not (out == POISON_INT32).any()
    assert torch.equal(out.cpu(), ref)


def test_local_to_global_non_contiguous_input():
    ids = torch.randint(-1, 50, (3, 40, 8), dtype=torch.int32).transpose(1, 2)  # (3, 8, 40) strided
    out = dsagen.local_to_global(ids.cuda(), 50, impl="fused")
    assert torch.equal(out.cpu(), dsagen.local_to_global(ids, 50, impl="reference"))


def test_fused_ops_are_cuda_graph_capturable():
    ids = _random_ids(128, 300, 0.4, torch.Generator().manual_seed(5)).cuda()
    dsagen.compactify(ids, impl="fused")          # warm up: load the kernels before capture
    dsagen.local_to_global(ids.view(2, 64, 300), 1 << 20, impl="fused")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lengths = dsagen.compactify(ids, impl="fused")
        glob = dsagen.local_to_global(ids.view(2, 64, 300), 1 << 20, impl="fused")
    ids.copy_(_random_ids(128, 300, 0.7, torch.Generator().manual_seed(6)).cuda())  # new data, same buffers
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_len = dsagen.compactify(ids.cpu(), impl="reference")
    assert torch.equal(out.cpu(), ref_out) and torch.equal(lengths.cpu(), ref_len)
    assert torch.equal(glob.cpu(), dsagen.local_to_global(ids.view(2, 64, 300).cpu(), 1 << 20, impl="reference"))


# ---- runtime capabilities ---------------------------------------------------------------------------
def _kernel(spec):
    from dsagen.jit import get_kernel

    return get_kernel(spec, torch.device("cuda"))


@pytest.mark.parametrize("rows,cols,ld", [(1000, 1000, 1000), (77, 130, 132), (64, 64, 64), (1, 4, 4)])
def test_tma_descriptor_encoded_at_launch(rows, cols, ld):
    k = _kernel(RuntimeProbeSpec(arch=ARCH, feature="tma"))
    x = torch.randn(rows, ld, device="cuda")[:, :cols]
    out = torch.full((rows, cols), float("nan"), device="cuda")
    k.launch(x, out, rows, cols, out.stride(0), 3.0)
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3.0)
    # a second tensor at another address must not reuse the first descriptor
    x2 = torch.randn(rows, ld, device="cuda")[:, :cols]
    k.launch(x2, out, rows, cols, out.stride(0), -2.0)
    torch.cuda.synchronize()
    assert torch.equal(out, x2 * -2.0)


def test_tma_descriptor_rejects_misaligned_rows():
    k = _kernel(RuntimeProbeSpec(arch=ARCH, feature="tma"))
    x = torch.randn(10, 13, device="cuda")        # 52-byte rows: TMA needs 16-byte strides
    out = torch.empty(10, 13, device="cuda")
    with pytest.raises(ValueError, match="16-byte"):
        k.launch(x, out, 10, 13, 13, 1.0)


@pytest.mark.parametrize("n", [1, SMEM_BYTES // 4, 3 * SMEM_BYTES // 4 + 17])
def test_dynamic_smem_above_48k(n):
    k = _kernel(RuntimeProbeSpec(arch=ARCH, feature="smem", smem_bytes=SMEM_BYTES))
    assert k.smem == SMEM_BYTES
    x = torch.randn(n, device="cuda")
    out = torch.full((n,), float("nan"), device="cuda")
    k.launch(x, out, n)
    chunk = SMEM_BYTES // 4
    torch.cuda.synchronize()
    # out[start + j] = x[start + chunk - 1 - j]: reversed within each chunk, zeros read past n
    padded = torch.cat([x, torch.zeros((-n) % chunk, device="cuda")])
    expect = padded.view(-1, chunk).flip(1).reshape(-1)[:n]
    assert torch.equal(out, expect)


def test_cluster_launch():
    k = _kernel(RuntimeProbeSpec(arch=ARCH, feature="cluster"))
    assert k.cluster == (2, 1, 1)
    out = torch.full((10,), -1, dtype=torch.int32, device="cuda")
    k.launch(out, 10)
    torch.cuda.synchronize()
    b = torch.arange(10)
    assert torch.equal(out.cpu(), (b // 2) * 1000 + b % 2)


def test_zero_grid_launches_nothing():
    k = _kernel(LocalToGlobalSpec(arch=ARCH))
    x = torch.zeros(0, dtype=torch.int32, device="cuda")
    k.launch(x, x, 0, 1, 5)                        # ceil_div(0, 1024) == 0 blocks: no launch, no error


def test_misaligned_pointer_is_refused():
    from dsagen.jit import get_kernel

    k = get_kernel(RuntimeProbeSpec(arch=ARCH, feature="smem", smem_bytes=SMEM_BYTES), "cuda")
    x = torch.randn(64, device="cuda")
    raw = torch.empty(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="aligned"):
        k.launch(raw[1:].view(torch.uint8), x, 8)


def test_arch_mismatch_is_refused():
    from dsagen.runtime import KernelArchMismatch
    from dsagen.jit import get_kernel

    with pytest.raises(KernelArchMismatch, match="sm_100a"):
        get_kernel(LocalToGlobalSpec(arch="sm_100a"), "cuda")


def test_param_layout_checked_against_driver():
    from dsagen.jit import resolve
    from dsagen.runtime import LoadedKernel

    entry = resolve(LocalToGlobalSpec(arch=ARCH))
    record = dict(entry.manifest["kernel"])
    record["params"] = [dict(p) for p in record["params"]]
    record["params"][2]["offset"] += 8
    with pytest.raises(RuntimeError, match="offset"):
        LoadedKernel("tampered", record, entry.read("kernel.cubin"), ARCH, 0, ARCH)
    record["params"] = record["params"][:-1]
    with pytest.raises(RuntimeError):
        LoadedKernel("tampered", record, entry.read("kernel.cubin"), ARCH, 0, ARCH)


def test_runtime_runs_without_cutlass_importable():
    """A deployment: importing cutlass raises, JIT is impossible; kernels come from the shipped cache."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "cutlass" or name.startswith("cutlass."):
                    raise ImportError("cutlass is blocked in this test")
        sys.meta_path.insert(0, Block())
        import torch, dsagen
        from dsagen.jit import toolchain
        toolchain.toolchain_versions.cache_clear()
        toolchain.toolchain_versions = lambda: {}      # as if CuTe-DSL were not installed
        ids = torch.tensor([[5, -1, 7]], dtype=torch.int32, device="cuda")
        out, n = dsagen.compactify(ids, impl="fused")
        assert out.tolist() == [[5, 7, -1]] and n.tolist() == [2], (out, n)
        assert not any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
