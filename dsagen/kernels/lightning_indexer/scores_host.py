"""Fused dsagen.indexer_scores (cuDNN frontend DSA §3) on Hopper: the lightning indexer's wgmma score kernel in its
dense_scores form writes every row's valid columns straight into the output, then one finishing kernel writes -inf
to the masked columns and, when asked, each row's logsumexp.

Called by dsagen.ops.indexer.indexer_scores after the generic validation (shapes, dtypes, offsets, out / lse_out);
this module adds the fused kernels' limits and runs them.

How a call runs (notes/kernels/indexer.md, "indexer_scores"):
  * The output is [rows, width] fp32 (BSHD: rows = B * S_q, width = S_k; THD: rows = total_q, width =
    max_seqlen_k). Row (b, t) of the score kernel's token blocks (QC = 128 // H tokens of one batch element) is
    output row b * S_q + t; a launch covers `launch_rows` query rows and gets the output from its first row on as
    its slab (ld = width). When QC does not divide S_q, blocks straddle no batch boundary, so launches are split
    per batch element to keep the row mapping linear.
  * The kernel writes out[r, s - lo_r] = sum_h w * relu(q . k) (scale 1) for lo_r <= s < hi_r, the row's bounds
    with the ratio-causal limit (q_causal_offsets[seg] + t + 1) // ratio clamped to the segment's keys
    (row_bounds), and its filler warp writes -inf to columns hi_r - lo_r .. width - 1 (ScoresConfig.score_fills).
    With the LSE, the finishing kernel (mask_lse_sm90) then writes lse[r] over columns 0 .. hi_r - lo_r - 1 (-inf
    for none); without it, the score launches are the whole op.
  * Bytes: every output entry is written once, by the score kernel; the LSE reads the valid ones back: output
    traffic 4 * rows * width written plus 4 * (valid entries) read with the LSE. No workspace: besides the caller's (or the op's) out / lse buffers only
    a 16-byte dummy offsets tensor per device (made at the first call).
  * Everything a launch needs is a Python int from shapes: no host reads of device values in BSHD, so the op runs
    under torch.compile (a custom op that mutates out / lse, with a fake impl) and inside CUDA-graph capture once
    its kernels are loaded. THD calls read cu_seqlens on the host in the public op (validation, max_seqlen_k).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_index, device_sm_count
from .host import _check_layout, _tma_strides, _with_strides, dummy_offsets, eager, loaded_kernels, score_ctas
from .spec import (INDEXER_FP8_HEADS, INDEXER_HEAD_DIMS, INDEXER_HEADS, INDEXER_MAX_T, ScoresConfig, item_tokens,
                   scores_config_for)

_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8_e4m3fn"}
#: The FP8 form's weights: bf16 (read through w) or fp32 (read through w32); the kernel picks at run time.
_FP8_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
_OP = "indexer_scores"

#: (device, H, D, dtype) -> (config, score kernel, finishing kernel)
_kernels: dict[tuple, tuple[ScoresConfig, LoadedKernel, LoadedKernel]] = {}


def check_supported(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, packed: bool) -> None:
    """The fused kernels' limits (ValueError naming the argument and the limit). Shape and dtype checks only, so
    they also run on fake tensors under torch.compile. q [B, S_q, H, D] (THD [total_q, H, D]), k with its keys in
    dim 1 (THD dim 0)."""
    if q.dtype not in _TORCH_DTYPE_NAMES:
        raise ValueError(f"the fused indexer_scores needs q_indexer in bfloat16 or float16, got {q.dtype} "
                         f"(use impl='reference')")
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 and weights.dtype not in _FP8_WEIGHT_DTYPES:
        raise ValueError(f"the fused FP8 indexer_scores needs weights in bfloat16 or float32, got {weights.dtype}")
    if fp8 and q.shape[-1] != 128:
        raise ValueError(f"the fused FP8 indexer_scores supports q_indexer head dim D = 128 only, got D={q.shape[-1]}")
    if fp8 and q.shape[-2] not in INDEXER_FP8_HEADS:
        raise ValueError(f"the fused FP8 indexer_scores supports q_indexer heads H in {INDEXER_FP8_HEADS}, "
                         f"got H={q.shape[-2]}")
    if not fp8 and weights.dtype != q.dtype:
        raise ValueError(f"the fused indexer_scores needs weights in q_indexer's dtype ({q.dtype}), got "
                         f"{weights.dtype}; cast them or use impl='reference'")
    h, d = q.shape[-2], q.shape[-1]
    if h not in INDEXER_HEADS:
        raise ValueError(f"the fused indexer_scores supports q_indexer heads H in {INDEXER_HEADS}, got H={h}")
    if d not in INDEXER_HEAD_DIMS:
        raise ValueError(f"the fused indexer_scores supports q_indexer head dim D in {INDEXER_HEAD_DIMS}, got D={d}")
    sq = q.shape[0] if packed else q.shape[1]
    sk = k.shape[0] if packed else k.shape[1]
    what = ("total_q", "total_k") if packed else ("S_q", "S_k")
    if sq > INDEXER_MAX_T:
        raise ValueError(f"the fused indexer_scores supports q_indexer with {what[0]} <= 2**20 = {INDEXER_MAX_T} "
                         f"rows, got {sq}")
    if sk > INDEXER_MAX_T:
        raise ValueError(f"the fused indexer_scores supports k_indexer with {what[1]} <= 2**20 = {INDEXER_MAX_T} "
                         f"rows, got {sk}")


def _kernels_for(device: torch.device, h: int, d: int, dtype: torch.dtype, config: ScoresConfig | None = None
                 ) -> tuple[ScoresConfig, LoadedKernel, LoadedKernel]:
    """The config and loaded kernels of (device, H, D, dtype) and config (None: scores_config_for's);
    NotImplementedError off sm_90a, ValueError for a config of another H, D or dtype."""
    return loaded_kernels(_kernels, _OP, device, h, d, dtype, _TORCH_DTYPE_NAMES[dtype], config, scores_config_for,
                          lambda cfg, index: (cfg, get_kernel(cfg.score, index), get_kernel(cfg.mask, index)))


def launch_ranges(batch: int, seqlen_q: int, qc: int, blocks_per_launch: int) -> list[tuple[int, int, int]]:
    """(blk0, nblk, row0) of every score launch: token blocks [blk0, blk0 + nblk) whose rows start at output row
    row0. Block blk holds tokens (blk % n_tblk) * qc .. + qc - 1 of batch element blk // n_tblk (n_tblk =
    ceil(seqlen_q / qc)). When qc divides seqlen_q, block blk's first row is blk * qc and launches run across batch
    elements; otherwise a launch stays inside one batch element (row0 = b * seqlen_q + first token)."""
    n_tblk = -(-seqlen_q // qc)
    if seqlen_q % qc == 0:
        spans = [(0, batch * n_tblk)]
    else:
        spans = [(b * n_tblk, (b + 1) * n_tblk) for b in range(batch)]
    out = []
    for start, end in spans:
        for blk0 in range(start, end, blocks_per_launch):
            b = blk0 // n_tblk
            out.append((blk0, min(blocks_per_launch, end - blk0), b * seqlen_q + (blk0 - b * n_tblk) * qc))
    return out


def fp8_flags(w3: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor) -> tuple:
    """What of the FP8 kernel's trailing arguments is not a pointer: (w is fp32, q_scale's strides, k_scale's)."""
    return int(w3.dtype == torch.float32), q_scale.stride(), k_scale.stride()


def fp8_args(w3: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor, flags: tuple | None = None) -> tuple:
    """The FP8 kernel's trailing arguments (score_sm90.fp8_params) for weights w3 [B, T, H] (bf16 or fp32),
    q_scale [B, T, H] and k_scale [B, S] (fp32, any strides): the weights go through both pointers, the kernel
    reads the one of their dtype. flags: fp8_flags of tensors of the same signature (computed when None)."""
    w_f32, qs_strides, ks_strides = fp8_flags(w3, q_scale, k_scale) if flags is None else flags
    return (w3, w_f32, q_scale, *qs_strides, k_scale, *ks_strides)


def input_views(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_scale: torch.Tensor | None,
                k_scale: torch.Tensor | None, packed: bool) -> tuple[torch.Tensor, ...]:
    """The score kernel's views of an op's inputs: (q [B, T, H, D], k [B, S, D], weights [B, T, H], q_scale
    [B, T, H] or None, k_scale [B, S] or None). THD inputs (packed) become B = 1 views, k loses its 1-sized head
    dim, and FP8 q / k (float8_e4m3fn) become uint8 views (TMA moves the E4M3 bytes)."""
    if packed:
        q4, k3, w3 = q[None], (k.squeeze(1) if k.dim() == 3 else k)[None], weights[None]
        qs3, ks2 = (q_scale[None], k_scale[None]) if q_scale is not None else (None, None)
    else:
        q4, k3, w3 = q, (k.squeeze(2) if k.dim() == 4 else k), weights
        qs3, ks2 = q_scale, k_scale
    if q.dtype == torch.float8_e4m3fn:
        q4, k3 = q4.view(torch.uint8), k3.view(torch.uint8)
    return q4, k3, w3, qs3, ks2


class ScoreCallInputs:
    """The score kernel's tensor arguments, shared by the launch plans of indexer_scores and indexer_forward_topk:
    `_plan_inputs` keeps what follows from a call's signature (layout, FP8 flags, the strides TMA needs, the dummy
    offsets tensor), `_call_inputs` makes one call's arguments from its tensors."""

    def _plan_inputs(self, q: torch.Tensor, q4: torch.Tensor, k3: torch.Tensor, w3: torch.Tensor,
                     qs3: torch.Tensor | None, ks2: torch.Tensor | None, packed: bool) -> None:
        self.packed, self.fp8 = packed, q.dtype == torch.float8_e4m3fn
        self.q_strides, self.k_strides = _tma_strides(q4), _tma_strides(k3)
        self.fp8_flags = fp8_flags(w3, qs3, ks2) if self.fp8 else None
        self.dummy = dummy_offsets(q.device)

    def _call_inputs(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                     q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                     cu_seqlens_k: torch.Tensor | None, q_scale: torch.Tensor | None,
                     k_scale: torch.Tensor | None) -> tuple:
        """(q view, k view, weights view, the FP8 form's trailing arguments or (), cu_q, cu_k, q_off) of one call:
        the dummy offsets stand in for the offsets a call does not have."""
        q4, k3, w3, qs, ks = input_views(q, k, weights, q_scale, k_scale, self.packed)
        extra = fp8_args(w3, qs, ks, self.fp8_flags) if self.fp8 else ()
        cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if self.packed else (self.dummy, self.dummy)
        q_off = self.dummy if q_causal_offsets is None else q_causal_offsets
        return (_with_strides(q4, self.q_strides), _with_strides(k3, self.k_strides), w3, extra, cu_q, cu_k,
                q_off)


class ScoresLaunch(ScoreCallInputs):
    """The score (and finishing) launches of one call signature: everything of `run` that follows from the shapes,
    strides, dtypes and flags (kernels, launch ranges, grid sizes, scalar arguments), computed once; calling it with
    tensors of that signature launches the kernels on their pointers. Built by `run` for every call, and kept by
    dsagen.indexer_scores' fast path per signature (dsagen.ops._fast_path). Arguments as `run`'s."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int,
                 q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, out: torch.Tensor,
                 lse: torch.Tensor | None, q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 scale: float = 1.0, config: ScoresConfig | None = None):
        packed = cu_seqlens_q is not None
        q4, k3, w3, qs3, ks2 = input_views(q, k, weights, q_scale, k_scale, packed)
        b, t_count, h, d = q4.shape
        s_count = k3.shape[1]
        self.width = width = out.shape[-1]
        self.want_lse = lse is not None
        self.empty = b * t_count == 0                     # no row: nothing to write
        self.no_column = width == 0 or s_count == 0       # every row empty: -inf everywhere
        if self.empty or self.no_column:
            return
        _check_layout("q_indexer", q4, _OP)
        _check_layout("k_indexer", k3, _OP)
        device = q.device
        self.config, self.score_k, self.mask_k = config, score_k, _ = _kernels_for(device, h, d, q.dtype, config)
        self._plan_inputs(q, q4, k3, w3, qs3, ks2, packed)
        self.n_docs = cu_seqlens_q.numel() - 1 if packed else 0
        self.has_off = int(q_causal_offsets is not None)
        num_sms = device_sm_count(device_index(device))
        qc = item_tokens(config.score)
        n_chunks = -(-s_count // config.chunk_rows)
        self.w_strides = w3.stride()
        self.launches = [(row0 * width, blk0, nblk, score_ctas(nblk * n_chunks, num_sms))
                         for blk0, nblk, row0 in launch_ranges(b, t_count, qc, max(1, config.launch_rows // qc))]
        self.score_scalars = (t_count, s_count, -(-t_count // qc), config.chunk_rows, n_chunks)
        self.score_tail = (1, ratio)
        self.scale = scale
        self.mask_scalars = (t_count, s_count, b * t_count, width, ratio)
        self.run_mask = self.want_lse or not config.score_fills
        self.mask_ctas = num_sms * config.mask_ctas_per_sm

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_causal_offsets: torch.Tensor | None,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, out: torch.Tensor,
                 lse: torch.Tensor | None, q_scale: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None) -> None:
        if self.empty:
            return
        if self.no_column:
            out.fill_(float("-inf"))
            if self.want_lse:
                lse.fill_(float("-inf"))
            return
        qv, kv, w3, extra, cu_q, cu_k, q_off = self._call_inputs(q, k, weights, q_causal_offsets, cu_seqlens_q,
                                                                cu_seqlens_k, q_scale, k_scale)
        width, n_docs, has_off, config = self.width, self.n_docs, self.has_off, self.config
        t_count, s_count, n_tblk, chunk_rows, n_chunks = self.score_scalars
        for off, blk0, nblk, n_ctas in self.launches:
            # the slab is a pointer param: `out` itself for the first rows (no view to make), a view further on
            self.score_k.launch(qv, kv, w3, out.view(-1)[off:] if off else out, cu_q, cu_k, n_docs, t_count, s_count,
                                n_tblk, blk0, nblk, chunk_rows, n_chunks, n_ctas, *self.score_tail, *self.w_strides,
                                width, self.scale, q_off, has_off, int(config.score_fills), *extra)
        if self.run_mask:
            want_lse = self.want_lse
            t_count, s_count, rows, width, ratio = self.mask_scalars
            self.mask_k.launch(out, lse if want_lse else out, cu_q, cu_k, q_off, n_docs, t_count, s_count, rows,
                               width, ratio, has_off, int(want_lse), int(not config.score_fills), self.mask_ctas,
                               width)


def run(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int, q_causal_offsets: torch.Tensor | None,
        cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, out: torch.Tensor,
        lse: torch.Tensor | None, q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
        scale: float = 1.0, config: ScoresConfig | None = None) -> ScoresLaunch:
    """Write the scores (times `scale`, folded into the weights) into `out` (contiguous fp32 [rows, width]
    view-compatible) and, when `lse` is not None, the row logsumexps into it (contiguous fp32 [rows]). q / k /
    weights as indexer_scores takes them (k may have its 1-sized head dim); THD when cu_seqlens_q is given (int32,
    contiguous). FP8 q / k (float8_e4m3fn) take fp32 descales q_scale (q's leading dims and H) and k_scale (k's key
    dims: BSHD [B, S_k], THD [total_k]). config: None (scores_config_for's) or another ScoresConfig of the same H, D
    and dtype (benchmarks). Returns the call's ScoresLaunch (the plan a later call of the same signature can reuse)."""
    plan = ScoresLaunch(q, k, weights, ratio, q_causal_offsets, cu_seqlens_q, out, lse, q_scale, k_scale, scale,
                        config)
    plan(q, k, weights, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, out, lse, q_scale, k_scale)
    return plan


@torch.library.custom_op("dsagen::indexer_scores_fused", mutates_args=("out", "lse"))
def _indexer_scores_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int,
                       q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                       cu_seqlens_k: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
                       q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                       scale: float = 1.0) -> None:
    run(q, k, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, out, lse, q_scale, k_scale, scale)


@_indexer_scores_op.register_fake
def _(q, k, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, out, lse, q_scale=None, k_scale=None,
      scale=1.0):
    return None


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, ratio: int,
                   q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                   cu_seqlens_k: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None,
                   return_lse: bool, shapes: tuple[tuple[int, ...], tuple[int, ...]],
                   q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None, scale: float = 1.0,
                   keep_plan: Callable[[Callable], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused indexer_scores (inputs, out and lse already validated by dsagen.ops.indexer.indexer_scores).
    Returns (scores, lse or None): `out` / `lse` when given (contiguous fp32 of shapes[0] / shapes[1]: BSHD
    [B, S_q, S_k] / [B, S_q], THD [total_q, max_seqlen_k] / [total_q]), else new tensors of those shapes, allocated
    after the limits are checked. THD offsets and q_causal_offsets must be contiguous int32 (the op converts them).

    Raises ValueError for inputs outside the kernels' limits (check_supported: bf16 / fp16 q and k, weights of q's
    dtype, H in INDEXER_HEADS, D in INDEXER_HEAD_DIMS, S_q and S_k (THD: total_q, total_k) <= 2**20) or a layout TMA
    cannot read (q / k: stride 1 in the last dim, 16-byte-aligned base, 16-byte-multiple outer strides; weights may
    have any strides); NotImplementedError on a GPU other than sm_90a. FP8 (float8_e4m3fn q and k, validated by
    the op): D = 128, weights bf16 or fp32, q_scale / k_scale fp32 descales of any strides. scale (> 0): a factor
    of every score (dense_indexer_score_recompute's sm_scale), folded into the weights the kernel stages.

    keep_plan: called after an eager BSHD call with a plan that repeats this call for tensors of the same signature
    (`ScoresCall`: the public op's fast path keeps it per dsagen.ops._fast_path.call_signature)."""
    check_supported(q, k, weights, cu_seqlens_q is not None)
    out_given, lse_given = out is not None, lse is not None
    if out is None:
        out = torch.empty(shapes[0], dtype=torch.float32, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty(shapes[1], dtype=torch.float32, device=q.device)
    lse = lse if return_lse else None
    args = (q, k, weights, int(ratio), q_causal_offsets, cu_seqlens_q, cu_seqlens_k, out, lse, q_scale, k_scale,
            float(scale))
    if eager(q):
        launch = run(*args)
        if keep_plan is not None and cu_seqlens_q is None:
            keep_plan(ScoresCall(launch, shapes, q.device, out_given, return_lse and not lse_given, return_lse))
    else:
        _indexer_scores_op(*args)
    return out, lse


class ScoresCall:
    """indexer_scores' eager BSHD call by plan: allocates the outputs the caller did not pass (shapes as the call
    it was made from), runs the ScoresLaunch, returns (scores, lse or None). For tensors of the signature it was
    made from only (the public op's fast path)."""

    def __init__(self, launch: ScoresLaunch, shapes: tuple[tuple[int, ...], tuple[int, ...]], device: torch.device,
                 out_given: bool, new_lse: bool, return_lse: bool):
        self.launch, self.shapes, self.device = launch, shapes, device
        self.out_given, self.new_lse, self.return_lse = out_given, new_lse, return_lse

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_causal_offsets: torch.Tensor | None,
                 out: torch.Tensor | None, lse: torch.Tensor | None, q_scale: torch.Tensor | None,
                 k_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.out_given:
            out = torch.empty(self.shapes[0], dtype=torch.float32, device=self.device)
        if self.new_lse:
            lse = torch.empty(self.shapes[1], dtype=torch.float32, device=self.device)
        elif not self.return_lse:
            lse = None
        if q_causal_offsets is not None:
            q_causal_offsets = q_causal_offsets.contiguous()
        self.launch(q, k, weights, q_causal_offsets, None, None, out, lse, q_scale, k_scale)
        return out, lse


def dense_indexer_score_recompute(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, ratio: int,
                                  q_causal_offsets: torch.Tensor | None, sm_scale: float,
                                  cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                                  shapes: tuple[tuple[int, ...], tuple[int, ...]]
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused dsagen.dense_indexer_score_recompute (cuDNN frontend DSA §8, inputs validated by the public op):
    indexer_scores' kernels with the scores scaled by sm_scale (folded into the weights) and the LSE as the denom.
    Returns (out, denom) of shapes[0] / shapes[1] (as indexer_scores); the limits are indexer_scores'."""
    return indexer_scores(q, k, weights, ratio=ratio, q_causal_offsets=q_causal_offsets, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, out=None, lse=None, return_lse=True, shapes=shapes,
                          scale=sm_scale)
