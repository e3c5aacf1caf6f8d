"""GPU tests of the fused sparse MLA backward (sm_90a kernel of SparseAttnBwdSpec, through
dsagen.kernels.sparse_mla_bwd.host.sparse_attention_backward) against the plain-PyTorch reference backward run in
FP64 on the same out / lse / dout: H 64/128 natively and 16/32 padded, D_qk 512/576 with d_v 512, top-k widths that
are and are not multiples of 64, topk_length shorter than the width, -1, negative and out-of-range ids, duplicates,
all-invalid rows, with and without sink, total_S_q = 1, grids smaller than the item count, and the deterministic
mode (two runs compared bitwise); and the window-ordering kernel (order.py) against a stable sort of each row's valid
ids by window.

Build what these need first (CPU, with CuTe-DSL):
    dsagen build --spec-file tests/gpu/required_specs.json
The tests named *adversarial* are the ones to run under compute-sanitizer.
"""

from __future__ import annotations

import pytest
import torch

from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.kernels.sparse_mla_bwd import host as bwd_host
from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdConfig, SparseAttnBwdOrderSpec, config_for
from dsagen.reference import sparse_attention as ref
from test_sparse_attention import make_ids

ARCH = "sm_90a"
REQUIRED_SPECS = [config_for(h, d, "bfloat16", ARCH, None).spec(h, d, "bfloat16", ARCH, deterministic=det)
                  for h in (64, 128) for d in (512, 576) for det in (False, True)] + [
    config_for(64, 576, "float16", ARCH, None).spec(64, 576, "float16", ARCH), SparseAttnBwdOrderSpec(arch=ARCH)] + [
    RowScatterAddSpec(arch=ARCH, width=d) for d in (512, 576)]

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_case(s_q, h, d_qk, n_kv, k, *, sink=True, adversarial=False, length=False, seed=0, dtype=torch.bfloat16):
    """Random bf16 (or `dtype`) inputs and the reference forward's out / lse (FP32 on the GPU, out rounded to the
    inputs' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn((s_q, h, d_qk), generator=gen) * 0.5).to(dtype).to(DEV)
    kv = (torch.randn((n_kv, d_qk), generator=gen) * 0.5).to(dtype).to(DEV)
    ids = make_ids(s_q, k, n_kv, gen, adversarial=adversarial).to(DEV)
    attn_sink = (torch.randn(h, generator=gen)).to(DEV) if sink else None
    topk_length = torch.randint(0, k + 1, (s_q,), generator=gen, dtype=torch.int32).to(DEV) if length else None
    dout = torch.randn((s_q, h, 512), generator=gen).to(dtype).to(DEV)
    scale = d_qk ** -0.5
    out, lse, _ = ref.sparse_attention_forward(q.float(), kv.float(), ids, attn_sink=attn_sink,
                                               topk_length=topk_length, softmax_scale=scale, d_v=512)
    return dict(q=q, kv=kv, out=out.to(dtype), dout=dout, lse=lse.float(), topk_idxs=ids, attn_sink=attn_sink,
                topk_length=topk_length, softmax_scale=scale)


def reference(c):
    """The reference backward in FP64 on the case's (bf16) inputs."""
    dq, dkv, d_sink = ref.sparse_attention_backward(
        c["q"].double(), c["kv"].double(), c["out"].double(), c["dout"].double(), c["lse"].double(),
        None if c["attn_sink"] is None else c["attn_sink"].double(), c["topk_idxs"], topk_length=c["topk_length"],
        softmax_scale=c["softmax_scale"], d_v=512)
    return dq, dkv, d_sink


def fused(c, deterministic=False, config=None, workspace=None):
    return bwd_host.sparse_attention_backward(
        c["q"], c["kv"], c["out"], c["dout"], c["lse"], c["topk_idxs"], attn_sink=c["attn_sink"],
        topk_length=c["topk_length"], softmax_scale=c["softmax_scale"], d_v=512, deterministic=deterministic,
        workspace=workspace, config=config)


def assert_close(name, got, want, tol=1e-2):
    """max |got - want| <= tol * max |want| (bf16 outputs of sums over thousands of bf16 products)."""
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"{name}: max abs error {err:.3e} vs max |ref| {scale:.3e}"


def check(c, **kw):
    dq, dkv, d_sink = fused(c, **kw)
    rq, rkv, rsink = reference(c)
    assert dq.shape == c["q"].shape and dq.dtype == c["q"].dtype
    assert dkv.shape == c["kv"].shape and dkv.dtype == c["kv"].dtype
    assert_close("dq", dq, rq)
    assert_close("dkv", dkv, rkv)
    if rsink is None:
        assert d_sink is None
    else:
        assert_close("d_sink", d_sink, rsink)
    return dq, dkv, d_sink


@pytest.mark.parametrize("h,d_qk", [(64, 576), (128, 576), (64, 512), (128, 512)])
@pytest.mark.parametrize("k", [64, 200])
def test_backward_matches_reference(h, d_qk, k):
    check(make_case(19, h, d_qk, 700, k, seed=h + d_qk + k))


@pytest.mark.parametrize("h", [16, 32])
def test_padded_heads(h):
    check(make_case(11, h, 576, 300, 128, seed=h))


@pytest.mark.parametrize("sink", [False, True])
def test_sink_on_off_with_length(sink):
    check(make_case(23, 64, 576, 500, 256, sink=sink, length=True, seed=int(sink)))


@pytest.mark.parametrize("h", [64, 128])
def test_adversarial_ids(h):
    check(make_case(17, h, 576, 400, 192, adversarial=True, length=True, seed=7 + h))


def test_single_row_and_empty_rows_adversarial():
    c = make_case(1, 64, 576, 100, 64, seed=3)
    check(c)
    c = make_case(5, 64, 576, 100, 64, adversarial=True, seed=4)
    c["topk_idxs"][2] = -1                                    # a row without a valid slot: zero gradients
    dq, dkv, d_sink = check(c)
    assert dq[2].abs().max().item() == 0.0


def test_duplicate_ids_add():
    c = make_case(4, 64, 576, 50, 128, seed=5)
    c["topk_idxs"][:, 64:] = c["topk_idxs"][:, :64]          # every id twice in each row: two slots, two terms
    check(c)


def test_looping_grid():
    c = make_case(13, 128, 576, 300, 130, length=True, seed=9)
    check(c, config=SparseAttnBwdConfig(grid=3))


def test_deterministic_bitwise_adversarial():
    c = make_case(29, 128, 576, 64, 256, adversarial=True, length=True, seed=11)   # few rows: many duplicates
    a = check(c, deterministic=True)
    b = fused(c, deterministic=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_float16():
    check(make_case(13, 64, 576, 400, 192, adversarial=True, length=True, seed=13, dtype=torch.float16))


def test_grid_larger_than_the_sms():
    """More CTAs than SMs (the host leaves the grid barrier off then: not every CTA is resident at once)."""
    c = make_case(400, 64, 512, 5000, 128, length=True, seed=14)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    check(c, config=SparseAttnBwdConfig(grid=2 * sms, bucket_rows=1024))


def test_workspace():
    c = make_case(9, 64, 576, 200, 128, seed=12)
    n = bwd_host.workspace_numel(9, 64, 200, 128, 576, False)
    ws = torch.full((n,), float("nan"), device=DEV)
    check(c, workspace=ws)
    with pytest.raises(ValueError, match="workspace"):
        fused(c, workspace=ws[:10])


def window_order_oracle(idx, n_kv, length, bucket):
    """Per row: its valid ids (0 <= id < n_kv, slot < length) stably sorted by id // bucket."""
    rows = []
    for t in range(idx.shape[0]):
        n = idx.shape[1] if length is None else max(0, min(int(length[t]), idx.shape[1]))
        rows.append(sorted((int(v) for v in idx[t, :n] if 0 <= v < n_kv), key=lambda v: v // bucket))
    return rows


@pytest.mark.parametrize("n_kv,bucket,k", [(100, 16, 50), (4000, 10, 300), (32768, 4096, 2048), (300000, 64, 1000),
                                           (5000, 1, 77)],
                         ids=["7w", "400w-wider", "8w-model", "4688w-wider", "5000w-wider"])
@pytest.mark.parametrize("with_length", [False, True], ids=["full", "length"])
def test_window_order_kernel_adversarial(n_kv, bucket, k, with_length):
    """Each row's valid ids in stable window order, then -1, and the window [0, count): -1, negative and
    out-of-range ids, duplicates, an all-invalid row, lengths below 0 and past the width, row widths that are not
    multiples of 32, a strided view; more windows than max_windows order by ceil(n_kv / max_windows)-row windows."""
    gen = torch.Generator().manual_seed(n_kv + k)
    s_q = 37
    full = torch.randint(-50, n_kv + 50, (s_q, k + 3), generator=gen, dtype=torch.int32)
    full[:, 7:17] = full[:, 0:10]                                # duplicates
    full[3] = -1                                                 # a row without a valid id
    idx = full[:, :k]                                            # row stride k + 3
    length = torch.randint(-5, k + 20, (s_q,), generator=gen, dtype=torch.int32) if with_length else None
    ids = torch.full((s_q, k), 12345, dtype=torch.int32, device=DEV)
    win = torch.full((s_q, 2), 12345, dtype=torch.int32, device=DEV)
    bwd_host.slot_windows(full.to(DEV)[:, :k], n_kv, None if length is None else length.to(DEV), bucket,
                          ids_out=ids, win_out=win)
    wide = max(bucket, -(-n_kv // SparseAttnBwdOrderSpec(arch=ARCH).max_windows))
    ids, win = ids.cpu(), win.cpu()
    for t, want in enumerate(window_order_oracle(idx, n_kv, length, wide)):
        assert win[t].tolist() == [0, len(want)], t
        assert ids[t, :len(want)].tolist() == want, t
        assert (ids[t, len(want):] == -1).all(), t


def test_window_ordered_backward_adversarial():
    """The backward with 64-row KV windows (ordering on) and a grid smaller than the items, on adversarial ids and
    lengths, at both head counts."""
    for h in (64, 128):
        c = make_case(21, h, 576, 900, 320, adversarial=True, length=True, seed=30 + h)
        check(c, config=SparseAttnBwdConfig(grid=5, bucket_rows=64))
