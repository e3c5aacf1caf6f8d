"""Fused (generated-kernel) standalone indexer top-k (cuDNN frontend DSA §5), called by dsagen.ops.indexer.indexer_topk
with validated inputs (and, for next_n > 1, the staggered per-row lengths).

`indexer_topk(input_values, seq_lens, top_k, *, return_values)`: row r of the (n_rows, n_cols) scores selects among
its first clamp(seq_lens[r // (n_rows // G)], 0, n_cols) columns. FP32 rows are read in place when they are 16-byte
aligned with a column count that is a multiple of 4 (the kernel reads whole 16-byte vectors and masks the keys past
the row's length); otherwise, and for FP16 / BF16 (exact in FP32, so order and ties are unchanged), the scores are
copied into a zero-padded FP32 matrix of round_up(n_cols, 4) columns. The kernel the plan picks (by columns and
whether the rows fit one wave) writes each row's ids in ascending order, -1 padded, and with return_values each one's
score beside it (-inf where the id is -1; cast back to FP16 / BF16 inputs' dtype, exactly). Nothing synchronizes
with the host; it is the custom op `dsagen::indexer_topk_fused`.
"""

from __future__ import annotations

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_arch, device_index, device_sm_count
from ..lightning_indexer.topk_limits import TopkPlan
from .spec import IndexerTopkRowsSpec, config_for

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ROWS = 2**31 - 1


def supported_reason(input_values: torch.Tensor) -> str:
    """Why the fused kernel cannot run these inputs ("" when it can)."""
    if input_values.dtype not in _DTYPES:
        return (f"input_values has dtype {input_values.dtype}; the fused kernel takes float32, float16 or bfloat16 "
                f"(use impl='reference')")
    return ""


class _Plan:
    """The loaded kernels of one device's plan (every kernel loaded at the first call, so a later call with other
    sizes can be captured in a CUDA graph)."""

    def __init__(self, plan: TopkPlan, device: torch.device):
        self.plan = plan
        self.num_sms = device_sm_count(device_index(device))
        self.kernels: dict[IndexerTopkRowsSpec, LoadedKernel] = {
            spec: get_kernel(spec, device_index(device)) for spec in plan.specs()}

    def kernel(self, n_cols: int, rows: int) -> LoadedKernel:
        return self.kernels[self.plan.pick(n_cols, rows, self.num_sms)]


_plans: dict = {}


def _device_plan(device: torch.device, plan: TopkPlan | None) -> _Plan:
    key = (device, plan)
    p = _plans.get(key)
    if p is None:
        p = _plans[key] = _Plan(config_for(device_arch(device)) if plan is None else plan, device)
    return p


def fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as FP32 rows the kernel may read whole 16-byte vectors of: `x` itself when it is FP32, 16-byte aligned,
    unit-stride with a row stride and column count that are multiples of 4; else a zero-padded FP32 copy of
    round_up(n_cols, 4) columns."""
    n_rows, n_cols = x.shape
    if (x.dtype == torch.float32 and x.stride(1) == 1 and x.stride(0) % 4 == 0 and n_cols % 4 == 0
            and x.data_ptr() % 16 == 0):
        return x
    padded = torch.zeros((n_rows, (n_cols + 3) // 4 * 4), dtype=torch.float32, device=x.device)
    padded[:, :n_cols] = x
    return padded


def run(input_values: torch.Tensor, seq_lens: torch.Tensor, top_k: int, return_values: bool,
        plan: TopkPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launch on validated inputs (see indexer_topk); `plan`: None (the op's) or another TopkPlan."""
    reason = supported_reason(input_values)
    if reason:
        raise NotImplementedError(f"indexer_topk: {reason}")
    n_rows, n_cols = input_values.shape
    dev = input_values.device
    if n_rows > _MAX_ROWS:
        raise ValueError(f"indexer_topk: {n_rows} rows exceed the kernel's grid limit ({_MAX_ROWS})")
    indices = torch.empty((n_rows, top_k), dtype=torch.int32, device=dev)
    values = torch.empty((n_rows, top_k), dtype=torch.float32, device=dev) if return_values else None
    if n_rows == 0 or top_k == 0 or n_cols == 0:
        indices.fill_(-1)
        if values is not None:
            values.fill_(float("-inf"))
    else:
        x = fp32_rows(input_values)
        lens = seq_lens.contiguous()
        kernel = _device_plan(dev, plan).kernel(n_cols, n_rows)
        kernel.launch(x, indices, indices if values is None else values, lens, n_rows, n_cols,
                      n_rows // lens.numel(), top_k, x.stride(0), int(values is not None))
    if values is not None and input_values.dtype != torch.float32:
        values = values.to(input_values.dtype)            # exact: the scores came from this dtype
    return indices, values


@torch.library.custom_op("dsagen::indexer_topk_fused", mutates_args=())
def _fused_op(input_values: torch.Tensor, seq_lens: torch.Tensor, top_k: int,
              return_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused top-k as a custom op (opaque to torch.compile; CUDA-graph capturable once its kernels are loaded);
    the values are an empty tensor without return_values."""
    indices, values = run(input_values, seq_lens, top_k, return_values)
    return indices, values if values is not None else input_values.new_empty((0,))


@_fused_op.register_fake
def _(input_values, seq_lens, top_k, return_values):
    n_rows = input_values.shape[0]
    return (input_values.new_empty((n_rows, top_k), dtype=torch.int32),
            input_values.new_empty((n_rows, top_k) if return_values else (0,)))


def indexer_topk(input_values: torch.Tensor, seq_lens: torch.Tensor, top_k: int, *, return_values: bool = True,
                 plan: TopkPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused top-k on inputs that dsagen.ops.indexer validated: input_values `(n_rows, n_cols)` FP32 / FP16 / BF16
    CUDA, seq_lens int32 `(G,)` with G dividing n_rows (one length per n_rows // G consecutive rows), top_k >= 0.
    plan: None (the op's, through the custom op) or another TopkPlan (a direct launch, for benchmarks).
    Returns (indices int32 `(n_rows, top_k)` ascending per row and -1 padded, values in the input dtype or None).
    Raises NotImplementedError (with the reason) for inputs the kernel does not cover."""
    reason = supported_reason(input_values)
    if reason:
        raise NotImplementedError(f"indexer_topk: {reason}")
    if plan is not None:
        return run(input_values, seq_lens, top_k, return_values, plan)
    indices, values = _fused_op(input_values, seq_lens, int(top_k), bool(return_values))
    return indices, values if return_values else None
