"""Host side of the fused NSA compressed branch (`native_sparse_attention(..., g_cmp=...)`, forward): the mean-pooled
keys and values (`mean_pool`, torch, a fixed summation order), the compressed attention (select_fwd_sm90 with
compressed=True: NsaCmpFwdSpec), the blocks' importance from its LSE (cmp_importance_sm90) and the selection
(cmp_topk_sm90), in chunks of tokens whose FP32 importance rows fit in IMP_SCRATCH_BYTES. Nothing is read back to
the host: the sizes follow from the shapes (the compressed rows and the longest sequence's blocks are bounded by
ceil(N / block_size) + sequences), so the calls are graph-capturable.

`compressed_branch(ops, n_select)` returns (o_cmp [N, HQ, Dv], lse_cmp [N, HQ], sel int32 [N, H, n_select]); the
selected branch then runs on sel (host.py).
"""

from __future__ import annotations

import torch

from ...runtime import device_arch, device_index
from .spec import CMP_TILE, NSA_MAX_SLOTS, NsaCmpTopkSpec, cmp_fwd_spec_for, cmp_importance_spec_for, item_tokens

IMP_SCRATCH_BYTES = 256 << 20     # the FP32 importance rows of one chunk of tokens, at most (or one item's)


class CompressedRows:
    """Where each sequence's compressed rows start. For packed sequences (ops.n_docs > 0) `ccu` int32 [n_docs + 1]
    (cumulative ceil(len_i / block_size)); for sequences of ops.t tokens row i * ceil(T / block_size) (ccu unused).
    n_keys: the compressed rows' count bound (the pooled tensors' rows); blocks: the most blocks a sequence has (a
    bound with packed sequences: ceil(N / block_size))."""

    def __init__(self, ops):
        bs = ops.block_size
        if ops.n_docs == 0:
            self.blocks = -(-ops.t // bs)
            self.n_keys = ops.b * self.blocks
            self.ccu = ops.cu                 # not read by the kernels (n_docs == 0)
        else:
            cu = ops.cu.long()
            per_seq = torch.div(cu[1:] - cu[:-1] + bs - 1, bs, rounding_mode="floor")
            ccu = torch.zeros(ops.n_docs + 1, dtype=torch.long, device=cu.device)
            ccu[1:] = torch.cumsum(per_seq, 0)
            self.ccu = ccu.to(torch.int32)
            self.blocks = -(-ops.n_tok // bs)
            self.n_keys = self.blocks + ops.n_docs
        self.tiles = -(-self.blocks // CMP_TILE)


def mean_pool(x3: torch.Tensor, ops, rows: CompressedRows) -> torch.Tensor:
    """`[n_keys, H, dim]` in x3's dtype: compressed row j of a sequence is the mean of its tokens [j bs, (j + 1) bs)
    (a partial last block padded with zeros: the sum divided by bs), summed in FP32 in token order; rows past the last
    sequence's are zeros. x3: `[N, H, dim]`."""
    bs, dev = ops.block_size, x3.device
    j = torch.arange(rows.n_keys, device=dev)
    if ops.n_docs == 0:
        seq = torch.div(j, rows.blocks, rounding_mode="floor")
        tok0 = seq * ops.t + (j - seq * rows.blocks) * bs
        end = (seq + 1) * ops.t
    else:
        ccu, cu = rows.ccu.long(), ops.cu.long()
        seq = torch.searchsorted(ccu[1:], j, right=True).clamp(max=ops.n_docs - 1)
        tok0 = cu[seq] + (j - ccu[seq]) * bs
        end = torch.where(j < ccu[-1], cu[seq + 1], tok0)         # rows past the last sequence's: no tokens
    tok = tok0[:, None] + torch.arange(bs, device=dev)
    valid = tok < end[:, None]
    parts = x3[tok.clamp(0, max(ops.n_tok - 1, 0))].float() * valid[..., None, None]
    return (parts.sum(1) / bs).to(x3.dtype)


def compressed_branch(ops, n_select: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o_cmp [N, HQ, Dv] in q's dtype, lse_cmp [N, HQ] FP32 natural log (-inf: no complete block yet), sel int32
    [N, H, n_select]) for `ops` (host._Operands; block ids not read). NotImplementedError where the kernels do not
    reach (more than NSA_MAX_SLOTS tiles of 64 compressed rows per sequence)."""
    rows = CompressedRows(ops)
    if rows.tiles > NSA_MAX_SLOTS:
        raise NotImplementedError(f"native_sparse_attention: the compressed branch takes at most "
                                  f"{NSA_MAX_SLOTS * CMP_TILE} compressed rows per sequence (sequences up to "
                                  f"{NSA_MAX_SLOTS * CMP_TILE * ops.block_size} tokens), got up to {rows.blocks}")
    from .host import LOG2E, _kernel
    dev = ops.q3.device
    n, hq, h = ops.n_tok, ops.hq, ops.h
    out = torch.empty((n, hq, ops.dv), dtype=ops.q3.dtype, device=dev)
    lse = torch.empty((n, hq), dtype=torch.float32, device=dev)
    sel = torch.empty((n, h, n_select), dtype=torch.int32, device=dev)
    if n == 0:
        return out, lse, sel
    k_cmp, v_cmp = mean_pool(ops.k3, ops, rows), mean_pool(ops.v3, ops, rows)
    arch = device_arch(device_index(dev))
    tok = item_tokens(ops.g)
    sched = (ops.n_tok, ops.t, ops.n_docs, h)
    _kernel(dev, cmp_fwd_spec_for(ops.g, ops.d, ops.dv, rows.tiles, ops.dtype_name, arch)).launch(
        ops.q3, k_cmp, v_cmp, rows.ccu, ops.cu, out, lse, *sched, -(-n // tok), rows.tiles, ops.block_size,
        rows.n_keys, ops.scale * LOG2E)
    if n_select == 0:
        return out, lse, sel
    imp_spec = cmp_importance_spec_for(ops.g, ops.d, rows.tiles, ops.dtype_name, arch)
    topk = _kernel(dev, NsaCmpTopkSpec(arch=arch))
    row_bytes = h * rows.blocks * 4
    chunk = max(tok, IMP_SCRATCH_BYTES // row_bytes // tok * tok)
    imp = torch.empty((min(chunk, n), h, rows.blocks), dtype=torch.float32, device=dev)
    for begin in range(0, n, chunk):
        end = min(n, begin + chunk)
        _kernel(dev, imp_spec).launch(ops.q3, k_cmp, rows.ccu, ops.cu, lse, imp, end, ops.t, ops.n_docs, h,
                                      -(-(end - begin) // tok), rows.tiles, ops.block_size, rows.n_keys, begin,
                                      rows.blocks, ops.scale * LOG2E)
        topk.launch(imp, ops.cu, sel, end, begin, ops.t, ops.n_docs, h, ops.block_size, n_select, rows.blocks,
                    float(ops.g))
    return out, lse, sel
