"""Fused dsagen.indexer_forward_topk (cuDNN frontend DSA §4, Combined Indexer Forward + Top-K) on Hopper: the
lightning indexer's slab pipeline with the dense indexer's mask, never materializing the dense scores.

Called by dsagen.ops.indexer.indexer_forward_topk after the generic validation; this module adds the fused kernels'
limits and runs them.

How a call runs (notes/kernels/indexer.md, "indexer_forward_topk"):
  * Query rows are grouped into the score kernel's token blocks (QC = 128 // H tokens of one batch element) and the
    blocks into slabs of at most ForwardTopkConfig.slab_bytes (128 MiB) / slab_max_rows (4096) rows. Per slab, on the
    current stream: the score kernel (dense_scores form: ratio-causal limit with the per-segment q_causal_offsets,
    scale 1) writes each row's valid scores into the slab (ld = the longest row, rounded up to 4), then the forward
    top-k kernel the config's TopkPlan picks for the slab writes the row's selected ids (row-local, ascending, ties
    at the k-th value to the lower ids) and their scores (the logits) into the outputs, and (its softmax form, the
    default) finishes the row: its LSE and softmax over the selected slots and, with topk_indices_global, the row's
    key base added to its ids (BSHD b * S_k, THD cu_seqlens_k[b]).
  * A config with a finishing kernel (ForwardTopkConfig.softmax, topk_softmax_sm90) does the finish after the last
    slab instead, reading the outputs back.
  * Scratch: the slab only, bounded by the config and independent of S_q and B (reported by `scratch_bytes`), plus
    a 16-byte dummy offsets tensor per device.
  * BSHD calls read nothing on the host: under torch.compile the call is a custom op with a fake impl (eager calls
    skip its dispatch layers, `host.eager`); it is capturable in a CUDA graph once its kernels are loaded. THD calls need max_seqlen_k, which the public op reads
    from cu_seqlens on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...jit import get_kernel
from ...runtime import LoadedKernel, device_index, device_sm_count
from .host import _check_layout, loaded_kernels, score_ctas, slab_max_candidates, slab_rows
from .scores_host import (_TORCH_DTYPE_NAMES, ScoreCallInputs, check_supported as check_scores_supported, eager,
                          input_views)
from .spec import ForwardTopkConfig, IndexerTopkSpec, forward_topk_config_for, tokens_per_cta

_OP = "indexer_forward_topk"
#: Largest top_k the fused path takes (the lightning indexer's limit).
MAX_TOPK = 2 ** 20


@dataclass
class ForwardKernels:
    """The loaded kernels of one (device, ForwardTopkConfig). Every kernel of the top-k plan is loaded at the first
    call, so a warmed-up call can be captured in a CUDA graph at any length."""

    config: ForwardTopkConfig
    score: LoadedKernel
    topk: dict[IndexerTopkSpec, LoadedKernel]
    softmax: LoadedKernel | None                 # None: the top-k kernels finish their rows

    def topk_for(self, max_candidates: int, rows: int, num_sms: int) -> LoadedKernel:
        """The top-k kernel of a slab (TopkPlan.pick)."""
        return self.topk[self.config.topk.pick(max_candidates, rows, num_sms)]


#: (device, H, D, dtype) for forward_topk_config_for's config, (device, config) for a given one -> the kernels
_kernels: dict[tuple, ForwardKernels] = {}


def check_supported(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top_k: int, packed: bool) -> None:
    """The fused kernels' limits (ValueError naming the argument and the limit): indexer_scores' (dtypes, H, D,
    lengths) and top_k <= 2**20. Shape and dtype checks only, so they also run on fake tensors."""
    check_scores_supported(q, k, weights, packed)
    if top_k > MAX_TOPK:
        raise ValueError(f"the fused {_OP} supports top_k <= 2**20 = {MAX_TOPK}, got {top_k}")


def _kernels_for(device: torch.device, h: int, d: int, dtype: torch.dtype,
                 config: ForwardTopkConfig | None = None) -> ForwardKernels:
    """The loaded kernels of (device, H, D, dtype) and config (None: forward_topk_config_for's); NotImplementedError
    off sm_90a, ValueError for a config of another H, D or dtype."""
    return loaded_kernels(_kernels, _OP, device, h, d, dtype, _TORCH_DTYPE_NAMES[dtype], config,
                          forward_topk_config_for, lambda cfg, index: ForwardKernels(
                              cfg, get_kernel(cfg.score, index),
                              {spec: get_kernel(spec, index) for spec in cfg.topk.specs()},
                              None if cfg.softmax is None else get_kernel(cfg.softmax, index)))


def slab_shape(num_heads: int, width: int, total_rows: int, config: ForwardTopkConfig) -> tuple[int, int]:
    """(rows, ld) of the fp32 score slab for H heads, rows of at most `width` candidates and `total_rows` query rows
    rounded up to whole token blocks: ld = width rounded up to 4 (16-byte rows for the top-k's loads); rows a
    multiple of the token block, at most config.slab_max_rows and within config.slab_bytes unless one token block
    alone is larger (the lightning indexer's slab_rows), and no more than the call has."""
    qc = tokens_per_cta(num_heads)
    return min(slab_rows(num_heads, width, config), -(-total_rows // qc) * qc), -(-max(width, 1) // 4) * 4


def scratch_bytes(num_heads: int, width: int, total_rows: int, config: ForwardTopkConfig | None = None,
                  head_dim: int = 128, dtype: str = "bfloat16") -> int:
    """Bytes of scratch a call allocates (the slab): for H heads, rows of at most `width` candidates (BSHD S_k, THD
    max_seqlen_k) and `total_rows` query rows (B * S_q, THD total_q)."""
    if config is None:
        config = forward_topk_config_for(num_heads, head_dim, dtype, "sm_90a")
    rows, ld = slab_shape(num_heads, width, total_rows, config)
    return 4 * rows * ld


class ForwardTopkLaunch(ScoreCallInputs):
    """The launches of one call signature: everything of `run` that follows from the shapes, strides, dtypes and
    flags (kernels, slab shape, per-slab top-k kernel and grid, scalar arguments), computed once; calling it with
    tensors of that signature allocates the slab and launches the kernels on their pointers. Built by `run` for
    every call and kept by dsagen.indexer_forward_topk's fast path per signature (dsagen.ops._fast_path). Arguments
    as `run`'s."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top_k: int, ratio: int,
                 q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, width: int,
                 softmax: torch.Tensor | None, lse: torch.Tensor | None, global_ids: bool,
                 q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 config: ForwardTopkConfig | None = None, paged_len: int | None = None):
        packed = cu_seqlens_q is not None
        q4, k3, w3, qs3, ks2 = input_views(q, k, weights, q_scale, k_scale, packed)
        b, t_count, h, d = q4.shape
        # paged (the decode-time indexer, config's score kernel paged): k is the cache's pages [n_pages, 64, D] and
        # each batch element's keys are paged_len rows through the block table given to launch()
        s_count = k3.shape[1] if paged_len is None else paged_len
        self.n_pages = k3.shape[0]
        rows = b * t_count
        self.no_slot = rows == 0 or top_k == 0              # only the LSE (-inf) to write
        self.no_key = width == 0 or s_count == 0            # every row empty
        if self.no_slot or self.no_key:
            return
        _check_layout("q_indexer", q4, _OP)
        _check_layout("k_indexer", k3, _OP)
        device = q.device
        self.device = device
        self.kernels = kernels = _kernels_for(device, h, d, q.dtype, config)
        config = kernels.config
        self._plan_inputs(q, q4, k3, w3, qs3, ks2, packed)
        n_docs = cu_seqlens_q.numel() - 1 if packed else 0
        has_off = int(q_causal_offsets is not None)
        num_sms = device_sm_count(device_index(device))
        qc = tokens_per_cta(h)
        n_tblk = -(-t_count // qc)
        total_blk = b * n_tblk
        self.slab_shape = slab_r, ld = slab_shape(h, width, rows, config)
        blk_per_slab = slab_r // qc
        n_chunks = -(-s_count // config.chunk_rows)
        self.has_off = has_off
        self.scalars = (n_docs, t_count, s_count, n_tblk)      # the score and top-k kernels' shared scalars
        self.score_mid = (config.chunk_rows, n_chunks)
        self.score_tail = (1, ratio, *w3.stride(), ld, 1.0)
        self.slabs = []
        for blk0 in range(0, total_blk, blk_per_slab):
            nblk = min(blk_per_slab, total_blk - blk0)
            # the slab's longest row: the ratio-causal bound of its last token (offsets can move it anywhere in
            # [0, S])
            longest = min(width, slab_max_candidates(blk0, nblk, qc, n_tblk, t_count, s_count, not has_off, ratio,
                                                     packed))
            self.slabs.append((blk0, nblk, score_ctas(nblk * n_chunks, num_sms),
                               kernels.topk_for(longest, nblk * qc, num_sms)))
        self.qc = qc
        self.topk_tail = (top_k, ratio, has_off, ld)
        self.finish_flags = (int(softmax is not None), int(lse is not None), int(global_ids))
        self.softmax_scalars = (n_docs, t_count, s_count, rows, top_k, ratio, has_off, *self.finish_flags,
                                num_sms * config.softmax_ctas_per_sm)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_causal_offsets: torch.Tensor | None,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, ids: torch.Tensor,
                 logits: torch.Tensor, softmax: torch.Tensor | None, lse: torch.Tensor | None,
                 q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None) -> None:
        self.launch(q, k, weights, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, (ids, logits, softmax, lse),
                    q_scale, k_scale)

    def launch(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_causal_offsets: torch.Tensor | None,
               cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
               outputs: tuple | Callable[[], tuple], q_scale: torch.Tensor | None = None,
               k_scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> tuple:
        """The call's launches into outputs = (ids, logits, softmax or None, lse or None), or a callable making them,
        called after the first score launch (so the allocations' host time overlaps that kernel). Returns them.
        block_table: int32 [B, max_pages] with unit column stride, for a plan made with paged_len."""
        if self.no_slot or self.no_key:
            ids, logits, softmax, lse = outputs = outputs() if callable(outputs) else outputs
            if self.no_slot:
                if lse is not None:
                    lse.fill_(float("-inf"))            # no slot: every row is empty
                return outputs
            ids.fill_(-1)                               # no key: every row is empty
            logits.fill_(float("-inf"))
            if softmax is not None:
                softmax.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return outputs
        qv, kv, w3, extra, cu_q, cu_k, q_off = self._call_inputs(q, k, weights, q_causal_offsets, cu_seqlens_q,
                                                                cu_seqlens_k, q_scale, k_scale)
        kernels, has_off = self.kernels, self.has_off
        slab = torch.empty(self.slab_shape, dtype=torch.float32, device=self.device)
        score_head = (cu_q, cu_k, *self.scalars)
        paged = () if block_table is None else (block_table, block_table.stride(0), self.n_pages)
        for blk0, nblk, n_ctas, topk_k in self.slabs:
            kernels.score.launch(qv, kv, w3, slab, *score_head, blk0, nblk, *self.score_mid, n_ctas, *self.score_tail,
                                 q_off, has_off, 0, *extra, *paged)  # fill 0: the top-k reads only the valid columns
            if callable(outputs):
                outputs = outputs()
            ids, logits, softmax, lse = outputs
            soft_arg, lse_arg = logits if softmax is None else softmax, logits if lse is None else lse
            # the top-k kernel's finishing form also takes the finish's outputs and flags
            finish = (soft_arg, lse_arg, *self.finish_flags) if kernels.softmax is None else ()
            topk_k.launch(slab, ids, logits, cu_q, cu_k, q_off, *self.scalars, blk0, self.qc, nblk * self.qc,
                          *self.topk_tail, *finish)
        if kernels.softmax is not None:
            kernels.softmax.launch(logits, ids, soft_arg, lse_arg, cu_q, cu_k, q_off, *self.softmax_scalars)
        return outputs


def run(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top_k: int, ratio: int,
        q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
        width: int, ids: torch.Tensor, logits: torch.Tensor, softmax: torch.Tensor | None, lse: torch.Tensor | None,
        global_ids: bool, q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
        config: ForwardTopkConfig | None = None) -> ForwardTopkLaunch:
    """Write the selection of every query row into ids (int32) and logits (fp32), and when given softmax (fp32) and
    lse (fp32): contiguous [rows, top_k] / [rows] views (BSHD rows = B * S_q, THD total_q). q / k / weights as
    indexer_forward_topk takes them (k may have its 1-sized head dim); THD when cu_seqlens_q is given (int32,
    contiguous), width = the longest segment's key count (BSHD: S_k). FP8 q / k take fp32 descales q_scale (q's
    leading dims and H) and k_scale (k's key dims). Returns the call's ForwardTopkLaunch (the plan a later call of
    the same signature can reuse)."""
    plan = ForwardTopkLaunch(q, k, weights, top_k, ratio, q_causal_offsets, cu_seqlens_q, width, softmax, lse,
                             global_ids, q_scale, k_scale, config)
    plan(q, k, weights, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, ids, logits, softmax, lse, q_scale, k_scale)
    return plan


@torch.library.custom_op("dsagen::indexer_forward_topk_fused", mutates_args=("ids", "logits", "softmax", "lse"))
def _forward_topk_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top_k: int, ratio: int,
                     q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                     cu_seqlens_k: torch.Tensor | None, width: int, ids: torch.Tensor, logits: torch.Tensor,
                     softmax: torch.Tensor | None, lse: torch.Tensor | None, global_ids: bool,
                     q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None) -> None:
    run(q, k, weights, top_k, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, width, ids, logits, softmax, lse,
        global_ids, q_scale, k_scale)


@_forward_topk_op.register_fake
def _(q, k, weights, top_k, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, width, ids, logits, softmax, lse,
      global_ids, q_scale=None, k_scale=None):
    return None


def indexer_forward_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top_k: int, *, ratio: int,
                         q_causal_offsets: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                         cu_seqlens_k: torch.Tensor | None, width: int, return_softmax: bool, return_lse: bool,
                         topk_indices_global: bool, q_scale: torch.Tensor | None = None,
                         k_scale: torch.Tensor | None = None, config: ForwardTopkConfig | None = None,
                         keep_plan: Callable[[Callable], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The fused indexer_forward_topk (inputs validated by dsagen.ops.indexer.indexer_forward_topk). Returns (indices
    int32, logits fp32, softmax fp32 or None, lse fp32 or None) of shapes [B, S_q, top_k] / [B, S_q] (THD:
    [total_q, top_k] / [total_q]). Slot order: ascending key ids (ties at the k-th value go to the lower ids), then
    -1 / -inf / 0 padding. width: S_k (BSHD) or max_seqlen_k (THD). config: None (the op, through the custom op) or
    another ForwardTopkConfig for the same H, D, dtype (benchmarks; runs the host loop directly). keep_plan: called
    after an eager BSHD call of the op's config with a plan that repeats the call for tensors of the same signature
    (`ForwardTopkCall`, the public op's fast path).

    Raises ValueError outside the kernels' limits (check_supported; q / k readable by TMA: stride 1 in the last dim,
    16-byte-aligned base and outer strides), NotImplementedError on a GPU other than sm_90a."""
    packed = cu_seqlens_q is not None
    check_supported(q, k, weights, top_k, packed)
    outputs = ForwardTopkCall.new_outputs(q, top_k, packed, return_softmax, return_lse)
    args = (q, k, weights, int(top_k), int(ratio), q_causal_offsets, cu_seqlens_q, cu_seqlens_k, int(width),
            *outputs, bool(topk_indices_global), q_scale, k_scale)
    if config is not None or eager(q):
        launch = run(*args, config=config)
        if keep_plan is not None and config is None and not packed:
            keep_plan(ForwardTopkCall(launch, top_k, return_softmax, return_lse))
    else:
        _forward_topk_op(*args)
    return outputs


class ForwardTopkCall:
    """indexer_forward_topk's eager BSHD call by plan: runs the ForwardTopkLaunch, allocating the four outputs after
    its first launch, and returns (indices, logits, softmax or None, lse or None). For tensors of the signature it
    was made from only (the public op's fast path)."""

    def __init__(self, launch: ForwardTopkLaunch, top_k: int, return_softmax: bool, return_lse: bool):
        self.plan, self.top_k, self.return_softmax, self.return_lse = launch, top_k, return_softmax, return_lse

    @staticmethod
    def new_outputs(q: torch.Tensor, top_k: int, packed: bool, return_softmax: bool, return_lse: bool) -> tuple:
        """(ids int32, logits fp32, softmax fp32 or None, lse fp32 or None) of a call on q: [B, S_q, top_k] /
        [B, S_q] (THD [total_q, top_k] / [total_q])."""
        lead = (q.shape[0],) if packed else tuple(q.shape[:2])
        dev = q.device
        ids = torch.empty(lead + (top_k,), dtype=torch.int32, device=dev)
        logits = torch.empty(lead + (top_k,), dtype=torch.float32, device=dev)
        softmax = torch.empty(lead + (top_k,), dtype=torch.float32, device=dev) if return_softmax else None
        lse = torch.empty(lead, dtype=torch.float32, device=dev) if return_lse else None
        return ids, logits, softmax, lse

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_causal_offsets: torch.Tensor | None,
                 q_scale: torch.Tensor | None, k_scale: torch.Tensor | None) -> tuple:
        if q_causal_offsets is not None:
            q_causal_offsets = q_causal_offsets.contiguous()
        return self.plan.launch(q, k, weights, q_causal_offsets, None, None, lambda: self.new_outputs(
            q, self.top_k, False, self.return_softmax, self.return_lse), q_scale, k_scale)
