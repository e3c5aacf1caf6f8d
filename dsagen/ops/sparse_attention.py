"""Public DeepSeek sparse-attention ops: `sparse_attention` (cuDNN frontend DSA §1/§2 flat MQA, DeepSeek-V4 inference kernel's batched
inference layout; `indexer_topk` adds §1's lse_indexer) with its autograd backward, the explicit
`sparse_attention_backward` (cuDNN frontend DSA §2 Sparse Attention Backward) with
`sparse_attention_backward_workspace`, and the attention score recomputes (cuDNN frontend DSA §7, §8).

`impl="fused"` (the default, as in attention-gym lightning_indexer) runs a generated CUDA kernel through
`dsagen.ops._fused.fused_impl`, which raises ValueError for CPU tensors and NotImplementedError where no
kernel exists yet (never a silent fallback); `impl="reference"` runs the plain-PyTorch oracle in
dsagen.reference.sparse_attention on CPU or CUDA.
"""

from __future__ import annotations

import torch

from ._fast_path import FastPaths, call_signature, eager_call
from ._fused import fused_impl
from ..reference import sparse_attention as ref
from ..validate import (FLOAT_DTYPES, check_bool, check_cu_seqlens_pair, check_float, check_impl, check_int,
                        check_same_dtype, check_shape, check_tensor)
from .indexer import is_packed

_INT32_MAX = 2**31 - 1
_SINK_DTYPES = (torch.float32, torch.float64)
# the fused forward snapshots its running softmax state after each pair of 64-slot tiles
_FUSED_INDEXER_STEP = 128
#: sparse_attention's plans of eager fused calls without autograd, by signature (dsagen.ops._fast_path)
_FAST = FastPaths("sparse_attention")


def _forward(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl, indexer_topk=0, keep_plan=None):
    """The flat-layout forward by `impl`, without autograd: (out, lse, max_logits), plus lse_indexer when
    indexer_topk > 0 (0 asks for none; the fused host takes the argument only then). keep_plan: the fast path's
    store (sparse_attention), handed to the fused host."""
    kwargs = dict(attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale, d_v=d_v)
    if indexer_topk:
        kwargs["indexer_topk"] = indexer_topk
    if keep_plan is not None:
        kwargs["keep_plan"] = keep_plan
    if impl == "reference":
        return ref.sparse_attention_forward(q, kv, topk_idxs, **kwargs)
    return fused_impl("sparse_attention", q.device)(q, kv, topk_idxs, **kwargs)


def _backward(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, deterministic,
              workspace, impl):
    """The flat-layout backward by `impl`: (dq, dkv, d_sink), d_sink in attn_sink's dtype (None without a sink).
    The reference takes no workspace and ignores `deterministic` (its order is torch's index_add_)."""
    if impl == "reference":
        return ref.sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length=topk_length,
                                             softmax_scale=softmax_scale, d_v=d_v)
    return fused_impl("sparse_attention_backward", q.device)(
        q, kv, out, dout, lse, topk_idxs, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale,
        d_v=d_v, deterministic=deterministic, workspace=workspace)


def _flat(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl, indexer_topk=0, keep_plan=None):
    """The flat-layout op: through the autograd Function when a gradient may be needed, else the forward alone
    (inference and decode calls skip the Function's host cost, ~10 us; keep_plan: the fast path's store, for those
    only). Returns what `_forward` returns."""
    if _needs_grad(q, kv, attn_sink):
        return _SparseAttentionFunction.apply(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl,
                                              indexer_topk)
    return _forward(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl, indexer_topk, keep_plan)


class _SparseAttentionFunction(torch.autograd.Function):
    """Flat-layout sparse attention: forward and backward by `impl`. impl="fused" differentiates through the fused
    backward kernel (`sparse_attention_backward`), deterministic exactly when
    `torch.are_deterministic_algorithms_enabled()` (read when the backward runs eagerly; under torch.compile the
    value when the step was traced, guarded, so changing it recompiles); impl="reference" through the reference
    formula. Neither syncs with the host on
    CUDA, so a forward + backward step is CUDA-graph capturable once the kernels are loaded.

    With indexer_topk > 0 the forward also returns lse_indexer (a fourth output, non-differentiable like lse and
    max_logits); gradients flow through out only."""

    @staticmethod
    def forward(ctx, q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl, indexer_topk):
        outs = _forward(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, impl, indexer_topk)
        out, lse = outs[0], outs[1]
        ctx.save_for_backward(q, kv, topk_idxs, attn_sink, topk_length, lse, out)
        ctx.softmax_scale, ctx.d_v, ctx.impl = softmax_scale, d_v, impl
        ctx.mark_non_differentiable(*outs[1:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, dout, *_stats_grads):
        q, kv, topk_idxs, attn_sink, topk_length, lse, out = ctx.saved_tensors
        deterministic = ctx.impl == "fused" and torch.are_deterministic_algorithms_enabled()
        dq, dkv, d_sink = _backward(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, ctx.softmax_scale,
                                    ctx.d_v, deterministic, None, ctx.impl)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dkv if need[1] else None, None,
                d_sink if attn_sink is not None and need[3] else None, None, None, None, None, None)


def _check_scale(softmax_scale, d_qk: int) -> float:
    if softmax_scale is None:
        return ref.default_softmax_scale(d_qk)
    return check_float("softmax_scale", softmax_scale)


def _check_qkv_ids(q, kv, topk_idxs) -> tuple[bool, tuple[int, ...], int, int]:
    """The layout checks shared by the forward, the backward and the workspace helper: (batched, lead, H, D_qk)
    with lead (total_S_q,) or (B, T)."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=(3, 4))
    batched = q.dim() == 4
    lead = tuple(q.shape[:-2])  # (S_q,) or (B, T)
    h, d_qk = q.shape[-2], q.shape[-1]
    kv_what = "[B, N, D_qk]" if batched else "(total_S_kv, D_qk)"
    check_tensor("kv", kv, ndim=q.dim() - 1, device=q.device)
    check_same_dtype("kv", kv, "q", q)
    if kv.shape[-1] != d_qk or (batched and kv.shape[0] != q.shape[0]):
        want = f"({q.shape[0]}, N, {d_qk})" if batched else f"(total_S_kv, {d_qk})"
        raise ValueError(f"kv must have shape {kv_what} = {want} to match q {tuple(q.shape)}, "
                         f"got {tuple(kv.shape)}")
    check_tensor("topk_idxs", topk_idxs, dtypes=(torch.int32,), ndim=len(lead) + 1, device=q.device)
    if tuple(topk_idxs.shape[:-1]) != lead:
        raise ValueError(f"topk_idxs must have shape {lead + ('K',)} (q's leading dims, then K), "
                         f"got {tuple(topk_idxs.shape)}")
    if batched and kv.shape[0] * kv.shape[1] > _INT32_MAX:
        raise ValueError(f"kv with B={kv.shape[0]}, N={kv.shape[1]}: flat ids b * N + i must fit in int32 "
                         f"(B * N <= {_INT32_MAX})")
    return batched, lead, h, d_qk


def _check_options(q, h, lead, batched, attn_sink, topk_length, softmax_scale, d_v) -> tuple[float, int]:
    """attn_sink, topk_length, softmax_scale and d_v (shared by the forward and the backward): (scale, d_v)."""
    d_qk = q.shape[-1]
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtypes=_SINK_DTYPES, device=q.device)
        check_shape("attn_sink", attn_sink, (h,), "(H,)")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=(torch.int32,), device=q.device)
        check_shape("topk_length", topk_length, lead, "[B, T]" if batched else "(total_S_q,)")
    scale = _check_scale(softmax_scale, d_qk)
    if d_v is None:
        d_v = ref.default_d_v(d_qk)
    check_int("d_v", d_v, minimum=1, maximum=d_qk)
    return scale, d_v


def _check_indexer_topk(indexer_topk, k: int, impl: str) -> int:
    """indexer_topk (None or an int in [0, K]; for impl="fused" 0 or a multiple of 128) as an int, 0 for None."""
    if indexer_topk is None:
        return 0
    check_int("indexer_topk", indexer_topk)
    if not 0 <= indexer_topk <= k:
        raise ValueError(f"indexer_topk must be in [0, K] = [0, {k}] (K: the width of topk_idxs), "
                         f"got {indexer_topk}")
    if impl == "fused" and indexer_topk % _FUSED_INDEXER_STEP:
        raise NotImplementedError(
            f"indexer_topk={indexer_topk}: impl='fused' takes 0 or a positive multiple of {_FUSED_INDEXER_STEP} "
            f"(the fused kernel snapshots its running softmax state after each pair of 64-slot tiles); "
            f"use impl='reference' for other prefix lengths")
    return indexer_topk


#: the fused local_to_global's batch limit (its grid's y dimension)
_LOCAL_TO_GLOBAL_MAX_BATCH = 65535


def _flat_ids(topk_idxs: torch.Tensor, b: int, n: int, fused: bool = False) -> torch.Tensor:
    """Batch-local ids `[B, T, K]` as flat int32 ids b * N + i `(B * T, K)`; -1 and ids outside [0, N) become -1,
    so no id can alias a neighbouring batch (device ops only: no host sync). fused: an eager fused call on real
    CUDA tensors, which takes the generated local_to_global kernel (one launch, the same ids) for up to 65535
    batches; otherwise (the reference, torch.compile, more batches) nine torch ops do it."""
    if fused and b <= _LOCAL_TO_GLOBAL_MAX_BATCH:
        return fused_impl("local_to_global", topk_idxs.device)(topk_idxs, n).view(b * topk_idxs.shape[1],
                                                                                  topk_idxs.shape[2])
    local = topk_idxs.long()
    offsets = torch.arange(b, device=topk_idxs.device, dtype=torch.long).view(b, 1, 1) * n
    flat = torch.where((local >= 0) & (local < n), local + offsets, -1).to(torch.int32)
    return flat.reshape(b * topk_idxs.shape[1], topk_idxs.shape[2])


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                     attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                     softmax_scale: float | None = None, d_v: int | None = None, impl: str = "fused",
                     indexer_topk: int | None = None
                     ) -> (tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                           | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]):
    """DeepSeek sparse MQA with an optional per-head attention sink: `(out, lse, max_logits)`, plus `lse_indexer`
    when `indexer_topk` is given.

    Two layouts, told apart by `q.dim()`:

    * 3-D, flat (cuDNN frontend DSA §1): q `(total_S_q, H, D_qk)`, kv `(total_S_kv, D_qk)`, topk_idxs int32
      `(total_S_q, K)` of *global* row ids into kv, topk_length `(total_S_q,)`.
    * 4-D, batched inference (DeepSeek-V4 inference kernel): q `[B, T, H, D_qk]`, kv `[B, N, D_qk]`, topk_idxs int32
      `[B, T, K]` of ids *local* to batch b's N rows, topk_length `[B, T]`. Local ids are range-checked
      against N and turned into flat ids b * N + i (-1 and out-of-range ids stay invalid, so no id can
      alias a neighbouring batch; an eager impl="fused" call does it with the fused local_to_global kernel, which
      every model build includes); the flat op runs and outputs are reshaped to `[B, T, ...]`.

    For valid slot j of row t and head h: s = softmax_scale * q[t, h] . kv[id_j] (all D_qk columns);
    out[t, h] = sum_j exp(s_j - L) * kv[id_j, :d_v] with L = logaddexp(lse[t, h], attn_sink[h]):
    the sink only enlarges the denominator. A slot is valid when 0 <= id < rows of kv and its position
    is below topk_length[t] (clamped to [0, K]); -1, out-of-range ids and slots past topk_length score
    -inf and are never read; duplicate ids are distinct softmax slots. K may be 0.

    Args:
        q: FP16/BF16 (FP32/FP64 accepted by the reference) queries, layout above.
        kv: the shared latent, K = all D_qk columns, V = the first `d_v` columns; dtype of q.
        topk_idxs: int32 ids, layout above.
        attn_sink: optional FP32 (or FP64) `(H,)` learned sink logits; None is a sink of -inf.
        topk_length: optional int32 valid-prefix lengths, layout above.
        softmax_scale: finite float; default 1 / sqrt(D_qk).
        d_v: V/output width, 1 <= d_v <= D_qk; default 512 when D_qk == 576 (the MLA latent: 512 +
            64 RoPE columns), otherwise D_qk.
        impl: "fused" (default; generated CUDA kernel) or "reference" (plain PyTorch, CPU or CUDA).
        indexer_topk: None (default: three outputs, as without it) or an int N, 0 <= N <= K, the indexer prefix
            of cuDNN frontend DSA §1 Sparse Attention Forward: a fourth output, lse_indexer. impl="fused" takes
            N = 0 or a positive multiple of 128 (the kernel snapshots its running softmax state after each pair
            of 64-slot tiles); impl="reference" any N in [0, K].

    Returns:
        out `(..., H, d_v)` in q.dtype; lse `(..., H)` KV-only log-sum-exp of the valid scaled scores
        (the sink is NOT included); max_logits `(..., H)` the largest valid scaled score. lse and
        max_logits are FP32 (FP64 for FP64 inputs). A row without a valid slot gives out = 0,
        lse = +inf, max_logits = -inf.
        With indexer_topk=N also lse_indexer `(..., H)` (dtype of lse): lse over the first N slots only,
        logsumexp of the scaled scores of the valid slots j < min(N, topk_length[t]) (natural log, no sink,
        +inf where that prefix holds no valid slot: an empty row, or a row whose first N slots are all
        invalid); None for N = 0. N = K gives lse. Rows with topk_length < N are allowed (their prefix is
        their valid slots; cuDNN frontend DSA §1 requires topk_length >= N).

    Gradients: q, kv and attn_sink are differentiable (lse, max_logits and lse_indexer are not); the forward saves
    q, kv, the ids, out and lse. impl="fused" differentiates through the fused backward kernel (`sparse_attention_backward`,
    cuDNN frontend DSA §2), deterministic (dkv and the sink gradient bitwise the same run to run) exactly when
    `torch.are_deterministic_algorithms_enabled()` is True when the backward runs (`torch.use_deterministic_algorithms`;
    warn_only counts as enabled; under torch.compile the value when the step was traced, guarded); impl="reference"
    through the explicit reference formula. Eager, under
    `torch.compile(fullgraph=True)` and inside a CUDA-graph capture of a forward + backward step (call it once
    eagerly first so that the kernels are loaded).

    Raises:
        TypeError: a non-tensor argument, wrong dtypes (kv not q's dtype, ids/lengths not int32, sink
            not FP32/FP64), softmax_scale not a number, d_v or indexer_topk not an int.
        ValueError: q not 3-D or 4-D, mismatched shapes or devices, non-finite softmax_scale, d_v out
            of [1, D_qk], indexer_topk outside [0, K], B * N > 2**31 - 1, unknown impl, or impl="fused" on
            CPU tensors.
        NotImplementedError: impl="fused" where no generated kernel exists for the device, or with an
            indexer_topk that is not 0 or a multiple of 128 (never a silent fallback to the reference).
    """
    key = None
    if impl == "fused" and eager_call(q) and not _needs_grad(q, kv, attn_sink):
        # the fused forward reads no values on the host: a call of a signature that passed once runs by its plan
        key = call_signature(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, indexer_topk)
        plan = _FAST.get(key)
        if plan is not None:
            return plan(q, kv, topk_idxs, attn_sink, topk_length)
    check_impl(impl)
    batched, lead, h, d_qk = _check_qkv_ids(q, kv, topk_idxs)
    scale, d_v = _check_options(q, h, lead, batched, attn_sink, topk_length, softmax_scale, d_v)
    n_idx = _check_indexer_topk(indexer_topk, topk_idxs.shape[-1], impl)
    public = _PublicForward(batched, tuple(q.shape), kv.shape[-2] if batched else 0, d_v, indexer_topk is not None,
                            n_idx)
    def keep_plan(launch):
        public.launch = launch
        _FAST.put(key, public)

    keep = keep_plan if key is not None else None

    if not batched:
        outs = _flat(q, kv, topk_idxs, attn_sink, topk_length, scale, d_v, impl, n_idx, keep)
    else:
        b, t, n = q.shape[0], q.shape[1], kv.shape[1]
        public.fused_ids = impl == "fused" and _on_cuda(q) and eager_call(q) and eager_call(topk_idxs)
        ids = _flat_ids(topk_idxs, b, n, public.fused_ids)
        outs = _flat(q.reshape(b * t, h, d_qk), kv.reshape(b * n, d_qk), ids, attn_sink,
                     None if topk_length is None else topk_length.reshape(b * t), scale, d_v, impl, n_idx, keep)
    return public.finish(outs)


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether `t` is on a CUDA device (where the fused kernels run)."""
    return t.device.type == "cuda"


def _needs_grad(q, kv, attn_sink) -> bool:
    """Whether a forward call records autograd (then it runs through _SparseAttentionFunction)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, kv, attn_sink))


class _PublicForward:
    """sparse_attention's layout around the flat forward: the batched layout's flat views and ids going in, its
    shapes coming out, and the indexer_topk convention of the result. `finish` shapes a result; once `launch` (the
    fused host's SparseFwdLaunch) is set, calling it repeats an eager fused call of the signature it was made from
    (the fast path)."""

    def __init__(self, batched: bool, q_shape: tuple, n: int, d_v: int, prefix_asked: bool, n_idx: int):
        self.batched, self.q_shape, self.n, self.d_v = batched, q_shape, n, d_v
        self.prefix_asked, self.n_idx = prefix_asked, n_idx
        self.launch = None
        self.fused_ids = False      # batched: the flat ids by the fused local_to_global (set by the full path)

    def finish(self, outs: tuple) -> tuple:
        if self.batched:
            b, t, h = self.q_shape[:3]
            outs = (outs[0].reshape(b, t, h, self.d_v),) + tuple(x.reshape(b, t, h) for x in outs[1:])
        if not self.prefix_asked:
            return outs
        return tuple(outs) if self.n_idx else (*outs, None)

    def __call__(self, q, kv, topk_idxs, attn_sink, topk_length) -> tuple:
        if self.batched:
            b, t, h, d_qk = self.q_shape
            q, kv = q.reshape(b * t, h, d_qk), kv.reshape(b * self.n, d_qk)
            topk_idxs = _flat_ids(topk_idxs, b, self.n, self.fused_ids)
            topk_length = None if topk_length is None else topk_length.reshape(b * t)
        return self.finish(self.launch(q, kv, topk_idxs, attn_sink, topk_length))


def sparse_attention_backward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                              lse: torch.Tensor, topk_idxs: torch.Tensor, *, attn_sink: torch.Tensor | None = None,
                              topk_length: torch.Tensor | None = None, softmax_scale: float | None = None,
                              d_v: int | None = None, deterministic: bool = False,
                              workspace: torch.Tensor | None = None, impl: str = "fused"
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sparse MQA backward (cuDNN frontend DSA §2 Sparse Attention Backward): `(dq, dkv, d_sink)` of `sparse_attention`.

    It reads the forward's `out` and its KV-only `lse` (the sink is not in it) and recomputes the probabilities:
    with L = logaddexp(lse, attn_sink[h]) (lse alone without a sink), for every valid slot j of row t, head h:

        P_j    = exp(softmax_scale * q[t, h] . kv[id_j] - L)         delta = sum_d out[t, h, d] * dout[t, h, d]
        dS_j   = P_j * (dout[t, h] . kv[id_j, :d_v] - delta)
        dq     = softmax_scale * sum_j dS_j kv[id_j]
        dkv[id_j] += softmax_scale * sum_h dS_j q[t, h]  (+ sum_h P_j dout[t, h] on the first d_v columns)
        d_sink[h]  = -sum_t exp(attn_sink[h] - L) * delta          (the sink enters the denominator only)

    Slot validity is the forward's: -1, out-of-range ids and slots at or past topk_length contribute nothing and
    are never read; duplicate ids are distinct slots (their dkv contributions add); a row without a valid slot
    (lse = +inf) gives zero gradients. Pass `out` and `lse` exactly as `sparse_attention` returned them.

    Layouts, told apart by `q.dim()` as in `sparse_attention`:

    * 3-D, flat: q `(total_S_q, H, D_qk)`, kv `(total_S_kv, D_qk)`, out / dout `(total_S_q, H, d_v)`, lse
      `(total_S_q, H)`, topk_idxs int32 `(total_S_q, K)` of global row ids, topk_length `(total_S_q,)`.
    * 4-D, batched (DeepSeek-V4 inference kernel): q `[B, T, H, D_qk]`, kv `[B, N, D_qk]`, out / dout
      `[B, T, H, d_v]`, lse `[B, T, H]`, topk_idxs int32 `[B, T, K]` of ids local to batch b's N rows (ids
      outside [0, N) are invalid and never alias another batch), topk_length `[B, T]`. The flat op runs on
      b * N + i ids and dq / dkv come back as `[B, T, H, D_qk]` / `[B, N, D_qk]`.

    Args:
        q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v: the forward's arguments (same rules and
            defaults: softmax_scale 1 / sqrt(D_qk), d_v 512 when D_qk == 576 else D_qk).
        out: the forward's output, dtype of q. dout: the gradient of out, dtype of q.
        lse: the forward's KV-only log-sum-exp, FP32 (or FP64).
        deterministic: impl="fused": False adds the dkv terms by FP32 atomics (run-to-run differences in the last
            bits); True stores each (row, 64-head block, slot) term and sums them per id in a fixed order, so dkv
            and d_sink are bitwise identical run to run (dq always is). impl="reference" ignores it (its dkv sum
            is torch's index_add_: deterministic on the CPU, and on CUDA under torch.use_deterministic_algorithms).
        workspace: impl="fused" only: None (the call allocates its FP32 scratch) or a caller-owned contiguous
            float32 tensor on q's device with at least the scratch's elements, e.g. from
            `sparse_attention_backward_workspace(q, kv, topk_idxs, deterministic=...)`: then the call allocates
            only its outputs (dq, dkv, d_sink and, for padded heads, the padded copies of q, out, dout and lse)
            and, with deterministic=True, the sum's reverse index (torch's caching allocator, inside a capture the
            graph's pool: about 24 bytes per (row, 64-head block, slot) while it is built, for at most 2**24 of
            them at a time, ~400 MB), so a captured CUDA graph gets no other scratch allocation. Its contents are overwritten; it may be reused
            by the next call once this one has run (same stream). Scratch, FP32 elements (total_S_q, total_S_kv
            flat; H_k = 64 for H <= 64, else 128):
            total_S_kv * D_qk (the dkv accumulator) + total_S_q * H_k (delta) + 4 (a grid barrier count)
            + a4(2 * total_S_q) (each row's slot window), plus a4(total_S_q * K) (the rows' ids ordered by KV
            window) when total_S_kv > 4096, plus with deterministic min(total_S_q, R) * (H_k / 64) * max(K, 1) *
            D_qk (the per-slot terms of R rows at a time, R chosen so that this part stays within 1 GiB, at least
            one row); a4(n) rounds n up to a multiple of 4.
        impl: "fused" (default; the sm_90a kernel: bf16/fp16, D_qk 512 or 576 with d_v 512, H <= 128 (64 and 128
            natively, fewer padded)) or "reference" (plain PyTorch, CPU or CUDA, any shape and float dtype).

    Returns:
        dq in q's dtype and shape; dkv in kv's dtype and shape; d_sink `(H,)` FP32 (FP64 for FP64 inputs, like
        lse) whatever attn_sink's dtype, or None without a sink.

    Raises:
        TypeError: a non-tensor argument, wrong dtypes (kv, out or dout not q's dtype, ids/lengths not int32,
            lse or sink not FP32/FP64, workspace not float32), softmax_scale not a number, d_v not an int,
            deterministic not a bool.
        ValueError: q not 3-D or 4-D, mismatched shapes or devices (out / dout / lse against q and d_v), non-finite
            softmax_scale, d_v out of [1, D_qk], B * N > 2**31 - 1, a workspace that is not contiguous or too
            small, a workspace with impl="reference", unknown impl, or impl="fused" on CPU tensors.
        NotImplementedError: impl="fused" for inputs the fused kernel does not cover (e.g. FP32 q, d_v != 512,
            H > 128; the message says why), never a silent fallback to the reference.
    """
    check_impl(impl)
    batched, lead, h, d_qk = _check_qkv_ids(q, kv, topk_idxs)
    scale, d_v = _check_options(q, h, lead, batched, attn_sink, topk_length, softmax_scale, d_v)
    what = "[B, T, H, d_v]" if batched else "(total_S_q, H, d_v)"
    for name, t in (("out", out), ("dout", dout)):
        check_tensor(name, t, device=q.device)
        check_same_dtype(name, t, "q", q)
        check_shape(name, t, (*lead, h, d_v), what)
    check_tensor("lse", lse, dtypes=_SINK_DTYPES, device=q.device)
    check_shape("lse", lse, (*lead, h), "[B, T, H]" if batched else "(total_S_q, H)")
    check_bool("deterministic", deterministic)
    if workspace is not None:
        if impl == "reference":
            raise ValueError("workspace is only accepted for impl='fused' (the fused kernel's scratch); "
                             "impl='reference' takes none")
        check_tensor("workspace", workspace, dtypes=(torch.float32,), device=q.device)
    stats = ref.acc_dtype(q.dtype)

    if batched:
        b, t, n = q.shape[0], q.shape[1], kv.shape[1]
        flat = (q.reshape(b * t, h, d_qk), kv.reshape(b * n, d_qk), out.reshape(b * t, h, d_v),
                dout.reshape(b * t, h, d_v), lse.reshape(b * t, h), _flat_ids(topk_idxs, b, n))
        length = None if topk_length is None else topk_length.reshape(b * t)
    else:
        flat, length = (q, kv, out, dout, lse, topk_idxs), topk_length
    if impl == "fused":
        _check_workspace(workspace, q, kv, topk_idxs, deterministic)
    dq, dkv, d_sink = _backward(*flat, attn_sink, length, scale, d_v, deterministic, workspace, impl)
    if d_sink is not None and d_sink.dtype != stats:
        d_sink = d_sink.to(stats)
    return dq.reshape(q.shape), dkv.reshape(kv.shape), d_sink


def _workspace_numel(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, deterministic: bool) -> int:
    """FP32 elements of the fused backward's scratch for q, kv, topk_idxs of either layout on a CUDA device."""
    s_q = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
    n_kv = kv.shape[0] * kv.shape[1] if kv.dim() == 3 else kv.shape[0]
    numel = fused_impl("sparse_attention_backward_workspace_numel", q.device)
    return numel(s_q, q.shape[-2], n_kv, topk_idxs.shape[-1], q.shape[-1], deterministic)


def _check_workspace(workspace, q, kv, topk_idxs, deterministic) -> None:
    if workspace is None:
        return
    fused_impl("sparse_attention_backward", q.device)          # ValueError for CPU tensors, naming the op
    if not workspace.is_contiguous():
        raise ValueError(f"workspace must be contiguous, got shape {tuple(workspace.shape)} "
                         f"strides {workspace.stride()}")
    need = _workspace_numel(q, kv, topk_idxs, deterministic)
    if workspace.numel() < need:
        raise ValueError(f"workspace must hold at least {need} float32 elements for these inputs "
                         f"(deterministic={deterministic}), got {workspace.numel()}; "
                         f"see dsagen.sparse_attention_backward_workspace")


def sparse_attention_backward_workspace(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                                        deterministic: bool = False) -> torch.Tensor:
    """A caller-owned scratch tensor for `sparse_attention_backward(..., workspace=..., impl="fused")`.

    Allocate it once, outside a CUDA-graph capture, and pass it to every backward call of that shape: the call then
    allocates no scratch (only its outputs). The size depends on total_S_q, H, total_S_kv, the top-k width K,
    D_qk and `deterministic` (FP32 elements; H_k = 64 for H <= 64, else 128):

        total_S_kv * D_qk + total_S_q * H_k + 4 + a4(2 * total_S_q)
        + total_S_kv > 4096 only: a4(total_S_q * K)         (the ids ordered by KV window; a4: up to a multiple of 4)
        + deterministic only: min(total_S_q, R) * (H_k / 64) * max(K, 1) * D_qk, R rows per 1 GiB chunk (>= 1)

    The deterministic part holds each slot's dkv term before the fixed-order sum; a workspace sized for
    deterministic=True also serves deterministic=False calls of the same shape, and one sized for larger inputs
    serves smaller ones.

    Args:
        q, kv, topk_idxs: the backward's inputs (or tensors of their shapes), in either layout of
            `sparse_attention` (flat or batched: total_S_q = B * T, total_S_kv = B * N), on a CUDA device.
        deterministic: the mode of the calls it will serve.

    Returns:
        An uninitialised contiguous 1-D float32 tensor on q's device.

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, shapes or devices (the checks of
        `sparse_attention`); ValueError for tensors that are not on a CUDA device (the fused backward's scratch).
    """
    _check_qkv_ids(q, kv, topk_idxs)
    check_bool("deterministic", deterministic)
    if q.device.type != "cuda":
        raise ValueError(f"sparse_attention_backward_workspace: the workspace is scratch of the fused backward, "
                         f"which runs on CUDA; inputs are on {q.device}")
    need = _workspace_numel(q, kv, topk_idxs, deterministic)
    return torch.empty(need, dtype=torch.float32, device=q.device)


def sparse_attn_score_recompute(q_attn: torch.Tensor, k_attn: torch.Tensor, lse: torch.Tensor,
                                topk_indices: torch.Tensor, softmax_scale: float | None = None, *,
                                topk_length: torch.Tensor | None = None, topk_indices_global: bool = False,
                                impl: str = "fused") -> torch.Tensor:
    """Sparse attention score recompute (cuDNN frontend DSA §7): the training target over the top-k slots.

        target[b, t, i] = sum_h exp(softmax_scale * q_attn[b, t, h] . k_attn[id_i] - lse[b, t, h]) / Z

    with Z the sum over the row's valid slots (L1 normalisation), 0 at invalid slots, and an all-zero
    row when Z = 0 (no valid slot, or lse = +inf). Pass the lse the attention forward returned (the
    KV-only lse of `sparse_attention`, so each head's probabilities over the selected set sum to 1).

    Args:
        q_attn: `(B, S_q, H, D)` FP16/BF16 (FP32/FP64 accepted by the reference).
        k_attn: `(B, S_k, D)` keys (MQA; the attention latent), dtype of q_attn.
        lse: `(B, S_q, H)` FP32 (or FP64) natural-log lse per head.
        topk_indices: int32 `(B, S_q, topk)`: ids local to the batch ([0, S_k), range-checked, never
            aliasing another batch) or, with topk_indices_global, flat ids b' * S_k + local checked
            against B * S_k. -1 and out-of-range ids are invalid slots.
        softmax_scale: finite float; default 1 / sqrt(D).
        topk_length: optional int32 `(B, S_q)`: slots at or after it are invalid (clamped to [0, topk]).
        topk_indices_global: the id convention above.
        impl: "fused" (default) or "reference".

    Returns:
        target `(B, S_q, topk)` FP32 (FP64 for FP64 inputs).

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes, devices or values;
        ValueError for impl="fused" on CPU; NotImplementedError where no fused kernel exists.
    """
    check_impl(impl)
    check_tensor("q_attn", q_attn, dtypes=FLOAT_DTYPES, ndim=4)
    b, s_q, h, d = q_attn.shape
    check_tensor("k_attn", k_attn, ndim=3, device=q_attn.device)
    check_same_dtype("k_attn", k_attn, "q_attn", q_attn)
    if k_attn.shape[0] != b or k_attn.shape[2] != d:
        raise ValueError(f"k_attn must have shape (B, S_k, D) = ({b}, S_k, {d}), got {tuple(k_attn.shape)}")
    check_tensor("lse", lse, dtypes=_SINK_DTYPES, device=q_attn.device)
    check_shape("lse", lse, (b, s_q, h), "(B, S_q, H)")
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32,), ndim=3, device=q_attn.device)
    if tuple(topk_indices.shape[:2]) != (b, s_q):
        raise ValueError(f"topk_indices must have shape (B, S_q, topk) = ({b}, {s_q}, topk), "
                         f"got {tuple(topk_indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=(torch.int32,), device=q_attn.device)
        check_shape("topk_length", topk_length, (b, s_q), "(B, S_q)")
    check_bool("topk_indices_global", topk_indices_global)
    scale = _check_scale(softmax_scale, d)
    kwargs = dict(topk_length=topk_length, topk_indices_global=topk_indices_global)
    if impl == "reference":
        return ref.sparse_attn_score_recompute(q_attn, k_attn, lse, topk_indices, scale, **kwargs)
    return fused_impl("sparse_attn_score_recompute", q_attn.device)(q_attn, k_attn, lse, topk_indices,
                                                                    scale, **kwargs)


def check_dense_attn_inputs(q, k, lse, softmax_scale, packed: bool) -> tuple[torch.Tensor, float]:
    """The attention inputs of the dense score recompute and of dense_indexer_kl_backward: q `(B, S_q, H_q, D)`
    (THD `(total_q, H_q, D)`), k `(B, S_k, H_kv, D)` or `(B, S_k, D)` (THD without B) of q's dtype with H_kv
    dividing H_q, lse `(B, S_q, H_q)` (THD `(total_q, H_q)`) FP32 / FP64. Returns (k with its head dim, the
    softmax scale: softmax_scale or 1 / sqrt(D)); TypeError / ValueError naming the argument."""
    lead = "total_q" if packed else "B, S_q"
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3 if packed else 4)
    h_q, d = q.shape[-2:]
    rows = tuple(q.shape[:-2])  # (B, S_q) or (total_q,)
    check_tensor("k", k, ndim=(2, 3) if packed else (3, 4), device=q.device)
    check_same_dtype("k", k, "q", q)
    k_heads = k.unsqueeze(-2) if k.dim() == q.dim() - 1 else k  # MQA keys get H_kv = 1
    if k_heads.shape[-1] != d or (not packed and k_heads.shape[0] != rows[0]):
        want = f"(total_k, H_kv, D) or (total_k, D) with D={d}" if packed else \
            f"(B, S_k, H_kv, D) or (B, S_k, D) with B={rows[0]}, D={d}"
        raise ValueError(f"k must have shape {want}, got {tuple(k.shape)}")
    h_kv = k_heads.shape[-2]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"k must have H_kv dividing q's H_q={h_q}, got H_kv={h_kv}")
    check_tensor("lse", lse, dtypes=_SINK_DTYPES, device=q.device)
    check_shape("lse", lse, (*rows, h_q), f"({lead}, H_q)")
    return k_heads, _check_scale(softmax_scale, d)


def dense_attn_score_recompute(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                               softmax_scale: float | None = None, *, ratio: int = 1,
                               q_causal_offsets: torch.Tensor | None = None,
                               cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                               impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention score recompute (cuDNN frontend DSA §8): raw head-summed probabilities over the full KV.

        out[b, t, s] = sum_h exp(softmax_scale * q[b, t, h] . k[b, s, h // G] - lse[b, t, h])
        visible when s < clamp((q_causal_offsets[b] + t + 1) // ratio, 0, S_k); masked entries are -inf
        denom[b, t]  = sum of the visible out[b, t, :] (the L1 norm the dense indexer backward takes;
                       0 for a row with nothing visible)

    Packed THD layout, selected by passing cu_seqlens_q and cu_seqlens_k (cuDNN frontend DSA §8 applies §3's mask,
    defined per "batch or THD segment"): segment b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
    and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]) and is computed exactly as BSHD batch b (t, s and
    S_k above are segment-local; q_causal_offsets[b] is the global token index of the segment's first
    query row, not its packed storage offset). The offsets are read on the host, so a THD call is not
    CUDA-graph capturable.

    Args:
        q: `(B, S_q, H_q, D)` (THD: `(total_q, H_q, D)`) FP16/BF16 (FP32/FP64 accepted by the reference).
        k: `(B, S_k, H_kv, D)` (BSHD, H_q divisible by H_kv, G = H_q // H_kv) or `(B, S_k, D)` (MQA,
            H_kv = 1); THD: `(total_k, H_kv, D)` or `(total_k, D)`; dtype of q.
        lse: `(B, S_q, H_q)` (THD: `(total_q, H_q)`) FP32 (or FP64) per-head natural-log lse.
        softmax_scale: finite float; default 1 / sqrt(D).
        ratio: compression ratio of the causal mask, >= 1 (cuDNN frontend DSA §3).
        q_causal_offsets: optional int32 `(B,)`: global token index of each batch's (segment's) q[0]
            (zeros if None).
        cu_seqlens_q, cu_seqlens_k: THD offsets, both or neither: `(B + 1,)` int32 or int64 on q's device,
            starting at 0, non-decreasing, ending at or before total_q / total_k (empty segments allowed).
        impl: "fused" (default) or "reference".

    Returns:
        `(out, denom)`: `(B, S_q, S_k)` and `(B, S_q)`, FP32 (FP64 for FP64 inputs). THD: out
        `(total_q, max_seqlen_k)` (column j of a row of segment b = key row cu_seqlens_k[b] + j; -inf
        past the segment's S_k) and denom `(total_q,)`; rows at or after cu_seqlens_q[-1] belong to no
        segment: out -inf, denom 0.

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes, devices or values (cu_seqlens:
        not int32/int64, passed alone, not 1-D, empty, not starting at 0, decreasing, past the packed
        rows, different segment counts); ValueError for impl="fused" on CPU; NotImplementedError for inputs
        the fused kernel does not take (it names the limit: bf16 / fp16, D 512 / 576, H <= 128, one key head).
    """
    check_impl(impl)
    packed = is_packed(cu_seqlens_q, cu_seqlens_k)
    k_heads, scale = check_dense_attn_inputs(q, k, lse, softmax_scale, packed)
    rows = tuple(q.shape[:-2])  # (B, S_q) or (total_q,)
    check_int("ratio", ratio, minimum=1)
    b = rows[0]
    if packed:
        b = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q=rows[0], total_k=k.shape[0], device=q.device)
    if q_causal_offsets is not None:
        check_tensor("q_causal_offsets", q_causal_offsets, dtypes=(torch.int32,), device=q.device)
        check_shape("q_causal_offsets", q_causal_offsets, (b,), "(B,)")
    if impl == "reference":
        thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
        return ref.dense_attn_score_recompute(q, k_heads, lse, scale, ratio=ratio, q_causal_offsets=q_causal_offsets,
                                              **thd)
    from . import _fused                     # looked up per call (tests stand a fake in for it)

    thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if packed else {}
    return _fused.fused_impl("dense_attn_score_recompute", q.device)(q, k_heads, lse, scale, ratio=ratio,
                                                                     q_causal_offsets=q_causal_offsets, **thd)


__all__ = ["sparse_attention", "sparse_attention_backward", "sparse_attention_backward_workspace",
           "sparse_attn_score_recompute", "dense_attn_score_recompute"]
