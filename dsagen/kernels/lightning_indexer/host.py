"""Fused lightning_indexer (attention-gym) on Hopper: generated wgmma score kernel + radix top-k kernel.

Called by dsagen.ops.lightning_indexer after the generic validation; this module adds what the kernels
need (backend name, device, dtype, the declared H / D / T ranges, TMA layout) and runs them.

How a call runs (see notes/kernels/indexer.md):
  * Query rows are grouped into token blocks of QC = 128 // H consecutive tokens of one batch element
    (the score kernel's wgmma N tile is QC x H = 128 columns). Blocks are processed in slabs: for each
    slab the score kernel writes every row's valid candidate scores (fp32, document-local ids) into one
    reused slab of R rows x ld_slab columns, then the top-k kernel turns each row into its output row. The
    top-k kernel is chosen per slab from the longest row the slab can hold (slab_max_candidates; the config's
    TopkPlan: 128 threads per row up to 12288 candidates, 512 with a sampled threshold and the candidates in
    shared memory up to 65536, 1024 beyond; 1024 threads when the slab's rows fit one wave of one CTA per SM).
    The top-k reads rows with 16-byte loads: ld_slab a multiple of 4 keeps every row 16-byte aligned.
    The persistent score kernel runs min(#SMs, #work items) CTAs per slab, each looping over (token block,
    chunk) work items.
  * Every measured choice (kernels, top-k plan, work-item size, slab caps) is one frozen IndexerConfig,
    picked by dsagen.kernels.lightning_indexer.spec.config_for; a benchmark passes another one as `config=`.
  * Scratch: the slab only, R * ld_slab * 4 bytes with ld_slab = S rounded up to 4 and
    R = min(1024, 128 MiB / (4 * ld_slab)) rounded down to a multiple of QC, at least QC. So at most
    128 MiB (IndexerConfig.slab_bytes; 128 MiB at S >= 32768, S x 4 KiB below), bounded and independent of T and B.
    Causal / document bounds are computed inside the kernels (binary search over cu_seqlens), so no
    per-row buffer exists either.
  * Everything a launch needs is a Python int from shapes; no host reads of device values, so the op
    works under torch.compile (a custom op with a fake impl) and inside CUDA-graph capture once warm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...runtime import LoadedKernel, device_arch, device_index, device_sm_count

from ...jit import get_kernel
from .spec import (FP8_MAX_CHUNK_ROWS, INDEXER_HEAD_DIMS, INDEXER_HEADS, INDEXER_MAX_T, ForwardTopkConfig,
                   IndexerConfig, IndexerTopkSpec, config_for, tokens_per_cta)

BACKENDS = ("cute",)
_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class IndexerKernels:
    """The loaded kernels of one (device, IndexerConfig): the config, the score kernel and the top-k plan's
    kernels by spec. Every kernel of the plan is loaded at the first call, whatever that call's slab lengths, so
    a warmed-up call can be captured in a CUDA graph at any length."""

    config: IndexerConfig
    score: LoadedKernel
    topk: dict[IndexerTopkSpec, LoadedKernel]

    def topk_for(self, max_candidates: int, rows: int, num_sms: int) -> LoadedKernel:
        """The top-k kernel of a slab (TopkPlan.pick)."""
        return self.topk[self.config.topk.pick(max_candidates, rows, num_sms)]


#: (device, H, D, dtype) for config_for's config, (device, config) for a given one -> the loaded kernels
_kernels: dict[tuple, IndexerKernels] = {}
_dummy: dict[int, torch.Tensor] = {}


def check_backend(kernel_options) -> str:
    """kernel_options must be None or {"backend": "cute"}; anything else raises ValueError."""
    if kernel_options is None:
        return "cute"
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    extra = set(kernel_options) - {"backend"}
    if extra:
        raise ValueError(f"kernel_options has unknown keys {sorted(extra)}; the only option is 'backend'")
    backend = kernel_options.get("backend", "cute")
    if backend not in BACKENDS:
        raise ValueError(f"kernel_options backend={backend!r} is not available; dsagen's fused "
                         f"lightning_indexer has backends {BACKENDS} (use impl='reference' for plain PyTorch)")
    return backend


def check_supported(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int) -> None:
    """The fused kernels' shape limits (ValueError/TypeError stating the limits). Shape-only checks, so
    they also run on fake tensors under torch.compile."""
    _b, t_count, h, d = q.shape
    s_count = k.shape[1]
    if q.dtype not in _TORCH_DTYPE_NAMES:
        raise TypeError(f"the fused lightning_indexer needs bfloat16 or float16 inputs, got q {q.dtype}")
    if k.dtype != q.dtype or weights.dtype != q.dtype:
        raise TypeError(f"the fused lightning_indexer needs one dtype for q, k and weights, got "
                        f"{q.dtype}, {k.dtype}, {weights.dtype}")
    if h not in INDEXER_HEADS:
        raise ValueError(f"the fused lightning_indexer supports H (heads) in {INDEXER_HEADS}, got H={h}")
    if d not in INDEXER_HEAD_DIMS:
        raise ValueError(f"the fused lightning_indexer supports D (head dim) in {INDEXER_HEAD_DIMS}, got D={d}")
    if t_count > INDEXER_MAX_T:
        raise ValueError(f"the fused lightning_indexer supports T <= 2**20 = {INDEXER_MAX_T} query rows, "
                         f"got T={t_count}")
    if s_count > INDEXER_MAX_T:
        raise ValueError(f"the fused lightning_indexer supports S <= 2**20 = {INDEXER_MAX_T} candidates, "
                         f"got S={s_count}")
    if topk > INDEXER_MAX_T:
        raise ValueError(f"the fused lightning_indexer supports topk <= 2**20 = {INDEXER_MAX_T}, got {topk}")


def _check_layout(name: str, t: torch.Tensor, op: str = "lightning_indexer") -> None:
    """TMA needs unit inner stride, a 16-byte-aligned base and 16-byte-multiple outer strides (`op` names the fused
    op in the message)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension for the fused {op}, "
                         f"got strides {t.stride()}")
    es = t.element_size()
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte-aligned address for the fused {op} "
                         f"(TMA), got {t.data_ptr():#x}")
    for i in range(t.dim() - 1):
        if t.shape[i] > 1 and (t.stride(i) * es) % 16:
            raise ValueError(f"{name} must have 16-byte-multiple strides in its outer dimensions for the fused "
                             f"{op} (TMA), got strides {t.stride()} ({es}-byte elements)")


def _tma_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s strides with every size-1 dimension given a 16-byte-multiple stride (TMA checks strides even of
    singleton dimensions; their value never matters), or None when they are t's own."""
    stride = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            stride[i] = stride[i + 1] * max(1, t.shape[i + 1])
            stride[i] = -(-stride[i] // 8) * 8 if t.element_size() == 2 else stride[i]
    return None if stride == list(t.stride()) else tuple(stride)


def _with_strides(t: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """`t` with the strides `_tma_strides` computed for its signature (itself when None)."""
    return t if strides is None else t.as_strided(t.shape, strides)


def loaded_kernels(cache: dict, op: str, device: torch.device, h: int, d: int, dtype: torch.dtype, dtype_name: str,
                   config, config_for: Callable, load: Callable):
    """The memoized kernels of one of the family's ops for (device, H, D, dtype) and `config` (None: the op's
    `config_for(h, d, dtype_name, arch)`): `load(config, device index)` on the first call, kept in `cache` under
    (index, H, D, dtype) or (index, config). NotImplementedError off sm_90a (naming `op`); ValueError for a config
    whose score kernel is of another arch, H, D or dtype, or an FP8 config with work items of more than
    FP8_MAX_CHUNK_ROWS candidates."""
    index = device_index(device)
    key = (index, h, d, dtype) if config is None else (index, config)
    ks = cache.get(key)
    if ks is None:
        arch = device_arch(index)
        if arch != "sm_90a":
            raise NotImplementedError(f"the fused {op} has kernels for sm_90a (Hopper) only; cuda:{index} is {arch}. "
                                      f"Use impl='reference'.")
        if config is None:
            config = config_for(h, d, dtype_name, arch)
        score = config.score
        if (score.arch, score.num_heads, score.head_dim, score.dtype) != (arch, h, d, dtype_name):
            raise ValueError(f"config's score kernel {score.name()} does not match the call (arch {arch}, H={h}, "
                             f"D={d}, {dtype_name})")
        if dtype_name == "float8_e4m3fn" and config.chunk_rows > FP8_MAX_CHUNK_ROWS:
            raise ValueError(f"config's chunk_rows={config.chunk_rows}: the FP8 score kernel stages the k descales "
                             f"of at most {FP8_MAX_CHUNK_ROWS} candidate rows per work item")
        ks = cache[key] = load(config, index)
    return ks


def _kernels_for(device: torch.device, h: int, d: int, dtype: torch.dtype,
                 config: IndexerConfig | None = None) -> IndexerKernels:
    return loaded_kernels(_kernels, "lightning_indexer", device, h, d, dtype, _TORCH_DTYPE_NAMES[dtype], config,
                          config_for, lambda cfg, index: IndexerKernels(
                              cfg, get_kernel(cfg.score, index),
                              {spec: get_kernel(spec, index) for spec in cfg.topk.specs()}))


def dummy_offsets(device: torch.device) -> torch.Tensor:
    """A 16-byte int32 tensor of zeros per device, passed for pointer params a launch never reads (offsets of an
    unpacked call). Made at the first call on the device, outside any CUDA-graph capture."""
    index = device_index(device)
    t = _dummy.get(index)
    if t is None:
        t = _dummy[index] = torch.zeros(4, dtype=torch.int32, device=device)
    return t


def slab_max_candidates(blk0: int, nblk: int, qc: int, n_tblk: int, t_count: int, s_count: int, causal: bool,
                        compress_ratio: int, packed: bool) -> int:
    """The most candidates any row of the slab of token blocks [blk0, blk0 + nblk) can have: S, or for causal
    unpacked input the ratio-causal limit (t + 1) // ratio of the slab's last token (T - 1 when the slab crosses
    into the next batch element). Only picks the top-k kernel: every kernel is correct for any row length."""
    if packed or not causal:
        return s_count
    last = blk0 + nblk - 1
    if blk0 // n_tblk != last // n_tblk:
        t_last = t_count - 1
    else:
        t_last = min(t_count, (last % n_tblk + 1) * qc) - 1
    return min(s_count, (t_last + 1) // compress_ratio)


def score_ctas(n_items: int, num_sms: int) -> int:
    """Grid size of a persistent score launch over n_items (token block, chunk) work items: at most one CTA per
    SM, each looping over items."""
    return max(1, min(n_items, num_sms))


def slab_rows(num_heads: int, s_count: int, config: IndexerConfig | ForwardTopkConfig) -> int:
    """Rows R of the score slab for H heads and S candidates (a multiple of the token block): at most
    config.slab_max_rows, and R rows fit in config.slab_bytes unless one token block alone is larger."""
    qc = tokens_per_cta(num_heads)
    ld = -(-max(s_count, 1) // 4) * 4
    rows = min(config.slab_max_rows, config.slab_bytes // (4 * ld)) // qc * qc
    return max(qc, rows)


class IndexerLaunch:
    """The launches of one lightning_indexer call signature: everything of `_run` that follows from the shapes,
    strides, dtypes and flags (kernels, slab shape, per-slab top-k kernel and grid, scalars), computed once; calling
    it with tensors of that signature allocates the slab and the output (after the first score launch, so that host
    time overlaps the kernel) and launches. Built by `_run` for every call and kept by dsagen.lightning_indexer's fast
    path per signature (dsagen.ops._fast_path)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, causal: bool,
                 compress_ratio: int, cu_seqlens: torch.Tensor | None, config: IndexerConfig | None = None):
        b, t_count, h, d = q.shape
        s_count = k.shape[1]
        self.device = device = q.device
        self.out_shape = (b, t_count, topk)
        self.no_slot = topk == 0 or b == 0 or t_count == 0
        self.no_key = s_count == 0
        if self.no_slot or self.no_key:
            return
        _check_layout("q", q)
        _check_layout("k", k)
        index = device_index(device)
        self.kernels = kernels = _kernels_for(device, h, d, q.dtype, config)
        config = kernels.config
        chunk_rows = config.chunk_rows
        qc = tokens_per_cta(h)
        n_tblk = -(-t_count // qc)
        total_blk = b * n_tblk
        ld = -(-s_count // 4) * 4
        blk_per_slab = min(slab_rows(h, s_count, config) // qc, total_blk)
        self.slab_shape = (blk_per_slab * qc, ld)
        n_chunks = -(-s_count // chunk_rows)
        self.packed = cu_seqlens is not None
        self.dummy = None if self.packed else dummy_offsets(device)
        n_docs = cu_seqlens.numel() - 1 if self.packed else 0
        self.q_strides, self.k_strides = _tma_strides(q), _tma_strides(k)
        causal_i = int(bool(causal))
        num_sms = device_sm_count(index)      # persistent grid, wide top-k choice
        self.scalars = (n_docs, t_count, s_count, n_tblk)
        self.score_tail = (causal_i, compress_ratio, *weights.stride(), ld, 1.0 / math.sqrt(h * d))
        self.qc, self.topk_tail = qc, (topk, causal_i, compress_ratio, ld)
        self.slabs = []
        for blk0 in range(0, total_blk, blk_per_slab):
            nblk = min(blk_per_slab, total_blk - blk0)
            topk_k = kernels.topk_for(slab_max_candidates(blk0, nblk, qc, n_tblk, t_count, s_count, causal,
                                                          compress_ratio, self.packed), nblk * qc, num_sms)
            self.slabs.append((blk0, nblk, chunk_rows, n_chunks, score_ctas(nblk * n_chunks, num_sms), topk_k))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor | None,
                 cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
        if self.no_slot or self.no_key:
            out = torch.empty(self.out_shape, dtype=torch.int32, device=self.device)
            return out if self.no_slot else out.fill_(-1)
        slab = torch.empty(self.slab_shape, dtype=torch.float32, device=self.device)
        cu_q, cu_k = (cu_seqlens, cu_seqlens_k) if self.packed else (self.dummy, self.dummy)
        qv, kv = _with_strides(q, self.q_strides), _with_strides(k, self.k_strides)
        score_head = (cu_q, cu_k, *self.scalars)
        out = None
        for blk0, nblk, chunk_rows, n_chunks, n_ctas, topk_k in self.slabs:
            self.kernels.score.launch(qv, kv, weights, slab, *score_head, blk0, nblk, chunk_rows, n_chunks, n_ctas,
                                      *self.score_tail)
            if out is None:
                out = torch.empty(self.out_shape, dtype=torch.int32, device=self.device)
            topk_k.launch(slab, out, *score_head, blk0, self.qc, nblk * self.qc, *self.topk_tail)
        return out


def _run(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, causal: bool, compress_ratio: int,
         cu_seqlens: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, config: IndexerConfig | None = None,
         keep_plan: Callable[[Callable], None] | None = None) -> torch.Tensor:
    """The fused call's launches (IndexerLaunch); keep_plan, when given, gets the plan."""
    plan = IndexerLaunch(q, k, weights, topk, causal, compress_ratio, cu_seqlens, config)
    out = plan(q, k, weights, cu_seqlens, cu_seqlens_k)
    if keep_plan is not None:
        keep_plan(plan)
    return out


def eager(t: torch.Tensor) -> bool:
    """Whether a call on `t` may run the host loop directly instead of through its torch.library custom op: a real
    tensor outside torch.compile / export tracing. The custom op's eager dispatch layers (autograd, ADInplaceOrView and
    the backend wrapper's checks of the mutated outputs) cost ~0.1 ms of host time per call on the H200's host
    (2026-12-03: indexer_forward_topk at T 4096 0.590 ms through the op, 0.467 ms calling the host loop), time an
    isolated call's GPU waits for; the results are the same tensors either way. Used by lightning_indexer,
    indexer_scores, indexer_forward_topk and the dense warm-up hosts (dense attention recompute, indexer backward)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not torch.compiler.is_compiling() and not isinstance(t, FakeTensor) and t.device.type == "cuda"


@torch.library.custom_op("dsagen::lightning_indexer_fused", mutates_args=())
def _lightning_indexer_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, causal: bool,
                          compress_ratio: int, cu_seqlens: torch.Tensor | None,
                          cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    return _run(q, k, weights, topk, causal, compress_ratio, cu_seqlens, cu_seqlens_k)


@_lightning_indexer_op.register_fake
def _(q, k, weights, topk, causal, compress_ratio, cu_seqlens, cu_seqlens_k):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)


def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, causal: bool,
                      compress_ratio: int, cu_seqlens: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                      kernel_options: dict | None, config: IndexerConfig | None = None,
                      keep_plan: Callable[[Callable], None] | None = None) -> torch.Tensor:
    """The fused lightning_indexer (inputs already validated by dsagen.ops.lightning_indexer).

    config: None (the op: config_for's choices) or another IndexerConfig for the same H, D, dtype and arch
    (benchmarks; ValueError otherwise). Eager calls and calls with a config run the host loop directly; under
    torch.compile / export tracing the call goes through the custom op dsagen::lightning_indexer_fused.

    Returns contiguous int32 [B, T, topk]: each row's selected candidate ids in ascending order (ties at
    the selection threshold go to the lower id), then -1 padding when fewer than topk candidates are
    valid. Deterministic: repeated calls on identical inputs give identical results.

    Raises ValueError for a backend other than "cute", a shape outside the declared limits (H in
    INDEXER_HEADS, D in INDEXER_HEAD_DIMS, T, S, topk <= 2**20) or a layout TMA cannot read (q / k need
    stride 1 in the last dimension, a 16-byte-aligned base and 16-byte-multiple outer strides; weights
    may have any strides); TypeError for dtypes other than one shared bfloat16 / float16;
    NotImplementedError on a GPU other than sm_90a. keep_plan: called after an eager call of the op's config with
    the IndexerLaunch that repeats it for tensors of the same signature (the public op's fast path).
    """
    check_backend(kernel_options)
    check_supported(q, k, weights, topk)
    if config is not None or eager(q):
        # eager calls run the host loop directly: the custom op's dispatch layers (autograd, the backend wrapper's
        # output checks) cost ~60 us of host time per call on the H200's host, the same launches either way
        return _run(q, k, weights, topk, bool(causal), int(compress_ratio), cu_seqlens, cu_seqlens_k, config,
                    keep_plan if config is None else None)
    return _lightning_indexer_op(q, k, weights, topk, bool(causal), int(compress_ratio), cu_seqlens, cu_seqlens_k)
