"""Fused (generated-kernel) sparse MLA attention forward, flat layout (cuDNN frontend DSA §1 Sparse Attention Forward; the batched DeepSeek-V4 inference kernel
layout is flattened by dsagen.ops.sparse_attention before it gets here).

`sparse_attention(q, kv, topk_idxs, *, attn_sink, topk_length, softmax_scale, d_v)` returns
`(out, lse, max_logits)` and runs the sm_90a kernel of `SparseAttnFwdSpec` (template
sm90/sparse_attention_fwd.py.j2). It is the `torch.library` custom op `dsagen::sparse_attention_fwd`, with
a fake implementation, so torch.compile sees one opaque node; the kernel launch itself never allocates
beyond the outputs, never synchronizes and is CUDA-graph capturable once the kernel is loaded.

What the kernel supports natively and what this module adapts:
  * heads: 64 and 128 natively; 1..63 are zero-padded to 64 and 65..127 to 128 (outputs sliced back);
  * top-k width: any K >= 0 (the kernel masks slots past K and past topk_length; nothing is padded);
  * D_qk 512 or 576 with d_v 512; dtypes bfloat16 and float16;
  * q needs a unit stride on heads x D_qk (one token = H * D_qk contiguous elements) and kv rows with a
    unit column stride, 16-byte aligned rows; other layouts are copied to contiguous first.

Run-time knobs (module attributes, read at every call; a CUDA graph keeps the launch it captured): SCHEDULE
(the kernel schedule, default per shape), L2_HINT (split_halves' L2 cache hints), OPTIONS (split_halves' other
options, default SCHEDULE_OPTIONS) and GRID (split_halves' grid: one CTA per (query row, 64 heads) item, or one per
SM looping over the items; default per kernel heads). Eager calls launch the kernel directly; under torch.compile
the launch is the custom op's body. The spec, kernel and grid size of a call shape are looked up once per knob
values (_launch_plan).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime import LoadedKernel, device_arch, device_index, device_sm_count, get_kernel
from ..spec.families.sparse_attention import (ABLATIONS, HALVES_OPTIONS, SCHEDULE_ABLATIONS, SCHEDULES,
                                              SparseAttnFwdSpec, default_schedule, op_spec_fields)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_GRID_X = 2**31 - 1

# Run-time choice of the kernel schedule (SparseAttnFwdSpec.schedule) for every shape: None (the default) runs
# each kernel shape's measured-fastest schedule (spec family default_schedule: "split_halves", FlashMLA's even/odd
# split of the tiles between the two consumer warpgroups with its half-stage barriers and asymmetric max exchange,
# for every shape); "serial" or "serial_lean" (one consumer scores every tile) force another one.
# Tests and benches set it (`dsagen.fused.sparse_attention.SCHEDULE = "serial"`).
SCHEDULE: str | None = None
# Run-time choice of SparseAttnFwdSpec.l2_hint (FlashMLA's L2::256B prefetch + evict_last policy on the KV
# gather) for schedule "split_halves"; ignored by the other schedules.
L2_HINT: bool = False
# Run-time override of the boolean options of schedule "split_halves" (spec family HALVES_OPTIONS; the op's own
# choice is SCHEDULE_OPTIONS, e.g. vec_store on): {"vec_store": False} turns one off, {"stream_hint": True} one on.
# Ignored by the other schedules.
OPTIONS: dict[str, bool] = {}
# Run-time choice of the grid of schedule "split_halves", whose CTAs loop over the items (query row, 64 heads):
# None (the default) takes the kernel shape's DEFAULT_GRID; "items" launches one CTA per item, "persistent" one
# per SM (the producer then loads the next item's Q and first rows while the consumers finish the current one), an
# int n at most n CTAs (tests use small counts to give every CTA several items). The other schedules always launch
# one CTA per item.
GRID: str | int | None = None
# The grid per kernel heads, GPU-measured in the same runs (H200): persistent is 1.02-1.05x at H128 (D 576 and
# 512, S_q 4096 and 32768; measured 2026-11-29). At H64 it was 0.91x (D576) and 0.99-1.01x (D512) with 4-byte O stores
# (measured 2026-11-29); with vec_store's 16-byte stores persistent is 1.02-1.03x there too (H64 / D512 S_q 4096 and 32768,
# H64 / D576; measured 2026-11-29, same run, notes/kernels/sparse_attention.md).
DEFAULT_GRID = {128: "persistent", 64: "persistent"}


def kernel_heads(num_heads: int) -> int:
    """The heads of the kernel that serves `num_heads` query heads: 64 (fewer are padded to it) or 128."""
    return 64 if num_heads <= 64 else 128


def resolved_schedule(num_heads: int, d_qk: int, schedule: str | None = None, rows: int | None = None) -> str:
    """The schedule a call with `num_heads` query heads (padded to 64 or 128), `d_qk` and `rows` query rows runs:
    `schedule`, else the module's SCHEDULE, else the shape's default (spec family default_schedule)."""
    schedule = SCHEDULE if schedule is None else schedule
    return default_schedule(kernel_heads(num_heads), d_qk, rows) if schedule is None else schedule


def spec_for(num_heads: int, d_qk: int, dtype: torch.dtype, arch: str = "sm_90a",
             schedule: str | None = None, ablate: str = "", rows: int | None = None) -> SparseAttnFwdSpec:
    """The kernel spec that serves `num_heads` query heads (after padding to 64 or 128) under `schedule`
    (default: resolved_schedule; "split_halves" takes the module's L2_HINT). `ablate` (timing only, see
    `ablated_forward`) selects a variant that leaves one stage out (one of SCHEDULE_ABLATIONS[schedule]). `rows`:
    the call's query rows (total_S_q), which the default schedule depends on."""
    schedule = resolved_schedule(num_heads, d_qk, schedule, rows)
    if schedule not in SCHEDULES:
        raise ValueError(f"sparse_attention: schedule {schedule!r} is not one of {SCHEDULES}")
    if ablate and ablate not in ABLATIONS:
        raise ValueError(f"sparse_attention: ablate {ablate!r} is not one of {tuple(ABLATIONS)}")
    if ablate and ablate not in SCHEDULE_ABLATIONS[schedule]:
        raise ValueError(f"sparse_attention: schedule {schedule!r} has the ablations "
                         f"{SCHEDULE_ABLATIONS[schedule]}, not {ablate!r}")
    extra = op_spec_fields(schedule) if schedule != "serial" else {}
    if schedule == "split_halves":
        unknown = set(OPTIONS) - set(HALVES_OPTIONS)
        if unknown:
            raise ValueError(f"sparse_attention: OPTIONS has {sorted(unknown)}, not options of split_halves "
                             f"{HALVES_OPTIONS}")
        extra.update({name: bool(on) for name, on in OPTIONS.items()})
        if L2_HINT:
            extra["l2_hint"] = True
    if ablate:
        extra["ablate"] = ablate
    return SparseAttnFwdSpec(arch=arch, num_heads=kernel_heads(num_heads), d_qk=d_qk, d_v=512,
                             dtype=_DTYPES[dtype], **extra)


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


# (heads, d_qk, dtype, device, schedule, ablate, rows, SCHEDULE, L2_HINT, OPTIONS, GRID) -> (spec, kernel, n_ctas):
# the per-call host work of a repeated call shape is one dict lookup (the spec, its kernel and the grid size are
# pure functions of the key; the run-time knobs are part of it, so changing one takes effect at the next call).
# A rows-dependent default schedule (DEFAULT_SCHEDULES) is resolved before the lookup.
_launch_plans: dict[tuple, tuple[SparseAttnFwdSpec, LoadedKernel | None, int]] = {}


def _launch_plan(h: int, d_qk: int, dtype: torch.dtype, device: torch.device, schedule: str | None, ablate: str,
                 rows: int, want_kernel: bool) -> tuple[SparseAttnFwdSpec, LoadedKernel | None, int]:
    """The spec, loaded kernel (None unless want_kernel) and n_ctas argument of a call (cached per call shape
    and knob values)."""
    sched = resolved_schedule(h, d_qk, schedule, rows)
    key = (h, d_qk, dtype, device, sched, ablate, SCHEDULE, L2_HINT, tuple(sorted(OPTIONS.items())), GRID,
           want_kernel)
    plan = _launch_plans.get(key)
    if plan is None:
        spec = spec_for(h, d_qk, dtype, device_arch(device), schedule=sched, ablate=ablate, rows=rows)
        kernel = get_kernel(spec, device_index(device)) if want_kernel else None
        ctas = _grid_ctas(device, spec.num_heads) if spec.schedule == "split_halves" else _MAX_GRID_X
        plan = _launch_plans[key] = (spec, kernel, ctas)
    return plan


def _grid_ctas(device: torch.device, kernel_heads: int) -> int:
    """The n_ctas kernel argument (the most CTAs a split_halves launch uses) under GRID (None: DEFAULT_GRID of
    the kernel's heads)."""
    grid = DEFAULT_GRID[kernel_heads] if GRID is None else GRID
    if grid == "items":
        return _MAX_GRID_X                   # no cap: one CTA per item
    if grid == "persistent":
        return device_sm_count(device_index(device))
    if isinstance(grid, int) and not isinstance(grid, bool) and grid >= 1:
        return grid
    raise ValueError(f"sparse_attention: GRID={GRID!r} must be 'items', 'persistent' or a positive int")


def _launch(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, attn_sink: torch.Tensor | None,
            topk_length: torch.Tensor | None, softmax_scale: float, d_v: int, *, schedule: str | None = None,
            ablate: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel on flat-layout inputs that supported_reason accepted (its callers check)."""
    s_q, h, d_qk = q.shape
    n_kv, k_width = kv.shape[0], topk_idxs.shape[1]
    spec, kernel, n_ctas = _launch_plan(h, d_qk, q.dtype, q.device, schedule, ablate, s_q, s_q > 0)
    hp = spec.num_heads
    if s_q * (hp // 64) > _MAX_GRID_X:
        raise ValueError(f"sparse_attention: total_S_q={s_q} exceeds the fused kernel's grid limit")
    if n_kv > 2**31 - 1:
        raise ValueError(f"sparse_attention: kv has {n_kv} rows; ids are int32, at most 2**31 - 1 rows")

    # layouts the kernel reads: q token rows of H*D_qk contiguous elements, kv rows with unit column
    # stride and 16-byte alignment, ids with a unit slot stride (each stride tuple read once: a tensor
    # attribute read costs ~0.3-0.5 us of host time)
    q_st, kv_st, ids_st = q.stride(), kv.stride(), topk_idxs.stride()
    if hp != h:
        qp = q.new_zeros((s_q, hp, d_qk))
        qp[:, :h] = q
        q = qp
        q_st = q.stride()
    elif q_st[2] != 1 or q_st[1] != d_qk or q_st[0] % 8 or q.data_ptr() % 16:
        q = q.clone(memory_format=torch.contiguous_format)      # a fresh, aligned copy (contiguous() would
        q_st = q.stride()                                       # return a misaligned contiguous q as is)
    if kv_st[1] != 1 or kv_st[0] % 8 or kv.data_ptr() % 16:
        kv = kv.clone(memory_format=torch.contiguous_format)
        kv_st = kv.stride()
    if ids_st[1] != 1 and k_width > 1:
        topk_idxs = topk_idxs.contiguous()
        ids_st = topk_idxs.stride()
    sink = None
    if attn_sink is not None:
        sink = attn_sink if attn_sink.dtype == torch.float32 else attn_sink.to(torch.float32)
        if hp != h:
            sink = torch.cat([sink, sink.new_zeros(hp - h)])
        if not sink.is_contiguous():
            sink = sink.contiguous()
    length = None if topk_length is None else topk_length.to(torch.int32).contiguous()

    out = torch.empty((s_q, hp, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((s_q, hp), dtype=torch.float32, device=q.device)
    max_logits = torch.empty((s_q, hp), dtype=torch.float32, device=q.device)
    if s_q > 0:
        # absent optional inputs: pass a tensor of the right dtype that the kernel never reads
        kernel.launch(q, kv, topk_idxs, topk_idxs if length is None else length,
                      lse if sink is None else sink, out, lse, max_logits,
                      s_q, n_kv, k_width, q_st[0], kv_st[0] if n_kv else d_qk,
                      ids_st[0] if k_width else 0, float(softmax_scale),
                      int(length is not None), int(sink is not None), n_ctas)
    if hp != h:
        out, lse, max_logits = out[:, :h].contiguous(), lse[:, :h].contiguous(), max_logits[:, :h].contiguous()
    return out, lse, max_logits


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


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                     attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                     softmax_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat-layout fused forward (inputs already validated by dsagen.ops.sparse_attention).

    q `(S_q, H, D_qk)` bf16/fp16 CUDA, kv `(S_kv, D_qk)`, topk_idxs int32 `(S_q, K)` global ids,
    attn_sink `(H,)` FP32/FP64 or None, topk_length int32 `(S_q,)` or None.
    Returns out `(S_q, H, d_v)` in q.dtype, lse and max_logits `(S_q, H)` FP32.
    Raises NotImplementedError (with the reason) for inputs the kernel does not cover.
    """
    _check_supported(q, d_v)
    if torch.compiler.is_compiling():     # torch.compile sees the custom op as one opaque node
        return _sparse_attention_fwd(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v))
    # eager: the custom op's dispatch would only add host time (~25 us per call) around the same launch
    return _launch(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v))


def ablated_forward(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *, ablate: str,
                    attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                    softmax_scale: float | None = None, d_v: int = 512, schedule: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TIMING ONLY: launch the ablated kernel `SparseAttnFwdSpec(ablate=ablate)` (one of ABLATIONS: a stage of
    the kernel left out) on flat-layout inputs, exactly as the fused op would launch the real kernel.
    The outputs are NOT attention (they may be zeros, garbage or non-finite); bench/sparse_attention.py
    --ablate times these next to the real kernel to place where the time goes. Not a custom op, never
    reached from dsagen.sparse_attention."""
    if not ablate:
        raise ValueError("ablated_forward: name an ablation (one of %s)" % (tuple(ABLATIONS),))
    _check_supported(q, d_v)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return _launch(q, kv, topk_idxs, attn_sink, topk_length, float(softmax_scale), int(d_v),
                   schedule=schedule, ablate=ablate)
