"""Fused (generated-kernel) sparse MLA attention forward, flat layout (cuDNN frontend DSA §1 Sparse Attention Forward; the batched DeepSeek-V4 inference kernel
layout is flattened by dsagen.ops.sparse_attention before it gets here).

`sparse_attention(q, kv, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v[, config])` returns
`(out, lse, max_logits)` and runs the sm_90a kernel of `SparseAttnFwdSpec` (kernel module
sparse_mla/fwd_sm90.py). It is the `torch.library` custom op `dsagen::sparse_attention_fwd`, with
a fake implementation, so torch.compile sees one opaque node; the kernel launch itself never allocates
beyond the outputs, never synchronizes and is CUDA-graph capturable once the kernel is loaded.

What the kernel supports natively and what this module adapts:
  * heads: 64 and 128 natively; 1..63 are zero-padded to 64 and 65..127 to 128 (outputs sliced back);
  * top-k width: any K >= 0 (the kernel masks slots past K and past topk_length; nothing is padded);
  * D_qk 512 or 576 with d_v 512; dtypes bfloat16 and float16;
  * q needs a unit stride on heads x D_qk (one token = H * D_qk contiguous elements) and kv rows with a
    unit column stride, 16-byte aligned rows; other layouts are copied to contiguous first.

Launch choices (register budgets, tiles, grid) come from one frozen SparseAttnFwdConfig per call shape, picked by
config_for (dsagen.kernels.sparse_mla.spec); the flat entry's `config=` runs another one (benchmarks, tests).
Eager calls launch the kernel directly; under torch.compile the launch is the custom op's body. The spec, kernel
and CTA count of a call shape are looked up once (_launch_plan).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...runtime import LoadedKernel, device_arch, device_index, device_sm_count

from ...jit import get_kernel
from ...reference.kv_cache import KV_FP8_TOKEN_BYTES
from .checks import kernel_heads
from .spec import COMBINE_MAX_SPLITS, SparseAttnCombineSpec, SparseAttnFwdConfig, SparseAttnFwdSpec, config_for

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1


def padded_heads(t: torch.Tensor, hp: int, fill: float = 0.0) -> torch.Tensor:
    """t `(rows, H, ...)` with heads padded to hp by `fill` (t itself, or a contiguous 16-byte-aligned copy, when
    H == hp): the head-padded inputs of the attention and indexer kernels (q, lse, weights, out, dout)."""
    if t.shape[1] == hp:
        return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
    out = t.new_full((t.shape[0], hp, *t.shape[2:]), fill)
    out[:, :t.shape[1]] = t
    return out


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """t `(rows, D)` as the row gathers read it (16-byte cp.async chunks): t itself when its columns are unit-stride,
    its row stride a multiple of 8 elements and its base 16-byte aligned, else a fresh contiguous copy (`clone`, not
    `contiguous()`, which would return a contiguous but misaligned t as is)."""
    if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def head_padded_launch_plan(cache: dict, h: int, d: int, dtype: torch.dtype, device: torch.device, config,
                            config_for, dtype_names: dict) -> tuple:
    """(spec, loaded kernel, n_ctas argument) of a call of a family whose kernels serve kernel_heads(h) heads (64
    or 128) and whose configs have spec(heads, d, dtype name, arch) and n_ctas(num_sms) (the score recomputes).
    config: the call's, or None for config_for(heads, d, dtype, arch, num_sms); dtype_names maps the torch dtype to
    the spec's name. Cached in `cache` per (h, d, dtype, device, config)."""
    key = (h, d, dtype, device, config)
    plan = cache.get(key)
    if plan is None:
        arch = device_arch(device)
        num_sms = device_sm_count(device_index(device))
        hp = kernel_heads(h)
        cfg = config_for(hp, d, dtype, arch, num_sms) if config is None else config
        spec = cfg.spec(hp, d, dtype_names[dtype], arch)
        plan = cache[key] = (spec, get_kernel(spec, device_index(device)), cfg.n_ctas(num_sms))
    return plan


def spec_for(num_heads: int, d_qk: int, dtype: torch.dtype, arch: str = "sm_90a",
             config: SparseAttnFwdConfig | None = None, lse_prefix: bool = False,
             kv_fp8: bool = False, split_kv: bool = False) -> SparseAttnFwdSpec:
    """The kernel spec that serves `num_heads` query heads (after padding to 64 or 128) under `config` (default:
    the op's, config_for); lse_prefix: the kernel that also writes the LSE over each row's first slots; kv_fp8: the
    kernel that reads the FP8 cache (sparse_attention_decode); split_kv: the kernel of slot ranges (FP32 partials)."""
    hp = kernel_heads(num_heads)
    if config is None:
        config = config_for(hp, d_qk, dtype, None, arch, None, kv_fp8)
    return config.spec(hp, d_qk, _DTYPES[dtype], arch, lse_prefix=lse_prefix, kv_fp8=kv_fp8, split_kv=split_kv)


def supported_reason(q: torch.Tensor, d_v: int) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can)."""
    h, d_qk = q.shape[-2], q.shape[-1]
    if q.dtype not in _DTYPES:
        return f"q has dtype {q.dtype}; the fused kernel takes bfloat16 or float16 (use impl='reference')"
    if d_qk not in (512, 576):
        return f"D_qk={d_qk}; the fused kernel takes 512 or 576 (use impl='reference')"
    if d_v != 512:
        return f"d_v={d_v}; the fused kernel takes d_v=512 (use impl='reference')"
    if not 1 <= h <= 128:
        return f"H={h} query heads; the fused kernel takes 1..128 (64 and 128 natively, fewer padded)"
    return ""


def _check_supported(q: torch.Tensor, d_v: int) -> None:
    """Raise NotImplementedError (with supported_reason's reason) for inputs the fused kernel does not cover."""
    reason = supported_reason(q, d_v)
    if reason:
        raise NotImplementedError(f"sparse_attention: {reason}")


# (heads, d_qk, dtype, device, config, want_kernel) -> (spec, kernel, n_ctas): the per-call host work of a repeated
# call shape is one dict lookup (config None: the op's, config_for's choice, which does not depend on the call's rows;
# a rows-dependent choice would have to put its row range into the key).
_launch_plans: dict[tuple, tuple[SparseAttnFwdSpec, LoadedKernel | None, int]] = {}


def _launch_plan(h: int, d_qk: int, dtype: torch.dtype, device: torch.device, rows: int, want_kernel: bool,
                 config: SparseAttnFwdConfig | None = None, lse_prefix: bool = False, kv_fp8: bool = False,
                 split_kv: bool = False) -> tuple[SparseAttnFwdSpec, LoadedKernel | None, int]:
    """The spec, loaded kernel (None unless want_kernel) and n_ctas argument of a call (cached per call shape,
    config, lse_prefix, kv_fp8 and split_kv)."""
    key = (h, d_qk, dtype, device, config, want_kernel, lse_prefix, kv_fp8, split_kv)
    plan = _launch_plans.get(key)
    if plan is None:
        arch = device_arch(device)
        num_sms = device_sm_count(device_index(device)) if device.type == "cuda" else None   # None: no launch
        cfg = config_for(kernel_heads(h), d_qk, dtype, rows, arch, num_sms, kv_fp8) if config is None else config
        spec = spec_for(h, d_qk, dtype, arch, cfg, lse_prefix, kv_fp8, split_kv)
        kernel = get_kernel(spec, device_index(device)) if want_kernel else None
        ctas = cfg.n_ctas(num_sms) if num_sms is not None else 0
        plan = _launch_plans[key] = (spec, kernel, ctas)
    return plan


class SparseFwdLaunch:
    """The launch of one flat-layout call signature: the spec, kernel and grid, which inputs need a padded or
    contiguous copy (heads, strides, alignment, dtypes) and the outputs' shapes, decided once; calling it with
    tensors of that signature makes the copies, allocates the outputs and launches. Built by `_launch` for every call
    and kept by dsagen.sparse_attention's fast path per signature (dsagen.ops._fast_path). Arguments as `_launch`'s
    (kv uint8: the FP8 cache's rows of 656 bytes, read by the kv_fp8 kernel; split = (n_splits, split_slots): the
    split_kv kernel over each row's slot ranges, then the combine kernel, and max_logits is not computed: None);
    ValueError for a call past the kernel's grid or int32 id limits."""

    def __init__(self, q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, attn_sink: torch.Tensor | None,
                 topk_length: torch.Tensor | None, softmax_scale: float, d_v: int,
                 config: SparseAttnFwdConfig | None = None, indexer_topk: int = 0,
                 split: tuple[int, int] | None = None):
        s_q, h, d_qk = q.shape
        n_kv, k_width = kv.shape[0], topk_idxs.shape[1]
        self.prefix = indexer_topk > 0
        kv_fp8 = kv.dtype == torch.uint8
        if split is not None and (not 1 <= split[0] <= COMBINE_MAX_SPLITS or split[1] <= 0 or split[1] % 128
                                  or self.prefix or q.dtype != torch.bfloat16):
            raise ValueError(f"sparse_attention: split={split} must be (n_splits in 1..{COMBINE_MAX_SPLITS}, a "
                             f"positive multiple of 128 slots), for bfloat16 q and without indexer_topk")
        if split is not None and split[0] * split[1] < k_width:
            raise ValueError(f"sparse_attention: split={split} covers {split[0] * split[1]} slots, fewer than the "
                             f"{k_width} of topk_idxs")
        if kv_fp8 and kv.shape[1] != KV_FP8_TOKEN_BYTES:
            raise ValueError(f"sparse_attention: a uint8 kv holds the FP8 cache's rows of {KV_FP8_TOKEN_BYTES} bytes, "
                             f"got rows of {kv.shape[1]}")
        if kv_fp8 and n_kv == 0 and s_q > 0 and k_width > 0:
            raise ValueError("sparse_attention: a uint8 kv (the FP8 cache) needs at least one row: the kernel reads row "
                             "0 in place of an invalid id (an empty cache's rows are all empty: no launch needed)")
        self.split = split
        spec, self.kernel, n_ctas = _launch_plan(h, d_qk, q.dtype, q.device, s_q, s_q > 0, config, self.prefix,
                                                 kv_fp8, split is not None)
        self.combine = None
        if split is not None and s_q > 0:
            self.combine = get_kernel(SparseAttnCombineSpec(arch=spec.arch, d_v=d_v), device_index(q.device))
        hp = spec.num_heads
        if s_q * (hp // 64) > _MAX_GRID_X:
            raise ValueError(f"sparse_attention: total_S_q={s_q} exceeds the fused kernel's grid limit")
        if n_kv > 2**31 - 1:
            raise ValueError(f"sparse_attention: kv has {n_kv} rows; ids are int32, at most 2**31 - 1 rows")
        # layouts the kernel reads: q token rows of H*D_qk contiguous elements, kv rows with unit column stride and
        # 16-byte alignment, ids with a unit slot stride; other layouts get a fresh, aligned copy (contiguous()
        # would return a misaligned contiguous tensor as is)
        q_st, kv_st, ids_st = q.stride(), kv.stride(), topk_idxs.stride()
        self.h, self.hp, self.d_qk, self.d_v = h, hp, d_qk, d_v
        self.copy_q = hp == h and (q_st[2] != 1 or q_st[1] != d_qk or q_st[0] % 8 or q.data_ptr() % 16)
        self.copy_kv = bool(kv_st[1] != 1 or kv_st[0] % 8 or kv.data_ptr() % 16)
        self.copy_ids = ids_st[1] != 1 and k_width > 1
        q_row = hp * d_qk if hp != h or self.copy_q else q_st[0]
        kv_row = (kv.shape[1] if self.copy_kv else kv_st[0]) if n_kv else kv.shape[1]   # FP8 cache: bytes
        ids_row = (k_width if self.copy_ids else ids_st[0]) if k_width else 0
        self.has_sink, self.has_length = attn_sink is not None, topk_length is not None
        self.sink_f32 = self.has_sink and attn_sink.dtype != torch.float32
        # the split kernel leaves the sink to the combine kernel
        self.scalars = (s_q, n_kv, k_width, q_row, kv_row, ids_row, float(softmax_scale), int(self.has_length),
                        int(self.has_sink and split is None), n_ctas)
        self.indexer_topk = int(indexer_topk)
        self.s_q, self.dtype, self.device = s_q, q.dtype, q.device

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, attn_sink: torch.Tensor | None,
                 topk_length: torch.Tensor | None) -> tuple:
        h, hp, s_q = self.h, self.hp, self.s_q
        if hp != h:
            qp = q.new_zeros((s_q, hp, self.d_qk))
            qp[:, :h] = q
            q = qp
        elif self.copy_q:
            q = q.clone(memory_format=torch.contiguous_format)
        if self.copy_kv:
            kv = kv.clone(memory_format=torch.contiguous_format)
        if self.copy_ids:
            topk_idxs = topk_idxs.contiguous()
        sink = None
        if self.has_sink:
            sink = attn_sink.to(torch.float32) if self.sink_f32 else attn_sink
            if hp != h:
                sink = torch.cat([sink, sink.new_zeros(hp - h)])
            if not sink.is_contiguous():
                sink = sink.contiguous()
        length = topk_length.to(torch.int32).contiguous() if self.has_length else None
        if self.split is not None:
            out, lse = self._split(q, kv, topk_idxs, sink, length)
            if hp != h:
                out, lse = out[:, :h].contiguous(), lse[:, :h].contiguous()
            return out, lse, None
        out = torch.empty((s_q, hp, self.d_v), dtype=self.dtype, device=self.device)
        lse = torch.empty((s_q, hp), dtype=torch.float32, device=self.device)
        max_logits = torch.empty((s_q, hp), dtype=torch.float32, device=self.device)
        lse_indexer = torch.empty((s_q, hp), dtype=torch.float32, device=self.device) if self.prefix else None
        if s_q > 0:
            # absent optional inputs: pass a tensor of the right dtype that the kernel never reads
            args = (q, kv, topk_idxs, topk_idxs if length is None else length, lse if sink is None else sink, out,
                    lse, max_logits, *self.scalars)
            if self.prefix:
                self.kernel.launch(*args, lse_indexer, self.indexer_topk)
            else:
                self.kernel.launch(*args)
        if hp != h:
            out, lse, max_logits = out[:, :h].contiguous(), lse[:, :h].contiguous(), max_logits[:, :h].contiguous()
            if self.prefix:
                lse_indexer = lse_indexer[:, :h].contiguous()
        return (out, lse, max_logits, lse_indexer) if self.prefix else (out, lse, max_logits)

    def _split(self, q, kv, topk_idxs, sink, length) -> tuple[torch.Tensor, torch.Tensor]:
        """The split_kv kernel into FP32 partials of the (row, range) rows, then the combine kernel: (out, lse) of
        the padded heads."""
        n_splits, slots = self.split
        s_q, hp, dev = self.s_q, self.hp, self.device
        o_part = torch.empty((s_q * n_splits, hp, self.d_v), dtype=torch.float32, device=dev)
        l_part = torch.empty((s_q * n_splits, hp), dtype=torch.float32, device=dev)
        out = torch.empty((s_q, hp, self.d_v), dtype=self.dtype, device=dev)
        lse = torch.empty((s_q, hp), dtype=torch.float32, device=dev)
        if s_q > 0:
            # absent optional inputs: a tensor of the right dtype that the kernel never reads (no max_logits)
            self.kernel.launch(q, kv, topk_idxs, topk_idxs if length is None else length, l_part, o_part, l_part,
                               l_part, *self.scalars, n_splits, slots)
            self.combine.launch(o_part, l_part, l_part if sink is None else sink, out, lse, s_q, hp, n_splits,
                                int(sink is not None))
        return out, lse


def _launch(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, attn_sink: torch.Tensor | None,
            topk_length: torch.Tensor | None, softmax_scale: float, d_v: int,
            config: SparseAttnFwdConfig | None = None, indexer_topk: int = 0,
            keep_plan: Callable[[Callable], None] | None = None, split: tuple[int, int] | None = None) -> tuple:
    """Launch the kernel on flat-layout inputs that supported_reason accepted (its callers check); with
    indexer_topk > 0 (a multiple of 128, at most K) the lse_prefix kernel, which also returns lse_indexer.
    keep_plan, when given, gets the call's SparseFwdLaunch."""
    plan = SparseFwdLaunch(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, config, indexer_topk, split)
    outs = plan(q, kv, topk_idxs, attn_sink, topk_length)
    if keep_plan is not None:
        keep_plan(plan)
    return outs


def _check_indexer_topk(indexer_topk: int, k_width: int) -> None:
    """indexer_topk for the fused kernel: 0, or a positive multiple of 128 that is at most the top-k width."""
    if not 0 <= indexer_topk <= k_width:
        raise ValueError(f"sparse_attention: indexer_topk={indexer_topk} must be in [0, K={k_width}]")
    if indexer_topk % 128:
        raise NotImplementedError(f"sparse_attention: indexer_topk={indexer_topk}; the fused kernel takes a multiple "
                                  f"of 128 (it keeps its softmax state after each pair of 64-slot tiles; use "
                                  f"impl='reference')")


@torch.library.custom_op("dsagen::sparse_attention_fwd", mutates_args=())
def _sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor,
                          attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
                          softmax_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_supported(q, d_v)      # the op is also reachable as torch.ops.dsagen.sparse_attention_fwd
    return _launch(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v)


@_sparse_attention_fwd.register_fake
def _sparse_attention_fwd_fake(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v):
    s_q, h = q.shape[0], q.shape[1]
    return (q.new_empty((s_q, h, d_v)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))


@torch.library.custom_op("dsagen::sparse_attention_fwd_prefix", mutates_args=())
def _sparse_attention_fwd_prefix(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor,
                                 attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
                                 softmax_scale: float, d_v: int, indexer_topk: int
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward with lse_indexer (indexer_topk > 0): (out, lse, max_logits, lse_indexer)."""
    _check_supported(q, d_v)
    _check_indexer_topk(indexer_topk, topk_idxs.shape[1])
    return _launch(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, None, indexer_topk)


@_sparse_attention_fwd_prefix.register_fake
def _sparse_attention_fwd_prefix_fake(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, indexer_topk):
    s_q, h = q.shape[0], q.shape[1]
    stats = [q.new_empty((s_q, h), dtype=torch.float32) for _ in range(3)]
    return (q.new_empty((s_q, h, d_v)), *stats)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                     attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                     softmax_scale: float, d_v: int, config: SparseAttnFwdConfig | None = None,
                     indexer_topk: int = 0, keep_plan: Callable[[Callable], None] | None = None,
                     split: tuple[int, int] | None = None) -> tuple:
    """Flat-layout fused forward (inputs already validated by dsagen.ops.sparse_attention).

    q `(S_q, H, D_qk)` bf16/fp16 CUDA, kv `(S_kv, D_qk)`, topk_idxs int32 `(S_q, K)` global ids,
    attn_sink `(H,)` FP32/FP64 or None, topk_length int32 `(S_q,)` or None.
    config: None (the op's, config_for) or another SparseAttnFwdConfig (eager calls only: benchmarks and tests).
    indexer_topk: 0, or N > 0 (a multiple of 128, at most K): also return lse_indexer `(S_q, H)` FP32, the KV-only
    LSE over each row's first N slots (+inf where none is valid), from the lse_prefix kernel (cuDNN frontend DSA
    §1's indexer prefix).
    Returns out `(S_q, H, d_v)` in q.dtype, lse and max_logits `(S_q, H)` FP32 (and lse_indexer with N > 0).
    Raises NotImplementedError (with the reason) for inputs the kernel does not cover, ValueError for N outside
    [0, K]. keep_plan: called after an eager call of the op's config with its SparseFwdLaunch (the public op's fast
    path). split: (n_splits, split_slots) of an eager call (sparse_attention_decode's split over the KV slots:
    SparseFwdLaunch, max_logits None); under torch.compile the custom op runs whole rows.
    """
    _check_supported(q, d_v)
    keep_plan = keep_plan if config is None else None
    indexer_topk = int(indexer_topk)
    _check_indexer_topk(indexer_topk, topk_idxs.shape[1])
    if indexer_topk > 0:
        if torch.compiler.is_compiling():
            if config is not None:
                raise NotImplementedError("sparse_attention: config= is for eager calls (the custom op runs the op's)")
            return _sparse_attention_fwd_prefix(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale),
                                                int(d_v), indexer_topk)
        return _launch(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v), config, indexer_topk,
                       keep_plan, split)
    if torch.compiler.is_compiling():     # torch.compile sees the custom op as one opaque node
        if config is not None:
            raise NotImplementedError("sparse_attention: config= is for eager calls (the custom op runs the op's)")
        return _sparse_attention_fwd(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v))
    # eager: the custom op's dispatch would only add host time (~25 us per call) around the same launch
    return _launch(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v), config,
                   keep_plan=keep_plan, split=split)
