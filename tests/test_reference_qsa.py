"""Reference QSA (FlashInfer QSA): indexed and bitmap forwards against brute-force loops, dense causal
attention, each other, FlashInfer QSA's head/dim configurations, edge cases and validation errors."""

from __future__ import annotations

import math

import pytest
import torch

import dsagen
from dsagen.reference import qsa as ref

INF = float("inf")


def brute_force(q, k, v, allowed_tokens, scale):
    """allowed_tokens(t) -> list of key token ids (repeats allowed). FP64 loops: (out, lse [Hq, T])."""
    t_len, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(t_len, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, t_len), -INF, dtype=torch.float64)
    for t in range(t_len):
        toks = allowed_tokens(t)
        if not toks:
            continue
        for h in range(hq):
            s = [scale * float(q[t, h].double() @ k[u, h // g].double()) for u in toks]
            m = max(s)
            z = sum(math.exp(x - m) for x in s)
            lse[h, t] = m + math.log(z)
            for x, u in zip(s, toks):
                out[t, h] += math.exp(x - lse[h, t].item()) * v[u, h // g].double()
    return out, lse


def qkv(t=10, hq=4, hkv=2, d=8, dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, dv or d)


def causal_indices(t_len):
    token = torch.arange(t_len, dtype=torch.int32)
    return torch.where(token[None, :] <= token[:, None], token[None, :], -1)


def pad_width(indices):
    w = -(-indices.shape[1] // 4) * 4
    return torch.cat([indices, indices.new_full((indices.shape[0], w - indices.shape[1]), -1)], 1)


def sdpa_causal(q, k, v, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("thd,uhd->htu", q.double(), kk.double()) * scale
    s = s.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), -INF)
    return torch.einsum("htu,uhd->thd", torch.softmax(s, -1), vv.double()), torch.logsumexp(s, -1)


def test_seed_example_is_dense_causal_attention():
    """FlashInfer QSA's example: every token up to the query, in four-slot groups -> causal attention."""
    q, k, v = qkv(t=8, hq=12, hkv=1, d=256, dtype=torch.bfloat16)
    out, out_fp32, lse = dsagen.qsa_indexed_forward(q, k, v, causal_indices(8), impl="reference")
    assert out.dtype == torch.bfloat16 and out.shape == (8, 12, 256)
    assert out_fp32.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (12, 8)
    e_out, e_lse = sdpa_causal(q, k, v, 1 / 16)
    torch.testing.assert_close(out_fp32.double(), e_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), e_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_fp32.to(torch.bfloat16), atol=0, rtol=0)
    bitmap = torch.ones(8, 2, dtype=torch.uint8)
    b_out, b_fp32, b_lse = dsagen.qsa_bitmap_forward(q, k, v, bitmap, impl="reference")
    torch.testing.assert_close(b_fp32, out_fp32)
    torch.testing.assert_close(b_lse, lse)


@pytest.mark.parametrize("hq,hkv", [(12, 1), (24, 2)])
def test_seed_head_configurations_bitmap(hq, hkv):
    t_len = 9
    q, k, v = qkv(t=t_len, hq=hq, hkv=hkv, d=256, dtype=torch.bfloat16, seed=hq)
    g = torch.Generator().manual_seed(hq + 1)
    bitmap = torch.randint(0, 2, (t_len, 3), generator=g, dtype=torch.uint8)
    out, out_fp32, lse = dsagen.qsa_bitmap_forward(q, k, v, bitmap, impl="reference")
    allowed = lambda t: [u for u in range(t + 1) if bitmap[t, u // 4]]
    e_out, e_lse = brute_force(q, k, v, allowed, 1 / 16)
    torch.testing.assert_close(out_fp32.double(), e_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), e_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_indexed_matches_brute_force(dtype):
    t_len = 11
    q, k, v = qkv(t=t_len, hq=6, hkv=2, d=5, dv=3, dtype=dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, t_len, (t_len, 12), generator=g, dtype=torch.int32)
    idx[0] = -1                                       # empty row
    idx[1, :4] = torch.tensor([2, 2, 2, 2])           # repeats count once per slot
    idx[2, 0] = t_len + 5                             # out of range: skipped, never read
    out, out_fp32, lse = dsagen.qsa_indexed_forward(q, k, v, idx, 0.3, impl="reference")
    allowed = lambda t: [int(u) for u in idx[t] if 0 <= int(u) < t_len]
    e_out, e_lse = brute_force(q, k, v, allowed, 0.3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out_fp32.double(), e_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), e_lse, atol=tol, rtol=tol)
    assert torch.all(out[0] == 0) and torch.all(lse[:, 0] == -INF)


def block_tokens_varlen(cu):
    """Global block list: (first token, end token) per four-token block, restarting per sequence."""
    blocks = []
    for a, b in zip(cu, cu[1:]):
        blocks += [(s, min(s + 4, b)) for s in range(a, b, 4)]
    return blocks


def test_bitmap_varlen_blocks_restart_and_stay_in_sequence():
    cu = [0, 6, 6, 13]  # includes an empty sequence; 2 + 0 + 2 blocks
    t_len = 13
    q, k, v = qkv(t=t_len, hq=4, hkv=1, d=6, seed=4)
    blocks = block_tokens_varlen(cu)
    assert len(blocks) == 4
    g = torch.Generator().manual_seed(5)
    bitmap = torch.randint(0, 3, (t_len, 4), generator=g, dtype=torch.uint8)  # any nonzero selects
    bitmap[6] = 0                                                             # an empty row
    bitmap[7, 0] = 1                                                          # another sequence's block
    out, out_fp32, lse = dsagen.qsa_bitmap_forward(q, k, v, bitmap, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                                   impl="reference")

    def allowed(t):
        start = max(a for a in cu[:-1] if a <= t and any(x > t for x in cu if x > a))
        return [u for bi, (a, b) in enumerate(blocks) if bitmap[t, bi] for u in range(a, b) if start <= u <= t]

    e_out, e_lse = brute_force(q, k, v, allowed, 1 / math.sqrt(6))
    torch.testing.assert_close(out_fp32, e_out)
    torch.testing.assert_close(lse, e_lse)
    assert torch.all(out[6] == 0) and torch.all(lse[:, 6] == -INF)


def test_indexed_and_bitmap_agree_on_block_selections():
    """A bitmap and the index rows it expands to (complete groups, causal tail, -1 padding) agree."""
    t_len = 14
    q, k, v = qkv(t=t_len, hq=4, hkv=2, d=8, seed=6)
    g = torch.Generator().manual_seed(7)
    bitmap = torch.randint(0, 2, (t_len, 4), generator=g, dtype=torch.bool)
    rows = []
    for t in range(t_len):
        row = []
        for b in reversed(range(4)):  # groups may appear in any order
            if bitmap[t, b] and 4 * b <= t:
                row += [u if u <= t and u < t_len else -1 for u in range(4 * b, 4 * b + 4)]
        rows.append(row + [-1] * (16 - len(row)))
    idx = torch.tensor(rows, dtype=torch.int32)
    a = dsagen.qsa_indexed_forward(q, k, v, idx, impl="reference")
    b = dsagen.qsa_bitmap_forward(q, k, v, bitmap, impl="reference")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_chunking_gives_the_same_result(monkeypatch):
    from dsagen.reference import sparse_attention as sa_ref
    q, k, v = qkv(t=9, seed=8)
    idx = pad_width(causal_indices(9))
    bitmap = torch.ones(9, 3, dtype=torch.uint8)
    full = dsagen.qsa_indexed_forward(q, k, v, idx, impl="reference") + \
        dsagen.qsa_bitmap_forward(q, k, v, bitmap, impl="reference")
    monkeypatch.setattr(sa_ref, "CHUNK_ELEMENTS", 1)
    chunked = dsagen.qsa_indexed_forward(q, k, v, idx, impl="reference") + \
        dsagen.qsa_bitmap_forward(q, k, v, bitmap, impl="reference")
    for x, y in zip(full, chunked):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_single_token_and_all_empty():
    q, k, v = qkv(t=1, hq=2, hkv=1, d=4, seed=9)
    out, _, lse = dsagen.qsa_indexed_forward(q, k, v, torch.tensor([[0, -1, -1, -1]], dtype=torch.int32),
                                             impl="reference")
    torch.testing.assert_close(out, v.expand(1, 2, 4))
    torch.testing.assert_close(lse[:, 0], (q[0] @ k[0, 0]) / 2)
    out, out_fp32, lse = dsagen.qsa_bitmap_forward(q, k, v, torch.zeros(1, 1, dtype=torch.uint8), impl="reference")
    assert torch.all(out_fp32 == 0) and torch.all(lse == -INF)


# ----------------------------------------------------------------------------------------------------
# dispatch and validation


def test_fused_on_cpu_raises_value_error_and_is_the_default():
    q, k, v = qkv(t=4)
    with pytest.raises(ValueError, match="qsa_indexed_forward"):
        dsagen.qsa_indexed_forward(q, k, v, causal_indices(4))
    with pytest.raises(ValueError, match="qsa_bitmap_forward"):
        dsagen.qsa_bitmap_forward(q, k, v, torch.ones(4, 1, dtype=torch.uint8), impl="fused")


def test_validation_names_the_argument():
    q, k, v = qkv(t=8)
    idx = causal_indices(8)
    bm = torch.ones(8, 2, dtype=torch.uint8)
    r = dict(impl="reference")
    fi, fb = dsagen.qsa_indexed_forward, dsagen.qsa_bitmap_forward
    checks = [
        (lambda: fi(q, k, v, idx, impl="gpu"), ValueError, "impl"),
        (lambda: fi(q[0], k, v, idx, **r), ValueError, "q"),
        (lambda: fi(q.int(), k, v, idx, **r), TypeError, "q"),
        (lambda: fi(q, k.float(), v, idx, **r), TypeError, "k"),
        (lambda: fi(q, k[:5], v, idx, **r), ValueError, "k"),
        (lambda: fi(q, k[:, :1].expand(8, 3, 8), v, idx, **r), ValueError, "k"),   # 4 % 3 != 0
        (lambda: fi(q, k, v[:, :1], idx, **r), ValueError, "v"),
        (lambda: fi(q, k, v, idx.long(), **r), TypeError, "indices"),
        (lambda: fi(q, k, v, idx[:, :6], **r), ValueError, "indices"),              # width not % 4
        (lambda: fi(q, k, v, idx[:, :0], **r), ValueError, "indices"),              # width 0
        (lambda: fi(q, k, v, torch.full((8, 2056), -1, dtype=torch.int32), **r), ValueError, "indices"),
        (lambda: fi(q, k, v, idx[:4], **r), ValueError, "indices"),
        (lambda: fi(q, k, v, idx, float("inf"), **r), ValueError, "scale"),
        (lambda: fi(q, k, v, idx, "x", **r), TypeError, "scale"),
        (lambda: fb(q, k, v, bm.int(), **r), TypeError, "block_bitmap"),
        (lambda: fb(q, k, v, bm[:, :1], **r), ValueError, "block_bitmap"),
        (lambda: fb(q, k, v, bm, cu_seqlens=torch.tensor([0, 8]), **r), TypeError, "cu_seqlens"),
        (lambda: fb(q, k, v, bm, cu_seqlens=torch.tensor([0, 9], dtype=torch.int32), **r), ValueError, "cu_seqlens"),
        (lambda: fb(q, k, v, bm, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32), **r), ValueError,
         "cu_seqlens"),
        (lambda: fb(q, k, v, bm, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), **r), ValueError,
         "block_bitmap"),  # 1 + 2 = 3 blocks with the sequences restarting
    ]
    for fn, exc, name in checks:
        with pytest.raises(exc, match=name):
            fn()


def test_reference_block_layout():
    block, starts, nb = ref.bitmap_token_layout(13, torch.tensor([0, 6, 6, 13]), torch.device("cpu"))
    assert nb == 4
    assert block.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert starts.tolist() == [0] * 6 + [6] * 7
