"""Host side of the fused NSA forward: `native_sparse_attention(...)` (inputs validated, and per-query-block layouts
expanded per token, by dsagen.ops.nsa) runs the selected branch's kernel (select_fwd_sm90) and applies g_slc;
`select_forward(...)` is the kernel's own call, returning the branch's output and its natural-log LSE.

What the kernel does not cover raises NotImplementedError naming the reason (no silent fallback to the reference):
the compressed branch (g_cmp), gradients (the fused backward is not built yet: use impl="reference" for training),
FP32 / FP64 inputs, and shapes outside NsaSelectFwdSpec's (group a power of two up to 64, D and Dv 64 or 128,
block_size 32 / 64 / 128, at most NSA_MAX_SLOTS slots).
"""

from __future__ import annotations

import math

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index
from .spec import (NSA_BLOCK_SIZES, NSA_GROUPS, NSA_HEAD_DIMS, NSA_MAX_SLOTS, NsaSelectFwdSpec, item_tokens,
                   select_fwd_spec_for)

LOG2E = math.log2(math.e)

_kernels: dict[tuple[int, NsaSelectFwdSpec], LoadedKernel] = {}


def _kernel(device: torch.device, spec: NsaSelectFwdSpec) -> LoadedKernel:
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
    if device_arch(device_index(query.device)) != "sm_90a":
        return f"no NSA kernel for {device_arch(device_index(query.device))} (sm_90a only)"
    return ""


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x `[B, T, heads, dim]` as `[B * T, heads, dim]` whose dim is contiguous and whose row / head strides and base
    are 16-byte multiples (what the TMA boxes need); copied only where x's own strides do not give that."""
    flat = x.reshape(-1, x.shape[2], x.shape[3])
    ok = (flat.stride(2) == 1 and flat.data_ptr() % 16 == 0
          and all((s * flat.element_size()) % 16 == 0 for s in flat.stride()[:2]))
    return flat if ok else flat.contiguous()


def select_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_indices: torch.Tensor,
                   block_counts: int | torch.Tensor, cu_seqlens: torch.Tensor | None, softmax_scale: float,
                   block_size: int, spec: NsaSelectFwdSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected branch alone: (o `[B, T, HQ, Dv]` in query.dtype, lse `[B, T, HQ]` FP32, natural log, -inf for
    a token with no key). query `[B, T, HQ, D]`, key `[B, T, H, D]`, value `[B, T, H, Dv]` bf16 / fp16 on one GPU;
    block_indices `[B, T, H, S]` int32 / int64 per token (sequence-local ids with cu_seqlens, B = 1);
    block_counts an int or `[B, T, H]` integer counts per token; cu_seqlens None or `[N + 1]` integer offsets.
    spec: None (the op's, select_fwd_spec_for) or another NsaSelectFwdSpec of the same shape (benchmarks).
    NotImplementedError (with the reason) for inputs the kernel does not cover."""
    b, t, hq, _ = query.shape
    h, dv = key.shape[2], value.shape[3]
    slots = block_indices.shape[3]
    reason = _unsupported(query, key, value, slots, block_size)
    if reason:
        raise NotImplementedError(f"native_sparse_attention: {reason}")
    n_tok = b * t
    out = torch.empty((n_tok, hq, dv), dtype=query.dtype, device=query.device)
    lse = torch.empty((n_tok, hq), dtype=torch.float32, device=query.device)
    if n_tok == 0:
        return out.view(b, t, hq, dv), lse.view(b, t, hq)
    g = hq // h
    if spec is None:
        spec = select_fwd_spec_for(g, query.shape[3], dv, block_size, slots, _dtype_name(query.dtype),
                                   device_arch(device_index(query.device)))
    idx = block_indices.reshape(n_tok, h, slots)
    if idx.dtype != torch.int32:     # ids past the int32 range are empty slots: -1, not a wrapped value
        idx = idx.clamp(-1, 2**31 - 1).to(torch.int32)
    if isinstance(block_counts, torch.Tensor):
        cnt = block_counts.reshape(n_tok, h).clamp(-1, 2**31 - 1).to(torch.int32)
        has_cnt, cnt_all = 1, 0
    else:
        cnt, has_cnt, cnt_all = idx, 0, min(int(block_counts), 2**31 - 1)
    if cu_seqlens is None:
        cu, n_docs, seq_len = idx, 0, t
    else:
        cu, n_docs, seq_len = cu_seqlens.to(torch.int32), cu_seqlens.numel() - 1, t
    q3, k3, v3 = _tma_ready(query), _tma_ready(key), _tma_ready(value)
    n_groups = -(-n_tok // item_tokens(g))
    _kernel(query.device, spec).launch(
        q3, k3, v3, idx, cnt, cu, out, lse, n_tok, seq_len, n_docs, h, n_groups, slots, has_cnt, cnt_all,
        idx.stride(0), idx.stride(1), idx.stride(2), cnt.stride(0), cnt.stride(1), float(softmax_scale) * LOG2E)
    return out.view(b, t, hq, dv), lse.view(b, t, hq)


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


def native_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            g_cmp: torch.Tensor | None, g_slc: torch.Tensor | None,
                            block_indices: torch.Tensor | None, block_counts: int | torch.Tensor,
                            cu_seqlens: torch.Tensor | None, *, softmax_scale: float | None,
                            block_size: int) -> torch.Tensor:
    """dsagen.native_sparse_attention(impl="fused") after its checks: the selected branch by the kernel, times g_slc
    when given. NotImplementedError for the compressed branch (g_cmp), for inputs that require grad under grad mode
    (no fused backward yet) and for inputs the kernel does not cover (select_forward)."""
    if g_cmp is not None:
        raise NotImplementedError("native_sparse_attention: the compressed branch (g_cmp) has no fused kernel yet; "
                                  "use impl='reference'")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (query, key, value, g_slc)):
        raise NotImplementedError("native_sparse_attention: the fused kernel has no backward yet; use "
                                  "impl='reference' for training, or call it under torch.no_grad()")
    scale = 1.0 / math.sqrt(query.shape[3]) if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():     # torch.compile sees the kernel as one opaque node
        per_token = block_counts if isinstance(block_counts, torch.Tensor) else None
        out, _ = _select_op(query, key, value, block_indices, 0 if per_token is not None else int(block_counts),
                            per_token, cu_seqlens, scale, block_size)
    else:                                 # eager: launch directly (the custom op's dispatch adds only host time)
        out, _ = select_forward(query, key, value, block_indices, block_counts, cu_seqlens, scale, block_size)
    if g_slc is not None:
        out = (out.float() * g_slc.float().unsqueeze(-1)).to(query.dtype)
    return out
