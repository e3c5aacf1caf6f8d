"""Host side of the fused NSA compressed branch (`native_sparse_attention(..., g_cmp=...)`): the mean-pooled keys and
values (`mean_pool`, torch, a fixed summation order), the compressed attention (select_fwd_sm90 with compressed=True:
NsaCmpFwdSpec), the blocks' importance from its LSE (cmp_importance_sm90) and the selection (cmp_topk_sm90), in
chunks of tokens whose FP32 importance rows fit in IMP_SCRATCH_BYTES; and the backward (`compressed_backward`: the dq
kernel with compressed=True, the dk / dv kernel with compressed=True over `CompressedTiles` lists, the partials'
fixed-order sum and the pool's backward). Nothing is read back to the host: the sizes follow from the shapes (the
compressed rows and the longest sequence's blocks are bounded by ceil(N / block_size) + sequences), so the calls are
graph-capturable.

`compressed_branch(ops, n_select)` returns (o_cmp [N, HQ, Dv], lse_cmp [N, HQ], sel int32 [N, H, n_select], k_cmp,
v_cmp, rows); the selected branch then runs on sel (host.py).
"""

from __future__ import annotations

import torch

from ...runtime import device_arch, device_index
from .spec import (CMP_TILE, NSA_MAX_SLOTS, NsaCmpTopkSpec, cmp_dq_spec_for, cmp_fwd_spec_for,
                   cmp_importance_spec_for, item_tokens, select_dkv_spec_for)

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

    def list_args(self, ops) -> tuple:
        """The compressed scheduler's scalars for all of `ops`' tokens (select_common_sm90.CMP_SCALAR_PARAMS: n_tok,
        seq_len, n_docs, n_kv, n_groups, n_slots, cmp_block, n_keys), as the forward and dq kernels take them."""
        return (ops.n_tok, ops.t, ops.n_docs, ops.h, -(-ops.n_tok // item_tokens(ops.g)), self.tiles, ops.block_size,
                self.n_keys)

    def sequences_of_rows(self, ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per compressed row j < n_keys: (its sequence, its row within that sequence, whether a sequence holds it:
        False for the rows past the last sequence's), int64 / bool on the device."""
        j = torch.arange(self.n_keys, device=ops.q3.device)
        if ops.n_docs == 0:
            seq = torch.div(j, self.blocks, rounding_mode="floor")
            return seq, j - seq * self.blocks, torch.ones_like(j, dtype=torch.bool)
        ccu = self.ccu.long()
        seq = torch.searchsorted(ccu[1:], j, right=True).clamp(max=ops.n_docs - 1)
        return seq, j - ccu[seq], j < ccu[-1]


def mean_pool(x3: torch.Tensor, ops, rows: CompressedRows) -> torch.Tensor:
    """`[n_keys, H, dim]` in x3's dtype: compressed row j of a sequence is the mean of its tokens [j bs, (j + 1) bs)
    (a partial last block padded with zeros: the sum divided by bs), summed in FP32 in token order; rows past the last
    sequence's are zeros. x3: `[N, H, dim]`."""
    bs, dev = ops.block_size, x3.device
    seq, row, held = rows.sequences_of_rows(ops)
    if ops.n_docs == 0:
        first, end = seq * ops.t, (seq + 1) * ops.t
    else:
        cu = ops.cu.long()
        first, end = cu[seq], cu[seq + 1]
    tok = (first + row * bs)[:, None] + torch.arange(bs, device=dev)
    valid = (tok < end[:, None]) & held[:, None]
    parts = x3[tok.clamp(0, max(ops.n_tok - 1, 0))].float() * valid[..., None, None]
    return (parts.sum(1) / bs).to(x3.dtype)


def compressed_branch(ops, n_select: int) -> tuple:
    """(o_cmp [N, HQ, Dv] in q's dtype, lse_cmp [N, HQ] FP32 natural log (-inf: no complete block yet), sel int32
    [N, H, n_select], and for the backward k_cmp, v_cmp [n_keys, H, ..] and the CompressedRows) for `ops`
    (host._Operands; block ids not read). NotImplementedError where the kernels do not reach (more than
    NSA_MAX_SLOTS tiles of 64 compressed rows per sequence)."""
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
    k_cmp, v_cmp = mean_pool(ops.k3, ops, rows), mean_pool(ops.v3, ops, rows)
    if n == 0:
        return out, lse, sel, k_cmp, v_cmp, rows
    arch = device_arch(device_index(dev))
    _kernel(dev, cmp_fwd_spec_for(ops.g, ops.d, ops.dv, rows.tiles, ops.dtype_name, arch)).launch(
        ops.q3, k_cmp, v_cmp, rows.ccu, ops.cu, out, lse, *rows.list_args(ops), ops.scale * LOG2E)
    if n_select == 0:
        return out, lse, sel, k_cmp, v_cmp, rows
    imp_spec = cmp_importance_spec_for(ops.g, ops.d, rows.tiles, ops.dtype_name, arch)
    topk = _kernel(dev, NsaCmpTopkSpec(arch=arch))
    row_bytes = h * rows.blocks * 4
    tok = item_tokens(ops.g)
    chunk = max(tok, IMP_SCRATCH_BYTES // row_bytes // tok * tok)
    imp = torch.empty((min(chunk, n), h, rows.blocks), dtype=torch.float32, device=dev)
    for begin in range(0, n, chunk):
        end = min(n, begin + chunk)
        _kernel(dev, imp_spec).launch(ops.q3, k_cmp, rows.ccu, ops.cu, lse, imp, end, ops.t, ops.n_docs, h,
                                      -(-(end - begin) // tok), rows.tiles, ops.block_size, rows.n_keys, begin,
                                      rows.blocks, ops.scale * LOG2E)
        topk.launch(imp, ops.cu, sel, end, begin, ops.t, ops.n_docs, h, ops.block_size, n_select, rows.blocks,
                    float(ops.g))
    return out, lse, sel, k_cmp, v_cmp, rows


SEG_TOKENS = 1024           # tokens per list of the compressed dk / dv kernel (a tile's tokens split into windows)


class CompressedTiles:
    """The compressed dk / dv kernel's lists: tiles of CMP_TILE compressed rows of one sequence (tile_base[i] is
    sequence i's first, n_tiles a bound from the shapes) crossed with windows of SEG_TOKENS tokens of the packed axis:
    list (tile, window) holds, in ascending order, the window's tokens whose complete blocks reach into the tile, with
    per entry the tile's first compressed row (starts), the sequence's compressed end or the tile's (ends) and the
    token's last compressed row (lims). off [nbd + 1] with nbd = n_tiles x windows; the lists are the same for every
    KV head. Graph-capturable: a stable sort of the N x tiles-per-sequence (token, tile) grid, invalid pairs last."""

    def __init__(self, ops, rows: CompressedRows):
        n, bs, dev = ops.n_tok, ops.block_size, ops.q3.device
        t = torch.arange(n, device=dev)
        if ops.n_docs == 0:
            seq = torch.div(t, ops.t, rounding_mode="floor")
            first = seq * ops.t
            kfirst = seq * rows.blocks
            kend = kfirst + rows.blocks
            tile_base = seq * rows.tiles
            self.n_tiles = ops.b * rows.tiles
        else:
            cu, ccu = ops.cu.long(), rows.ccu.long()
            seq = torch.searchsorted(cu[1:], t, right=True)
            per_seq = torch.div(ccu[1:] - ccu[:-1] + CMP_TILE - 1, CMP_TILE, rounding_mode="floor")
            bases = torch.cumsum(per_seq, 0) - per_seq
            first, kfirst, kend, tile_base = cu[seq], ccu[seq], ccu[seq + 1], bases[seq]
            self.n_tiles = -(-rows.n_keys // CMP_TILE) + ops.n_docs
        self.windows = -(-n // SEG_TOKENS)
        self.nbd = self.n_tiles * self.windows
        nk = torch.div(t - first + 1, bs, rounding_mode="floor")
        m = torch.arange(rows.tiles, device=dev)
        valid = m[None, :] * CMP_TILE < nk[:, None]                                     # [N, tiles]
        pair = (tile_base[:, None] + m) * self.windows + torch.div(t, SEG_TOKENS, rounding_mode="floor")[:, None]
        key = torch.where(valid, pair, self.nbd).reshape(-1)
        order = torch.sort(key, stable=True).indices
        tok = torch.div(order, rows.tiles, rounding_mode="floor")
        starts = (kfirst[:, None] + m * CMP_TILE).reshape(-1)[order]
        self.toks = tok.to(torch.int32)
        self.starts = starts.to(torch.int32)
        self.ends = torch.minimum(starts + CMP_TILE, kend[tok]).to(torch.int32)
        self.lims = (kfirst + nk - 1)[tok].to(torch.int32)
        counts = torch.zeros(self.nbd + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
        off = torch.zeros(self.nbd + 1, dtype=torch.long, device=dev)
        off[1:] = torch.cumsum(counts[:-1], 0)
        self.off = off.to(torch.int32)
        # compressed row j -> (its tile, its row in the tile), for gathering the summed partials
        js, jr, self.key_valid = rows.sequences_of_rows(ops)
        jt = (js * rows.tiles if ops.n_docs == 0 else bases[js]) + torch.div(jr, CMP_TILE, rounding_mode="floor")
        self.row_of_key = jt.clamp(max=self.n_tiles - 1) * CMP_TILE + jr % CMP_TILE
        # token -> its compressed row (the mean pool's backward)
        self.key_of_tok = kfirst + torch.div(t - first, bs, rounding_mode="floor")


def compressed_backward(ops, rows: CompressedRows, k_cmp: torch.Tensor, v_cmp: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [N, HQ, D] FP32, dk [N, H, D] FP32, dv [N, H, Dv] FP32) of the compressed attention for its forward's out
    [N, HQ, Dv], lse [N, HQ] and dout like out (q's dtype): the dq kernel over the forward's items, the dk / dv
    kernel over (tile, window) lists into per-list partials summed over the windows in order, then the mean pool's
    backward (each token gets its compressed row's gradient / block_size). Bitwise repeatable (no atomics)."""
    from .host import LOG2E, _kernel, _tma_ready
    n, hq, h, dev = ops.n_tok, ops.hq, ops.h, out.device
    arch = device_arch(device_index(dev))
    do3 = _tma_ready(dout.reshape(ops.b, ops.t, hq, ops.dv))
    delta = (do3.float() * out.float()).sum(-1)
    lse2 = lse.contiguous()
    dq = torch.empty((n, hq, ops.d), dtype=out.dtype, device=dev)
    _kernel(dev, cmp_dq_spec_for(ops.g, ops.d, ops.dv, rows.tiles, ops.dtype_name, arch)).launch(
        ops.q3, k_cmp, v_cmp, do3, rows.ccu, ops.cu, dq, lse2, delta, *rows.list_args(ops), ops.scale * LOG2E,
        ops.scale)
    tiles = CompressedTiles(ops, rows)
    pk = torch.zeros((tiles.nbd * CMP_TILE, h, ops.d), dtype=out.dtype, device=dev)
    pv = torch.zeros((tiles.nbd * CMP_TILE, h, ops.dv), dtype=out.dtype, device=dev)
    _kernel(dev, select_dkv_spec_for(ops.g, ops.d, ops.dv, ops.dtype_name, arch, compressed=True)).launch(
        ops.q3, k_cmp, v_cmp, do3, tiles.off, tiles.toks, tiles.starts, tiles.ends, tiles.lims, pk, pv, lse2, delta,
        n, h, tiles.nbd, rows.n_keys, ops.scale * LOG2E, ops.scale)

    def to_tokens(part: torch.Tensor) -> torch.Tensor:
        summed = part.view(tiles.n_tiles, tiles.windows, CMP_TILE, h, -1).float().sum(1).view(-1, h, part.shape[-1])
        per_key = summed[tiles.row_of_key] * tiles.key_valid[:, None, None]
        return per_key[tiles.key_of_tok] / ops.block_size

    return dq.float(), to_tokens(pk), to_tokens(pv)
