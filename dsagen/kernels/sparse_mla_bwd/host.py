"""Fused (generated-kernel) sparse MLA attention backward, flat layout (cuDNN frontend DSA §2 Sparse Attention
Backward; the batched layout is flattened by dsagen.ops.sparse_attention before it gets here).

`sparse_attention_backward(q, kv, out, dout, lse, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v,
deterministic, workspace[, config])` returns `(dq, dkv, d_sink)` and runs the sm_90a kernel of
`SparseAttnBwdSpec` (kernel module sparse_mla_bwd/bwd_sm90.py). It is the `torch.library` custom op
`dsagen::sparse_attention_bwd`, with a fake implementation, so torch.compile sees one opaque node; nothing in it
synchronizes with the host, so a forward + backward step is CUDA-graph capturable once the kernels are loaded.

Per call:
  0. when the pool has more than one KV window (SparseAttnBwdConfig.bucket_rows), the ordering kernel (order.py)
     writes each row's valid ids ordered by window and the row's slot window (slot_windows);
  1. the kernel writes dq, delta = rowsum(out * dout) and the dKV terms: deterministic=False adds them to an FP32
     (total_S_kv, D_qk) accumulator by atomics (zeroed first); deterministic=True stores them per (query row,
     64-head block, slot) into an FP32 buffer, a token chunk at a time, and the row scatter-add
     (row_scatter_add.host.RowScatter: each id's rows added in (row, head block, slot) order, one reverse index for
     the chunks of up to INDEX_SLOTS slots) adds each chunk to the accumulator: bitwise the same run to run;
  2. dkv = the accumulator cast to kv's dtype; d_sink[h] = -sum_t exp(sink[h] - logaddexp(lse, sink)) * delta
     (a fixed-order torch reduction).

Scratch (FP32), all of it in `workspace` when the caller passes one (`workspace_numel` gives its size):
  * the accumulator: total_S_kv * D_qk;
  * delta: total_S_q * H_kernel;
  * deterministic only: the per-slot buffer, rows_per_chunk * (H_kernel / 64) * K * D_qk, rows_per_chunk chosen so
    that it stays within SparseAttnBwdConfig.deterministic_chunk_bytes (1 GiB) and at least one query row.
Heads: 64 and 128 natively; 1..63 are zero-padded to 64 and 65..127 to 128 (padded heads get lse = +inf: P = 0).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index, device_sm_count
from ..row_scatter_add.host import INDEX_SLOTS, RowScatter
from ..sparse_mla.host import kernel_heads, padded_heads, supported_reason
from .spec import SparseAttnBwdConfig, SparseAttnBwdOrderSpec, SparseAttnBwdSpec, config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1


def spec_for(num_heads: int, d_qk: int, dtype: torch.dtype, arch: str = "sm_90a", deterministic: bool = False,
             config: SparseAttnBwdConfig | None = None) -> SparseAttnBwdSpec:
    """The kernel spec that serves `num_heads` query heads (after padding to 64 or 128) under `config` (default:
    the op's, config_for)."""
    hp = kernel_heads(num_heads)
    if config is None:
        config = config_for(hp, d_qk, dtype, arch, None)
    return config.spec(hp, d_qk, _DTYPES[dtype], arch, deterministic=deterministic)


def _check_supported(q: torch.Tensor, d_v: int) -> None:
    reason = supported_reason(q, d_v)
    if reason:
        raise NotImplementedError(f"sparse_attention_backward: {reason}")


def chunk_rows(num_heads: int, topk: int, d_qk: int, chunk_bytes: int = 2**30) -> int:
    """Query rows per launch in deterministic mode: the per-slot buffer of that many rows fits chunk_bytes
    (SparseAttnBwdConfig.deterministic_chunk_bytes; at least one row)."""
    per_row = (kernel_heads(num_heads) // 64) * max(topk, 1) * d_qk * 4
    return max(1, chunk_bytes // per_row)


def buckets(n_kv: int, bucket_rows: int | None) -> int:
    """KV windows a call orders each row's ids by: ceil(n_kv / bucket_rows) (1, no ordering, without bucketing or
    for a pool of at most bucket_rows rows)."""
    if bucket_rows is None or n_kv <= bucket_rows:
        return 1
    return -(-n_kv // bucket_rows)


def workspace_numel(s_q: int, num_heads: int, n_kv: int, topk: int, d_qk: int, deterministic: bool,
                    config: SparseAttnBwdConfig | None = None) -> int:
    """FP32 elements of scratch a call needs (pass a CUDA float32 tensor of at least this many elements as
    `workspace` to allocate no dsagen scratch in the call, e.g. inside a captured CUDA graph; the outputs, the
    d_sink reduction's and the deterministic mode's index temporaries still come from torch's caching allocator).
    `config`: the call's (None: the op's, SparseAttnBwdConfig())."""
    cfg = SparseAttnBwdConfig() if config is None else config
    hp = kernel_heads(num_heads)
    nb = buckets(n_kv, cfg.bucket_rows)
    n = n_kv * d_qk + s_q * hp + 4 + _align4(s_q * 2)
    if nb > 1:
        n += _align4(s_q * topk)
    if deterministic:
        n += (min(max(s_q, 1), chunk_rows(num_heads, topk, d_qk, cfg.deterministic_chunk_bytes))
              * (hp // 64) * max(topk, 1) * d_qk)
    return n


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def slot_windows(topk_idxs: torch.Tensor, n_kv: int, length: torch.Tensor | None, bucket_rows: int | None, *,
                 ids_out: torch.Tensor, win_out: torch.Tensor, perm_out: torch.Tensor | None = None) -> None:
    """The ids and the slot window [win[t, 0], win[t, 1]) the kernel walks for each row t.

    bucket_rows None: the ids as given (ids_out may be topk_idxs itself) and each row's first min(length, K) slots.
    Else each row's valid ids (0 <= id < n_kv, slot < length) ordered by KV window id // bucket_rows (stable: ties
    keep their slot order), then -1, and the window [0, count of valid ids): the ordering kernel (order.py), so that
    a tile's rows come from one or two windows and the CTAs, which walk their rows in step, add into about one
    window's rows of the dkv accumulator at a time. A pool of more than SparseAttnBwdOrderSpec.max_windows windows
    is ordered by wider windows of ceil(n_kv / max_windows) rows. topk_idxs int32 (S_q, K), unit stride along K;
    length int32 (S_q,) contiguous or None; ids_out int32 (S_q, K) contiguous, not topk_idxs when bucketed; win_out
    int32 (S_q, 2) contiguous; perm_out None or int32 (S_q, K) contiguous, bucketed only: each ordered slot's slot in
    topk_idxs (-1 past the row's valid ids)."""
    s_q, k_width = topk_idxs.shape
    if k_width == 0 or s_q == 0:
        win_out[:, 0] = 0
        win_out[:, 1] = 0
        return
    if bucket_rows is None:
        if perm_out is not None:
            raise ValueError("slot_windows: perm_out needs bucket_rows (ids as given keep their slots)")
        if ids_out.data_ptr() != topk_idxs.data_ptr():
            ids_out.copy_(topk_idxs)
        win_out[:, 0] = 0
        win_out[:, 1] = k_width if length is None else length.clamp(0, k_width)
        return
    kernel, spec = _order_kernel(device_index(topk_idxs.device))
    bucket_rows = max(int(bucket_rows), -(-n_kv // spec.max_windows))
    kernel.launch(topk_idxs, win_out if length is None else length, ids_out, win_out, s_q, k_width,
                  topk_idxs.stride(0), int(length is not None), n_kv, bucket_rows,
                  ids_out if perm_out is None else perm_out, int(perm_out is not None))


_order_kernels: dict[int, tuple[LoadedKernel, SparseAttnBwdOrderSpec]] = {}


def _order_kernel(index: int) -> tuple[LoadedKernel, SparseAttnBwdOrderSpec]:
    """The window-ordering kernel on CUDA device `index` and its spec, memoized."""
    hit = _order_kernels.get(index)
    if hit is None:
        spec = SparseAttnBwdOrderSpec(arch=device_arch(index))
        hit = _order_kernels[index] = (get_kernel(spec, index), spec)
    return hit


_launch_plans: dict = {}


def _launch_plan(h: int, d_qk: int, dtype: torch.dtype, device: torch.device, deterministic: bool,
                 config: SparseAttnBwdConfig | None = None
                 ) -> tuple[SparseAttnBwdSpec, LoadedKernel, int, SparseAttnBwdConfig, bool]:
    """The spec, loaded kernel, n_ctas argument, config and whether the grid may synchronise (every CTA resident:
    at most one per SM) of a call (cached per call shape and config)."""
    key = (h, d_qk, dtype, device, deterministic, config)
    plan = _launch_plans.get(key)
    if plan is None:
        arch = device_arch(device)
        num_sms = device_sm_count(device_index(device))
        cfg = config_for(kernel_heads(h), d_qk, dtype, arch, num_sms) if config is None else config
        spec = spec_for(h, d_qk, dtype, arch, deterministic, cfg)
        n_ctas = cfg.n_ctas(num_sms)
        plan = _launch_plans[key] = (spec, get_kernel(spec, device_index(device)), n_ctas, cfg,
                                     cfg.sync_grid and n_ctas <= num_sms)
    return plan


def _launch(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale: float, d_v: int,
            deterministic: bool, workspace: torch.Tensor | None, config: SparseAttnBwdConfig | None = None):
    """Launch the kernel on flat-layout inputs that supported_reason accepted (its callers check)."""
    s_q, h, d_qk = q.shape
    n_kv, k_width = kv.shape[0], topk_idxs.shape[1]
    spec, kernel, n_ctas, cfg, sync_grid = _launch_plan(h, d_qk, q.dtype, q.device, deterministic, config)
    hp = spec.num_heads
    hb = hp // 64
    if s_q * hb > _MAX_GRID_X:
        raise ValueError(f"sparse_attention_backward: total_S_q={s_q} exceeds the fused kernel's grid limit")
    if n_kv > 2**31 - 1:
        raise ValueError(f"sparse_attention_backward: kv has {n_kv} rows; ids are int32, at most 2**31 - 1 rows")

    q_st = q.stride()
    if hp != h:
        q = padded_heads(q, hp)
    elif q_st[2] != 1 or q_st[1] != d_qk or q_st[0] % 8 or q.data_ptr() % 16:
        q = q.clone(memory_format=torch.contiguous_format)
    kv_st = kv.stride()
    if kv_st[1] != 1 or kv_st[0] % 8 or kv.data_ptr() % 16:
        kv = kv.clone(memory_format=torch.contiguous_format)
    if topk_idxs.stride(1) != 1 and k_width > 1:
        topk_idxs = topk_idxs.contiguous()
    out_p = padded_heads(out, hp)
    dout_p = padded_heads(dout, hp)
    lse_p = padded_heads(lse.to(torch.float32), hp, float("inf"))
    sink = None
    if attn_sink is not None:
        sink = attn_sink.to(torch.float32)
        if hp != h:
            sink = torch.cat([sink, sink.new_zeros(hp - h)])
        sink = sink.contiguous()
    length = None if topk_length is None else topk_length.to(torch.int32).contiguous()

    nb = buckets(n_kv, cfg.bucket_rows)
    need = workspace_numel(s_q, h, n_kv, k_width, d_qk, deterministic, cfg)
    if workspace is None:
        ws = torch.empty(need, dtype=torch.float32, device=q.device)
    else:
        if (workspace.dtype != torch.float32 or workspace.device != q.device or not workspace.is_contiguous()
                or workspace.numel() < need):
            raise ValueError(f"sparse_attention_backward: workspace must be a contiguous float32 tensor on "
                             f"{q.device} with at least {need} elements (got {workspace.dtype} "
                             f"{tuple(workspace.shape)} on {workspace.device})")
        ws = workspace
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        t = ws[at:at + n]
        at += n
        return t

    acc = take(n_kv * d_qk).view(n_kv, d_qk)
    delta = take(s_q * hp).view(s_q, hp)
    counter = take(4).view(torch.int32)
    win = take(_align4(s_q * 2)).view(torch.int32)[:s_q * 2].view(s_q, 2)
    acc.zero_()
    dq = torch.empty((s_q, hp, d_qk), dtype=q.dtype, device=q.device)

    ids = topk_idxs
    if nb > 1 and s_q > 0 and k_width > 0:
        ids = take(_align4(s_q * k_width)).view(torch.int32)[:s_q * k_width].view(s_q, k_width)
    slot_windows(topk_idxs, n_kv, length, cfg.bucket_rows if nb > 1 else None, ids_out=ids, win_out=win)

    def run(t0: int, t1: int, target: torch.Tensor) -> None:
        if sync_grid:
            counter.zero_()
        kernel.launch(q[t0:t1], kv, ids[t0:t1], win[t0:t1], lse_p if sink is None else sink, out_p[t0:t1],
                      dout_p[t0:t1], lse_p[t0:t1], dq[t0:t1], target, delta[t0:t1], t1 - t0, n_kv, k_width,
                      q.stride(0), kv.stride(0) if n_kv else d_qk, ids.stride(0) if k_width else 0,
                      float(softmax_scale), int(sink is not None), counter, int(sync_grid), n_ctas)

    if s_q > 0 and not deterministic:
        run(0, s_q, acc)
    elif s_q > 0:
        rows = min(s_q, chunk_rows(h, k_width, d_qk, cfg.deterministic_chunk_bytes))
        buf = take(rows * hb * max(k_width, 1) * d_qk)
        slots = torch.arange(k_width, device=q.device, dtype=torch.int32)
        # one reverse index (RowScatter) per group of launches of at most INDEX_SLOTS slots in all
        group = max(1, INDEX_SLOTS // (rows * hb * max(k_width, 1))) * rows
        for g0 in range(0, s_q, group):
            g1 = min(s_q, g0 + group)
            # slots past a row's window get -1; ids outside [0, n_kv) are skipped by the scatter itself
            target = ids[g0:g1].masked_fill(slots.view(1, -1) >= win[g0:g1, 1:], -1)
            scatter = RowScatter(target.unsqueeze(1).expand(g1 - g0, hb, k_width).reshape(-1), n_kv)
            for t0 in range(g0, g1, rows):
                t1 = min(g1, t0 + rows)
                chunk = buf[:(t1 - t0) * hb * k_width * d_qk].view(-1, d_qk)
                run(t0, t1, chunk)       # slots past a row's window are not written, and their targets are -1
                scatter.add(acc, chunk)
    dkv = acc.to(kv.dtype)
    d_sink = None
    if sink is not None:
        lse_s = torch.logaddexp(lse_p, sink.view(1, -1))
        d_sink = -(torch.exp(sink.view(1, -1) - lse_s) * delta).sum(dim=0)[:h].to(attn_sink.dtype)
    if hp != h:
        dq = dq[:, :h].contiguous()
    return dq, dkv, d_sink


@torch.library.custom_op("dsagen::sparse_attention_bwd", mutates_args=())
def _sparse_attention_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                          lse: torch.Tensor, topk_idxs: torch.Tensor, attn_sink: Optional[torch.Tensor],
                          topk_length: Optional[torch.Tensor], softmax_scale: float, d_v: int,
                          deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # a custom op cannot return None: without a sink, d_sink is an empty (0,) tensor that the caller drops
    _check_supported(q, d_v)
    dq, dkv, d_sink = _launch(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale, d_v,
                              deterministic, None)
    return dq, dkv, q.new_empty((0,), dtype=torch.float32) if d_sink is None else d_sink


@_sparse_attention_bwd.register_fake
def _sparse_attention_bwd_fake(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale, d_v,
                               deterministic):
    d_sink = q.new_empty((0,), dtype=torch.float32) if attn_sink is None else attn_sink.new_empty(attn_sink.shape)
    return torch.empty_like(q), torch.empty_like(kv), d_sink


def sparse_attention_backward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                              lse: torch.Tensor, topk_idxs: torch.Tensor, *, attn_sink: torch.Tensor | None,
                              topk_length: torch.Tensor | None, softmax_scale: float, d_v: int,
                              deterministic: bool = False, workspace: torch.Tensor | None = None,
                              config: SparseAttnBwdConfig | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Flat-layout fused backward (inputs already validated by dsagen.ops.sparse_attention).

    q `(S_q, H, D_qk)` bf16/fp16 CUDA, kv `(S_kv, D_qk)`, out / dout `(S_q, H, d_v)`, lse `(S_q, H)` FP32 (the
    forward's, KV-only), topk_idxs int32 `(S_q, K)` global ids, attn_sink `(H,)` FP32/FP64 or None, topk_length
    int32 `(S_q,)` or None. workspace: None or a contiguous CUDA float32 tensor of at least workspace_numel(...)
    elements (then the call allocates only its outputs). config: None (the op's) or another SparseAttnBwdConfig
    (eager calls only). Returns dq `(S_q, H, D_qk)` in q.dtype, dkv `(S_kv, D_qk)` in kv.dtype, d_sink `(H,)` in
    attn_sink.dtype (None without a sink).
    Raises NotImplementedError (with the reason) for inputs the kernel does not cover.
    """
    _check_supported(q, d_v)
    if torch.compiler.is_compiling():
        if config is not None or workspace is not None:
            raise NotImplementedError("sparse_attention_backward: config= and workspace= are for eager calls "
                                      "(the custom op allocates its scratch)")
        dq, dkv, d_sink = _sparse_attention_bwd(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length,
                                                float(softmax_scale), int(d_v), bool(deterministic))
        return dq, dkv, None if attn_sink is None else d_sink
    return _launch(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v),
                   bool(deterministic), workspace, config)
