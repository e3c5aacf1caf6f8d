"""Host side of the fused NSA: `native_sparse_attention(...)` (inputs validated, and per-query-block layouts expanded
per token, by dsagen.ops.nsa) runs the selected branch's forward kernel (select_fwd_sm90) and applies g_slc; with
gradients it goes through `_SelectFunction`, whose backward (`select_backward`) runs the dq kernel (select_dq_sm90)
over the forward's work items and the dk / dv kernel (select_dkv_sm90) over the key blocks of `inverse_index`.
With g_cmp the compressed branch's kernels (cmp_host) give o_cmp and the selection first (`compressed_forward`), and
with gradients `_CompressedFunction` adds the compressed branch's backward (cmp_host.compressed_backward) and the
gates' gradients. `select_forward(...)` is the forward kernel's own call, returning the branch's output and its
natural-log LSE.

What the kernels do not cover raises NotImplementedError naming the reason (no silent fallback to the reference):
per-token counts with g_cmp under torch.compile, FP32 / FP64 inputs, and shapes outside NsaSelectFwdSpec's (group a
power of two up to 64, D and Dv 64 or 128, block_size 32 / 64 / 128, at most NSA_MAX_SLOTS slots) or the compressed
branch's (sequences of at most NSA_MAX_SLOTS x 64 compressed rows).
"""

from __future__ import annotations

import math

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .cmp_host import CompressedRows, compressed_backward, compressed_branch, mean_pool
from .spec import (DKV_ROWS, NSA_BLOCK_SIZES, NSA_GROUPS, NSA_HEAD_DIMS, NSA_MAX_SLOTS, NsaSelectDkvSpec,
                   NsaSelectFwdSpec, item_tokens, select_dkv_spec_for, select_dq_spec_for, select_fwd_spec_for)

LOG2E = math.log2(math.e)

_kernels: dict[tuple, LoadedKernel] = {}


def _kernel(device: torch.device, spec) -> LoadedKernel:
    """The loaded kernel of `spec` on CUDA `device`, memoized."""
    index = device_index(device)
    k = _kernels.get((index, spec))
    if k is None:
        k = _kernels[(index, spec)] = get_kernel(spec, index)
    return k


def _unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: int, block_size: int) -> str:
    """Why the selected-branch kernel cannot run these inputs ("" when it can)."""
    hq, h, d, dv = query.shape[2], key.shape[2], query.shape[3], value.shape[3]
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"the fused kernel takes bfloat16 or float16 inputs, got {query.dtype}"
    if hq // h not in NSA_GROUPS:
        return f"query heads per KV head HQ / H = {hq // h} must be one of {NSA_GROUPS}"
    if d not in NSA_HEAD_DIMS or dv not in NSA_HEAD_DIMS:
        return f"head dims D = {d} and Dv = {dv} must be in {NSA_HEAD_DIMS}"
    if block_size not in NSA_BLOCK_SIZES:
        return f"block_size={block_size} must be one of {NSA_BLOCK_SIZES}"
    if slots > NSA_MAX_SLOTS:
        return f"{slots} selected blocks per token; the kernel takes at most {NSA_MAX_SLOTS}"
    arch = device_arch(device_index(query.device))
    if arch != "sm_90a":
        return f"no NSA kernel for {arch} (sm_90a only)"
    return ""


def _check_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: int, block_size: int) -> None:
    """NotImplementedError naming the reason (_unsupported) where the kernels do not cover these inputs."""
    reason = _unsupported(query, key, value, slots, block_size)
    if reason:
        raise NotImplementedError(f"native_sparse_attention: {reason}")


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x `[B, T, heads, dim]` as `[B * T, heads, dim]` whose dim is contiguous and whose row / head strides and base
    are 16-byte multiples (what the TMA boxes need); copied only where x's own strides do not give that."""
    flat = x.reshape(-1, x.shape[2], x.shape[3])
    ok = (flat.stride(2) == 1 and flat.data_ptr() % 16 == 0
          and all((s * flat.element_size()) % 16 == 0 for s in flat.stride()[:2]))
    return flat if ok else flat.contiguous()


class _Operands:
    """One call's kernel operands, shared by the forward and the backward: the flat [N, heads, dim] views of q, k, v
    (TMA-ready), int32 ids [N, H, S], counts (a tensor [N, H] or the int), packed offsets, and the scalars."""

    def __init__(self, query, key, value, block_indices, block_counts, cu_seqlens, softmax_scale, block_size):
        b, t, hq, d = query.shape
        self.b, self.t, self.hq, self.d = b, t, hq, d
        self.h, self.dv = key.shape[2], value.shape[3]
        self.n_tok = b * t
        self.g = hq // self.h
        self.block_size = block_size
        self.scale = float(softmax_scale)
        n = self.n_tok
        if block_indices is None:             # the compressed branch's kernels read no ids
            block_indices = torch.empty((b, t, self.h, 0), dtype=torch.int32, device=query.device)
        self.slots = block_indices.shape[3]
        self.idx = block_indices.reshape(n, self.h, self.slots)
        if self.idx.dtype != torch.int32:     # ids past the int32 range are empty slots: -1, not a wrapped value
            self.idx = self.idx.clamp(-1, 2**31 - 1).to(torch.int32)
        if isinstance(block_counts, torch.Tensor):
            self.cnt = block_counts.reshape(n, self.h).clamp(-1, 2**31 - 1).to(torch.int32)
            self.has_cnt, self.cnt_all = 1, 0
        else:
            self.cnt, self.has_cnt, self.cnt_all = self.idx, 0, min(int(block_counts), 2**31 - 1)
        if cu_seqlens is None:
            self.cu, self.n_docs = self.idx, 0
        else:
            self.cu, self.n_docs = cu_seqlens.to(torch.int32).contiguous(), cu_seqlens.numel() - 1
        self.q3, self.k3, self.v3 = _tma_ready(query), _tma_ready(key), _tma_ready(value)
        self.dtype_name = _dtype_name(query.dtype)
        self.n_groups = -(-n // item_tokens(self.g)) if n else 0

    def list_args(self) -> tuple:
        """The scheduler's arguments (after the tensormaps and pointers of each kernel's own)."""
        return (self.n_tok, self.t, self.n_docs, self.h, self.n_groups, self.slots, self.has_cnt, self.cnt_all,
                self.idx.stride(0), self.idx.stride(1), self.idx.stride(2), self.cnt.stride(0), self.cnt.stride(1))


def select_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_indices: torch.Tensor,
                   block_counts: int | torch.Tensor, cu_seqlens: torch.Tensor | None, softmax_scale: float,
                   block_size: int, spec: NsaSelectFwdSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected branch alone: (o `[B, T, HQ, Dv]` in query.dtype, lse `[B, T, HQ]` FP32, natural log, -inf for
    a token with no key). query `[B, T, HQ, D]`, key `[B, T, H, D]`, value `[B, T, H, Dv]` bf16 / fp16 on one GPU;
    block_indices `[B, T, H, S]` int32 / int64 per token (sequence-local ids with cu_seqlens, B = 1);
    block_counts an int or `[B, T, H]` integer counts per token; cu_seqlens None or `[N + 1]` integer offsets.
    spec: None (the op's, select_fwd_spec_for) or another NsaSelectFwdSpec of the same shape (benchmarks).
    NotImplementedError (with the reason) for inputs the kernel does not cover."""
    _check_forward(query, key, value, block_indices.shape[3], block_size)
    ops = _Operands(query, key, value, block_indices, block_counts, cu_seqlens, softmax_scale, block_size)
    out, lse = _forward(ops, spec)
    return out.view(ops.b, ops.t, ops.hq, ops.dv), lse.view(ops.b, ops.t, ops.hq)


def _forward(ops: _Operands, spec: NsaSelectFwdSpec | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel's (out [N, HQ, Dv], lse [N, HQ]) for `ops` (spec None: the op's)."""
    dev = ops.q3.device
    out = torch.empty((ops.n_tok, ops.hq, ops.dv), dtype=ops.q3.dtype, device=dev)
    lse = torch.empty((ops.n_tok, ops.hq), dtype=torch.float32, device=dev)
    if ops.n_tok:
        if spec is None:
            spec = select_fwd_spec_for(ops.g, ops.d, ops.dv, ops.block_size, ops.slots, ops.dtype_name,
                                       device_arch(device_index(dev)))
        _kernel(dev, spec).launch(ops.q3, ops.k3, ops.v3, ops.idx, ops.cnt, ops.cu, out, lse, *ops.list_args(),
                                  ops.scale * LOG2E)
    return out, lse


def inverse_index(ops: _Operands, rows: int = DKV_ROWS
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The tokens that selected each key tile, for the dk / dv kernel, whose tiles are `rows` keys: (off int32
    [H * nbd + 1], toks int32 [L], starts int32 [L], ends int32 [L], nbd). A tile is min(block_size, rows) keys: a
    block of 128 keys is two tiles of 64 (a token lists the second one only if it starts at or before the token), a
    block of 32 keys is one tile whose `ends` stops the kernel's 64 rows after 32 (each row of dk / dv depends only on
    its own key, so the rows past the end, never stored, do not change the others). Dense tile i of KV head i // nbd
    lists its tokens toks[off[i]:off[i + 1]] in ascending order (a token once per slot naming the block), starts /
    ends give the tile's first key row and the end of its rows within the block and the sequence. nbd = ceil(N / tile)
    + sequences bounds the tiles of every sequence, so nothing is read back to the host (graph-capturable); the slots
    are validated as the kernels do (an id in the token's sequence's blocks, a slot before the count, a block not
    after the token). A stable sort of the N x H x S x (tiles per block) entries by dense tile."""
    n, h, s, bs = ops.n_tok, ops.h, ops.slots, ops.block_size
    sub = min(bs, rows)                      # keys per tile
    parts = bs // sub                        # tiles per block
    dev = ops.idx.device
    t = torch.arange(n, device=dev)
    if ops.n_docs == 0:
        seq = torch.div(t, ops.t, rounding_mode="floor")
        first = seq * ops.t
        length = torch.full_like(t, ops.t)
        before = seq * (-(-ops.t // sub))
        n_seq = -(-n // ops.t)
    else:
        cu = ops.cu.long()
        seq = torch.searchsorted(cu[1:], t, right=True)
        first = cu[seq]
        length = cu[seq + 1] - first
        seq_tiles = torch.div(cu[1:] - cu[:-1] + sub - 1, sub, rounding_mode="floor")
        before = (torch.cumsum(seq_tiles, 0) - seq_tiles)[seq]
        n_seq = ops.n_docs
    nbd = -(-n // sub) + n_seq
    ids = ops.idx.long()[..., None]                                              # [N, H, S, 1]
    cnt = ops.cnt.long() if ops.has_cnt else torch.full((n, h), ops.cnt_all, dtype=torch.long, device=dev)
    nblk = torch.div(length + bs - 1, bs, rounding_mode="floor")
    part = torch.arange(parts, device=dev)
    tile_first = ids * bs + part * sub                                           # [N, H, S, parts] within the seq
    valid = ((ids >= 0) & (ids < nblk[:, None, None, None])
             & (torch.arange(s, device=dev)[:, None] < cnt[..., None, None])
             & (tile_first <= (t - first)[:, None, None, None]))
    dense = torch.arange(h, device=dev)[None, :, None, None] * nbd + before[:, None, None, None] + ids * parts + part
    key = torch.where(valid, dense, h * nbd).reshape(-1)
    order = torch.sort(key, stable=True).indices
    starts = (first[:, None, None, None] + tile_first).reshape(-1)[order]
    seq_end = (first + length)[:, None, None, None].expand(n, h, s, parts).reshape(-1)[order]
    ends = torch.minimum(starts + sub, seq_end)
    toks = torch.div(order, h * s * parts, rounding_mode="floor")
    counts = torch.zeros(h * nbd + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    off = torch.zeros(h * nbd + 1, dtype=torch.long, device=dev)
    off[1:] = torch.cumsum(counts[:-1], 0)
    return (off.to(torch.int32), toks.to(torch.int32), starts.clamp(0, 2**31 - 1).to(torch.int32),
            ends.clamp(0, 2**31 - 1).to(torch.int32), nbd)


def select_backward(ops: _Operands, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                    dkv_spec: NsaSelectDkvSpec | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the selected branch for the forward's out `[N, HQ, Dv]` and lse `[N, HQ]` and dout like out:
    the dq kernel over the forward's work items, then the dk / dv kernel over the key blocks (inverse_index); both sum
    in a fixed order (bitwise repeatable, no atomics). Shapes [B, T, heads, dim] in query's dtype. dkv_spec: None
    (the op's, select_dkv_spec_for) or another NsaSelectDkvSpec of the same shape (benchmarks and tests)."""
    n, hq, h = ops.n_tok, ops.hq, ops.h
    do3 = _tma_ready(dout.reshape(ops.b, ops.t, hq, ops.dv))
    delta = (do3.float() * out.reshape(n, hq, ops.dv).float()).sum(-1)
    dq = torch.empty((n, hq, ops.d), dtype=out.dtype, device=out.device)
    dk = torch.zeros((n, h, ops.d), dtype=out.dtype, device=out.device)
    dv = torch.zeros((n, h, ops.dv), dtype=out.dtype, device=out.device)
    if n:
        arch = device_arch(device_index(out.device))
        dq_spec = select_dq_spec_for(ops.g, ops.d, ops.dv, ops.block_size, ops.slots, ops.dtype_name, arch)
        lse2 = lse.reshape(n, hq).contiguous()
        _kernel(out.device, dq_spec).launch(ops.q3, ops.k3, ops.v3, do3, ops.idx, ops.cnt, ops.cu, dq, lse2, delta,
                                            *ops.list_args(), ops.scale * LOG2E, ops.scale)
        off, toks, starts, ends, nbd = inverse_index(ops)
        if dkv_spec is None:
            dkv_spec = select_dkv_spec_for(ops.g, ops.d, ops.dv, ops.dtype_name, arch)
        _kernel(out.device, dkv_spec).launch(ops.q3, ops.k3, ops.v3, do3, off, toks, starts, ends, dk, dv, lse2,
                                             delta, n, h, nbd, ops.scale * LOG2E, ops.scale)
    shape = (ops.b, ops.t)
    return dq.view(*shape, hq, ops.d), dk.view(*shape, h, ops.d), dv.view(*shape, h, ops.dv)


class _SelectFunction(torch.autograd.Function):
    """The selected branch with its fused backward (dq, dk, dv; ids, counts and offsets are not differentiable)."""

    @staticmethod
    def forward(ctx, query, key, value, block_indices, block_counts, cu_seqlens, softmax_scale, block_size):
        ops = _Operands(query, key, value, block_indices, block_counts, cu_seqlens, softmax_scale, block_size)
        out, lse = _forward(ops, None)
        ctx.ops = ops                            # the kernels' views of the inputs (q, k, v saved for their checks)
        ctx.save_for_backward(out, lse, query, key, value)
        return out.view(ops.b, ops.t, ops.hq, ops.dv)

    @staticmethod
    def backward(ctx, dout):
        out, lse, _, _, _ = ctx.saved_tensors   # (autograd's check that q, k, v were not modified in place)
        dq, dk, dv = select_backward(ctx.ops, out, lse, dout)
        return dq, dk, dv, None, None, None, None, None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


@torch.library.custom_op("dsagen::nsa_select_fwd_fused", mutates_args=())
def _select_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_indices: torch.Tensor,
               block_counts: int, block_counts_per_token: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
               softmax_scale: float, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_forward as a custom op (opaque to torch.compile; per-token counts win over the int when given)."""
    counts = block_counts if block_counts_per_token is None else block_counts_per_token
    return select_forward(query, key, value, block_indices, counts, cu_seqlens, softmax_scale, block_size)


@_select_op.register_fake
def _(query, key, value, block_indices, block_counts, block_counts_per_token, cu_seqlens, softmax_scale, block_size):
    return (query.new_empty((*query.shape[:3], value.shape[3])),
            query.new_empty(query.shape[:3], dtype=torch.float32))


@torch.library.custom_op("dsagen::nsa_select_bwd_fused", mutates_args=())
def _select_bwd_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_indices: torch.Tensor,
                   block_counts: int, block_counts_per_token: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                   softmax_scale: float, block_size: int, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_backward as a custom op (the backward of dsagen::nsa_select_fwd_fused under torch.compile): (dq, dk, dv)
    for the forward's out `[B, T, HQ, Dv]` and lse `[B, T, HQ]`."""
    counts = block_counts if block_counts_per_token is None else block_counts_per_token
    ops = _Operands(query, key, value, block_indices, counts, cu_seqlens, softmax_scale, block_size)
    return select_backward(ops, out.reshape(ops.n_tok, ops.hq, ops.dv), lse.reshape(ops.n_tok, ops.hq), dout)


@_select_bwd_op.register_fake
def _(query, key, value, block_indices, block_counts, block_counts_per_token, cu_seqlens, softmax_scale, block_size,
      out, lse, dout):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _select_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], inputs[5], inputs[6], *output)
    ctx.args = (inputs[4], inputs[7], inputs[8])         # block_counts, softmax_scale, block_size


def _select_grad(ctx, dout, dlse):
    """dq, dk, dv through dsagen::nsa_select_bwd_fused (the lse output takes no gradient: the op returns it as a
    statistic)."""
    query, key, value, ids, per_token, cu, out, lse = ctx.saved_tensors
    counts, scale, block_size = ctx.args
    dq, dk, dv = _select_bwd_op(query, key, value, ids, counts, per_token, cu, scale, block_size, out, lse,
                                dout.contiguous())
    return dq, dk, dv, None, None, None, None, None, None


_select_op.register_autograd(_select_grad, setup_context=_select_setup)


def compressed_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_select: int,
                       cu_seqlens: torch.Tensor | None, softmax_scale: float, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed branch alone (cmp_host.compressed_branch): (o_cmp `[B, T, HQ, Dv]` in query.dtype, lse_cmp
    `[B, T, HQ]` FP32 natural log, -inf before a token's first complete block, sel `[B, T, H, n_select]` int32: the
    blocks it selects per token and KV head, sequence-local ids, best first, -1 past the candidates). Inputs as
    select_forward's. NotImplementedError (with the reason) for inputs the kernels do not cover."""
    _check_forward(query, key, value, n_select, block_size)
    ops = _Operands(query, key, value, None, 0, cu_seqlens, softmax_scale, block_size)
    out, lse, sel = compressed_branch(ops, n_select)[:3]
    return (out.view(ops.b, ops.t, ops.hq, ops.dv), lse.view(ops.b, ops.t, ops.hq),
            sel.view(ops.b, ops.t, ops.h, n_select))


@torch.library.custom_op("dsagen::nsa_cmp_fwd_fused", mutates_args=())
def _cmp_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_select: int,
            cu_seqlens: torch.Tensor | None, softmax_scale: float, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed_forward as a custom op (opaque to torch.compile): (o_cmp, sel)."""
    out, _, sel = compressed_forward(query, key, value, n_select, cu_seqlens, softmax_scale, block_size)
    return out, sel


@_cmp_op.register_fake
def _(query, key, value, n_select, cu_seqlens, softmax_scale, block_size):
    return (query.new_empty((*query.shape[:3], value.shape[3])),
            query.new_empty((*key.shape[:3], n_select), dtype=torch.int32))


def _gated_sum(o_slc, o_cmp, g_slc, g_cmp, dtype):
    """o_slc * g_slc + o_cmp * g_cmp in FP32 (g_slc None: 1), in `dtype`."""
    out = o_slc.float()
    if g_slc is not None:
        out = out * g_slc.float().unsqueeze(-1)
    return (out + o_cmp.float() * g_cmp.float().unsqueeze(-1)).to(dtype)


def _train_forward(query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale, block_size, n_select):
    """Both branches with g_cmp, keeping what the backward needs: (out [B, T, HQ, Dv], saved) with saved = (o_cmp,
    lse_cmp, sel, o_slc, lse_slc, k_cmp, v_cmp) (flat [N, ..] forms) and the operands (ops_c, ops_s, rows)."""
    ops_c = _Operands(query, key, value, None, 0, cu_seqlens, scale, block_size)
    o_cmp, lse_cmp, sel, k_cmp, v_cmp, rows = compressed_branch(ops_c, n_select)
    ops_s = _Operands(query, key, value, sel.view(ops_c.b, ops_c.t, ops_c.h, n_select), block_counts, cu_seqlens,
                      scale, block_size)
    o_slc, lse_slc = _forward(ops_s, None)
    shape = (ops_c.b, ops_c.t, ops_c.hq, ops_c.dv)
    out = _gated_sum(o_slc.view(shape), o_cmp.view(shape), g_slc, g_cmp, query.dtype)
    return out, (o_cmp, lse_cmp, sel, o_slc, lse_slc, k_cmp, v_cmp), (ops_c, ops_s, rows)


def _train_backward(ops, saved, g_cmp, g_slc, dout):
    """(dq, dk, dv, d g_cmp, d g_slc or None) for _train_forward's `ops` and `saved` and dout [B, T, HQ, Dv]: the
    gates' gradients sum(dout o) over Dv in FP32, the selected branch's backward with dout g_slc, the compressed
    branch's with dout g_cmp (through the mean pool), the two summed in FP32."""
    ops_c, ops_s, rows = ops
    o_cmp, lse_cmp, _, o_slc, lse_slc, k_cmp, v_cmp = saved
    n, hq = ops_c.n_tok, ops_c.hq
    d = dout.float().reshape(n, hq, ops_c.dv)
    d_gcmp = (d * o_cmp.float()).sum(-1).view(g_cmp.shape).to(g_cmp.dtype)
    d_gslc = None if g_slc is None else (d * o_slc.float()).sum(-1).view(g_slc.shape).to(g_slc.dtype)
    do_slc = d if g_slc is None else d * g_slc.float().reshape(n, hq, 1)
    do_cmp = d * g_cmp.float().reshape(n, hq, 1)
    dtype = o_slc.dtype
    dq1, dk1, dv1 = select_backward(ops_s, o_slc, lse_slc, do_slc.to(dtype))
    dq2, dk2, dv2 = compressed_backward(ops_c, rows, k_cmp, v_cmp, o_cmp, lse_cmp, do_cmp.to(dtype))
    dq = (dq1.float() + dq2.view(dq1.shape)).to(dtype)
    dk = (dk1.float() + dk2.view(dk1.shape)).to(dtype)
    dv = (dv1.float() + dv2.view(dv1.shape)).to(dtype)
    return dq, dk, dv, d_gcmp, d_gslc


class _CompressedFunction(torch.autograd.Function):
    """Both branches with g_cmp and their fused backward (eager): dq, dk, dv (the selected branch's kernels plus the
    compressed attention's, through the mean pool) and the gates' gradients; the selection is a constant."""

    @staticmethod
    def forward(ctx, query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale, block_size, n_select):
        out, saved, ops = _train_forward(query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale,
                                         block_size, n_select)
        ctx.ops = ops
        ctx.save_for_backward(query, key, value, g_cmp, g_slc, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        _, _, _, g_cmp, g_slc, *saved = ctx.saved_tensors
        return (*_train_backward(ctx.ops, saved, g_cmp, g_slc, dout), None, None, None, None, None)


@torch.library.custom_op("dsagen::nsa_cmp_train_fwd", mutates_args=())
def _cmp_train_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g_cmp: torch.Tensor,
                  g_slc: torch.Tensor | None, n_select: int, block_counts: int,
                  block_counts_per_token: torch.Tensor | None, cu_seqlens: torch.Tensor | None, softmax_scale: float,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """_train_forward as a custom op (torch.compile with gradients): (out, o_cmp, lse_cmp, sel, o_slc, lse_slc), the
    flat forms of _train_forward's saved tensors but the pooled k / v (the backward pools again)."""
    counts = block_counts if block_counts_per_token is None else block_counts_per_token
    out, saved, _ = _train_forward(query, key, value, g_cmp, g_slc, counts, cu_seqlens, softmax_scale, block_size,
                                   n_select)
    return (out, *saved[:5])


@_cmp_train_op.register_fake
def _(query, key, value, g_cmp, g_slc, n_select, block_counts, block_counts_per_token, cu_seqlens, softmax_scale,
      block_size):
    n, hq, h, dv = query.shape[0] * query.shape[1], query.shape[2], key.shape[2], value.shape[3]
    return (query.new_empty((*query.shape[:3], dv)), query.new_empty((n, hq, dv)),
            query.new_empty((n, hq), dtype=torch.float32), query.new_empty((n, h, n_select), dtype=torch.int32),
            query.new_empty((n, hq, dv)), query.new_empty((n, hq), dtype=torch.float32))


@torch.library.custom_op("dsagen::nsa_cmp_train_bwd", mutates_args=())
def _cmp_train_bwd_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g_cmp: torch.Tensor,
                      g_slc: torch.Tensor | None, block_counts: int, block_counts_per_token: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, softmax_scale: float, block_size: int, o_cmp: torch.Tensor,
                      lse_cmp: torch.Tensor, sel: torch.Tensor, o_slc: torch.Tensor, lse_slc: torch.Tensor,
                      dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """_train_backward as a custom op (the backward of dsagen::nsa_cmp_train_fwd): (dq, dk, dv, d g_cmp, d g_slc),
    the last empty when g_slc is None. The pooled k / v and the operands are rebuilt from the inputs."""
    counts = block_counts if block_counts_per_token is None else block_counts_per_token
    ops_c = _Operands(query, key, value, None, 0, cu_seqlens, softmax_scale, block_size)
    rows = CompressedRows(ops_c)
    k_cmp, v_cmp = mean_pool(ops_c.k3, ops_c, rows), mean_pool(ops_c.v3, ops_c, rows)
    ops_s = _Operands(query, key, value, sel.view(ops_c.b, ops_c.t, ops_c.h, sel.shape[-1]), counts, cu_seqlens,
                      softmax_scale, block_size)
    grads = _train_backward((ops_c, ops_s, rows), (o_cmp, lse_cmp, sel, o_slc, lse_slc, k_cmp, v_cmp), g_cmp, g_slc,
                            dout)
    return (*grads[:4], grads[4] if grads[4] is not None else g_cmp.new_empty(0))


@_cmp_train_bwd_op.register_fake
def _(query, key, value, g_cmp, g_slc, block_counts, block_counts_per_token, cu_seqlens, softmax_scale, block_size,
      o_cmp, lse_cmp, sel, o_slc, lse_slc, dout):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(g_cmp),
            torch.empty_like(g_slc) if g_slc is not None else g_cmp.new_empty(0))


def _cmp_train_setup(ctx, inputs, output):
    query, key, value, g_cmp, g_slc, _, counts, per_token, cu, scale, block_size = inputs
    ctx.save_for_backward(query, key, value, g_cmp, g_slc, per_token, cu, *output[1:])
    ctx.args = (counts, scale, block_size)


def _cmp_train_grad(ctx, dout, *unused):
    """dq, dk, dv, d g_cmp, d g_slc through dsagen::nsa_cmp_train_bwd (the op's other outputs are saved
    intermediates and take no gradient)."""
    query, key, value, g_cmp, g_slc, per_token, cu, o_cmp, lse_cmp, sel, o_slc, lse_slc = ctx.saved_tensors
    counts, scale, block_size = ctx.args
    dq, dk, dv, dgc, dgs = _cmp_train_bwd_op(query, key, value, g_cmp, g_slc, counts, per_token, cu, scale,
                                             block_size, o_cmp, lse_cmp, sel, o_slc, lse_slc, dout.contiguous())
    return dq, dk, dv, dgc, (dgs if g_slc is not None else None), None, None, None, None, None, None


_cmp_train_op.register_autograd(_cmp_train_grad, setup_context=_cmp_train_setup)


def _with_compressed(query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale, block_size, grad):
    """native_sparse_attention with g_cmp: the compressed branch's kernels select the blocks, the selected-branch
    kernel runs on them, and the gated sum is formed in FP32; with gradients (eager) through
    _CompressedFunction."""
    compiling = torch.compiler.is_compiling()
    per_token = block_counts if isinstance(block_counts, torch.Tensor) else None
    if per_token is not None:
        if compiling:
            raise NotImplementedError("native_sparse_attention: per-token block_counts with g_cmp under "
                                      "torch.compile (the selection width is the counts' maximum, a host read); "
                                      "pass an int block_counts")
        n_select = int(per_token.max()) if per_token.numel() else 0
    else:
        n_select = int(block_counts)
    if grad:
        _check_forward(query, key, value, n_select, block_size)
        if compiling:                     # opaque forward and backward custom ops
            return _cmp_train_op(query, key, value, g_cmp, g_slc, n_select, n_select, None, cu_seqlens, scale,
                                 block_size)[0]
        return _CompressedFunction.apply(query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale,
                                         block_size, n_select)
    if compiling:
        o_cmp, sel = _cmp_op(query, key, value, n_select, cu_seqlens, scale, block_size)
        o_slc, _ = _select_op(query, key, value, sel, 0 if per_token is not None else n_select, per_token,
                              cu_seqlens, scale, block_size)
    else:
        o_cmp, _, sel = compressed_forward(query, key, value, n_select, cu_seqlens, scale, block_size)
        o_slc, _ = select_forward(query, key, value, sel, block_counts, cu_seqlens, scale, block_size)
    return _gated_sum(o_slc, o_cmp, g_slc, g_cmp, query.dtype)


def native_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            g_cmp: torch.Tensor | None, g_slc: torch.Tensor | None,
                            block_indices: torch.Tensor | None, block_counts: int | torch.Tensor,
                            cu_seqlens: torch.Tensor | None, *, softmax_scale: float | None,
                            block_size: int) -> torch.Tensor:
    """dsagen.native_sparse_attention(impl="fused") after its checks: the selected branch by the kernel, times g_slc
    when given; differentiable in query, key and value by the fused backward (select_backward: eagerly through
    _SelectFunction, under torch.compile through the custom ops' registered autograd; g_slc's gradient by autograd of
    the product). With g_cmp the compressed branch's kernels (cmp_host) give o_cmp and select the blocks, and out =
    o_slc * g_slc + o_cmp * g_cmp (gradients: eagerly _CompressedFunction, under torch.compile the custom ops
    dsagen::nsa_cmp_train_fwd / _bwd). NotImplementedError for per-token counts with g_cmp under torch.compile, and
    for inputs the kernels do not cover (select_forward, compressed_forward)."""
    scale = 1.0 / math.sqrt(query.shape[3]) if softmax_scale is None else float(softmax_scale)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    if g_cmp is not None:
        grad = grad or (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (g_cmp, g_slc)))
        return _with_compressed(query, key, value, g_cmp, g_slc, block_counts, cu_seqlens, scale, block_size, grad)
    if grad:
        _check_forward(query, key, value, block_indices.shape[3], block_size)
    if grad and not torch.compiler.is_compiling():
        out = _SelectFunction.apply(query, key, value, block_indices, block_counts, cu_seqlens, scale, block_size)
    elif torch.compiler.is_compiling():     # torch.compile sees the kernels as opaque nodes (forward, backward)
        per_token = block_counts if isinstance(block_counts, torch.Tensor) else None
        out, _ = _select_op(query, key, value, block_indices, 0 if per_token is not None else int(block_counts),
                            per_token, cu_seqlens, scale, block_size)
    else:                                 # eager: launch directly (the custom op's dispatch adds only host time)
        out, _ = select_forward(query, key, value, block_indices, block_counts, cu_seqlens, scale, block_size)
    if g_slc is not None:
        out = (out.float() * g_slc.float().unsqueeze(-1)).to(query.dtype)
    return out
