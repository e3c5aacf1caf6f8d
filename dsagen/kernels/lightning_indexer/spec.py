"""Spec families of the fused lightning indexer (attention-gym lightning_indexer): a tensor-core score kernel that fills a
bounded fp32 score slab, and a radix top-k kernel that selects from it.

    score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h, :] . k[b, s, :]) / sqrt(H * D)

The host (dsagen.kernels.lightning_indexer.host) walks the query rows in slabs of R rows; for each slab the
score kernel writes the rows' valid candidates (causal / document bounds) into an R x S fp32 slab and
the top-k kernel turns each row into `topk` ascending candidate ids, -1 padded. The slab is capped
(IndexerConfig.slab_bytes), so scratch never grows with T.

Kernels specialize only on what changes the code: heads H, head dim D, the input dtype, the K buffering and
the top-k's threads and sampling; every measured choice is picked by config_for (an IndexerConfig). Sequence
lengths, batch, topk, causal, compress_ratio and packed offsets are run-time arguments: a new length or topk
never compiles a new kernel.
"""

from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass
from typing import Any

from ...spec.base import KernelSpec, register_spec
from .topk_limits import (  # noqa: F401 (the limits are re-exported): the top-k kernels' limits and plan
    INDEXER_TOPK_THREADS, TOPK_COMPACT_CAP, TopkPlan, compact_cap, measured_plan, topk_kernel_reasons)

#: Heads the score kernel implements. The wgmma N tile is 128 (token, head) columns, i.e. 128 // H
#: query tokens per CTA, so H must divide 128 and be a multiple of 8 (one 8-column accumulator block).
INDEXER_HEADS = (8, 16, 32, 64, 128)
#: Head dims: multiples of 64 (one 128-byte swizzled TMA box per 64 columns) up to 128.
INDEXER_HEAD_DIMS = (64, 128)
INDEXER_DTYPES = ("bfloat16", "float16")
#: The FP8 form of the score kernel's dtype field: E4M3 q and k (dense_scores form, head_dim 128 only: one 128-byte
#: swizzled row of 8-bit elements per key), weights bf16 or fp32 and fp32 descales (score_sm90.fp8_params).
INDEXER_FP8_DTYPE = "float8_e4m3fn"
#: Candidates per work item the FP8 score kernel takes at most: it stages an item's k descales in shared memory
#: (score_sm90.FP8_KSCALE_ROWS, equal by a CPU test).
FP8_MAX_CHUNK_ROWS = 4096
#: Heads of the FP8 score kernel: its tensor-core head sum holds at most 8 tokens (128 / H) per tile.
INDEXER_FP8_HEADS = (16, 32, 64, 128)
#: Largest sequence length (query rows per batch element, and candidates S) the fused path accepts.
INDEXER_MAX_T = 2 ** 20


def tokens_per_cta(num_heads: int) -> int:
    """Query tokens one Q tile covers: the wgmma N tile (128 columns) holds tokens x heads."""
    return 128 // num_heads


def item_tokens(spec) -> int:
    """Query tokens one work item (token block) of the score kernel `spec` covers: its Q tiles' tokens."""
    return tokens_per_cta(spec.num_heads) * spec.q_tiles


@register_spec
@dataclass(frozen=True)
class IndexerScoreSpec(KernelSpec):
    """Lightning-indexer scores into an fp32 slab, on sm_90a tensor cores (wgmma).

    Work item = a token block (128 // num_heads consecutive query tokens of one batch element: the wgmma N
    tile of 128 (token, head) columns) x one chunk of candidates. Persistent and warp-specialized (512 threads):
    about one CTA per SM loops over work items (the host passes the grid size, n_ctas); in the producer
    warpgroup a scheduler warp publishes each item's bounds and weights and a TMA warp loads the item's Q tile
    (2 Q buffers: the next item's Q loads during the current one) and streams its 64-row K tiles through a
    ring of 2 * stages slots; 3 consumer warpgroups take the 64-row K tiles in turn (WG0 -> WG1 -> WG2), named
    barriers order their wgmma issues (ping-pong), so each warpgroup's ReLU x weight + head-sum epilogue runs
    under the other two's MMA; the scores of the candidates each token may select are written to the slab.

    num_heads: H, one of INDEXER_HEADS.  head_dim: D, one of INDEXER_HEAD_DIMS.
    dtype: q / k / weights element type ("bfloat16" or "float16"), or "float8_e4m3fn" (dense_scores and head_dim
    128 only): E4M3 q / k with fp32 descales, bf16 or fp32 weights (score_sm90.fp8_params); its head sum runs on
    the tensor cores (bf16 ReLU(S) times bf16 weights, FP32 accumulation) and its work items take at most
    FP8_MAX_CHUNK_ROWS candidates.
    stages: K buffering in 128-row units.
    consumers: consumer warpgroups taking the K tiles in turn: 3, or 4 (FP8 only: 640 threads, 104 registers each).
    dense_scores: the dsagen.indexer_scores form: the causal limit takes per-segment q_causal_offsets (two more
    params: an int32 pointer and a has-offsets flag) and the slab is the caller's [rows, S_k] score matrix (4-byte
    aligned base). False (the lightning indexer's kernel) generates exactly the code it had before the field.
    longest_first: the scheduler takes the work items in reverse order (the longest causal rows first) in a snake
    over the CTAs, which balances the CTAs' work when the rows' lengths ramp (score_sm90's docstring); False
    generates the code the kernel had before the field.
    q_tiles: Q tiles per work item: 1, or 2 (FP8 with 4 consumers, indexer_scores only): items of 2 * 128 / H
    tokens whose K tiles each pair of consumer warpgroups multiplies by both Q tiles (half the K bytes per query
    token); item_tokens(spec) is what the host's token blocks must use.
    paged: K from a paged cache of 64-row pages through a block table (dense_scores only; the decode-time indexer,
    dsagen.indexer_decode_topk): three more params (score_sm90.paged_params); False generates the code the kernel
    had before the field.
    """

    op = "lightning_indexer_score"
    template = "lightning_indexer/score_{arch}.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    stages: int = 4
    dense_scores: bool = False
    consumers: int = 3
    longest_first: bool = False
    q_tiles: int = 1
    paged: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the lightning-indexer score kernel is implemented for sm_90a only, not {self.arch}")
        if self.q_tiles not in (1, 2):
            out.append(f"q_tiles={self.q_tiles} must be 1 or 2")
        elif self.q_tiles == 2 and (self.dtype != INDEXER_FP8_DTYPE or self.consumers != 4):
            out.append(f"q_tiles=2 needs dtype={INDEXER_FP8_DTYPE!r} and consumers=4 (consumer pairs share a K tile)")
        if self.paged and not self.dense_scores:
            out.append("paged=True needs dense_scores=True (the decode-time indexer's form)")
        if self.consumers not in (3, 4):
            out.append(f"consumers={self.consumers} must be 3 or 4")
        elif self.consumers == 4 and self.dtype != INDEXER_FP8_DTYPE:
            out.append(f"consumers=4 needs dtype={INDEXER_FP8_DTYPE!r} (the other forms need 152 registers per "
                       f"consumer thread)")
        if self.num_heads not in INDEXER_HEADS:
            out.append(f"num_heads={self.num_heads} is not supported; choose one of {INDEXER_HEADS}")
        if self.head_dim not in INDEXER_HEAD_DIMS:
            out.append(f"head_dim={self.head_dim} is not supported; choose one of {INDEXER_HEAD_DIMS}")
        if self.dtype == INDEXER_FP8_DTYPE:
            if not self.dense_scores:
                out.append(f"dtype={self.dtype!r} needs dense_scores=True (the indexer_scores form)")
            if self.head_dim != 128:
                out.append(f"dtype={self.dtype!r} needs head_dim=128 (one 128-byte swizzled row), "
                           f"got {self.head_dim}")
            if self.num_heads not in INDEXER_FP8_HEADS:
                out.append(f"dtype={self.dtype!r} needs num_heads in {INDEXER_FP8_HEADS} (at most 8 tokens per "
                           f"tile for the tensor-core head sum), got {self.num_heads}")
        elif self.dtype not in INDEXER_DTYPES:
            out.append(f"dtype={self.dtype!r} is not supported; choose one of "
                       f"{INDEXER_DTYPES + (INDEXER_FP8_DTYPE,)}")
        if not 2 <= self.stages <= 8:
            out.append(f"stages={self.stages} must be in 2..8")
        elif self.head_dim in INDEXER_HEAD_DIMS and self.smem_bytes() > 220 * 1024:
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory at "
                       f"head_dim={self.head_dim}; the limit is 220 KiB, use fewer stages")
        return out

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (Q tile + K stages + barriers/bounds), an estimate
        kept in step with the smem struct of score_sm90.py (the generator checks the real value)."""
        # 2 item slots x one 128-column Q tile, 2 x stages 64-row K slots
        elem = 1 if self.dtype == INDEXER_FP8_DTYPE else 2
        # FP8: each item slot's k descales (FP8_MAX_CHUNK_ROWS fp32) and block-diagonal head-sum weights (8 x 128 bf16)
        fp8 = 2 * (FP8_MAX_CHUNK_ROWS * 4 + 8 * 128 * 2) if self.dtype == INDEXER_FP8_DTYPE else 0
        return 2 * 128 * self.head_dim * elem + 2 * self.stages * 64 * self.head_dim * elem + 4096 + fp8


@register_spec
@dataclass(frozen=True)
class IndexerTopkSpec(KernelSpec):
    """Radix top-k over the rows of the lightning-indexer score slab (sm_90a).

    One CTA of `threads` threads per slab row; warp w owns a contiguous segment of the row (128-bit loads,
    4 in flight per thread). Up to four 8-bit radix passes over the order-preserving fp32 keys, each warp
    histogramming its own segment, find the k-th largest key and give every warp its number of keys above
    it and equal to it; one ordered pass then writes the selected ids in ascending order without block
    barriers (ties at the threshold go to the lowest ids), or 0..n-1 and -1 padding when the row has no
    more than topk candidates. Deterministic: no result depends on thread timing.

    threads: one of INDEXER_TOPK_THREADS (the plan picks it per slab: config_for).
    sample: candidates in shared memory (threads in TOPK_COMPACT_CAP). Rows of n >= 4 * topk first pick a 16-bit
    key prefix from THREADS evenly spaced keys (rank ~2 * topk * THREADS / n among them, two radix passes over the
    sample), then read the row ONCE, storing every key at or above that prefix as (key, id) in its warp's
    CAP / warps entries; when those hold at least topk keys and no warp overflowed, the top-k lies among them and
    every radix pass and the emit read shared memory. Otherwise (shorter rows, an unlucky sample, skewed rows,
    all-equal keys) the row is compacted: at the first radix pass after the first whose keys that can still be
    selected (above or in the crossing bin) fit TOPK_COMPACT_CAP[threads] entries, that pass also writes them as
    (key, id) in id order to shared memory, and the later passes and the emit read them (rows that never fit run
    from global memory throughout). Same results as without it.
    forward_topk: the dsagen.indexer_forward_topk form: the causal limit takes per-segment q_causal_offsets (the
    dense indexer's mask, always causal) and the selected scores are written beside the ids (three more params:
    values, q_off, has_off; no causal flag). False generates the lightning indexer's kernel.
    softmax (forward_topk only): the CTA also finishes its row after the selection, as IndexerTopkSoftmaxSpec's
    kernel would (the row's LSE and softmax over the selected slots, the global ids; five more params: softmax,
    lse, want_soft, want_lse, global_ids), so indexer_forward_topk runs no finishing kernel.
    """

    op = "lightning_indexer_topk"
    template = "lightning_indexer/topk_{arch}.py.j2"

    threads: int = 512
    sample: bool = False
    forward_topk: bool = False
    softmax: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the lightning-indexer top-k kernel is implemented for sm_90a only, not {self.arch}")
        if self.softmax and not self.forward_topk:
            out.append("softmax=True is a form of the forward_topk kernel (it needs forward_topk=True)")
        return out + topk_kernel_reasons(self.threads, self.sample)

    def template_context(self) -> dict[str, Any]:
        """The fields plus `compact_cap` (TOPK_COMPACT_CAP of this thread count with sample, else 0)."""
        return {**super().template_context(), "compact_cap": compact_cap(self.threads, self.sample)}


def row_pass_reasons(arch: str, threads, kernel: str) -> list[str]:
    """Why a persistent row pass (IndexerScoresMaskSpec, IndexerTopkSoftmaxSpec) cannot be built: an arch other than
    sm_90a (naming `kernel`), threads not a multiple of 32 in 64..1024."""
    out = []
    if arch != "sm_90a":
        out.append(f"{kernel} is implemented for sm_90a only, not {arch}")
    if isinstance(threads, int) and not (64 <= threads <= 1024 and threads % 32 == 0):
        out.append(f"threads={threads} must be a multiple of 32 in 64..1024")
    return out


@register_spec
@dataclass(frozen=True)
class IndexerScoresMaskSpec(KernelSpec):
    """The finishing pass of dsagen.indexer_scores (sm_90a): after the dense_scores score kernel wrote each row's
    valid columns, it writes -inf to the row's masked tail and, when asked at run time, the row's logsumexp over
    its valid columns (-inf for a row without one). Persistent, one row per CTA at a time, `threads` threads:
    coalesced fp32 stores of the tail, loads of the valid columns with an online max / sum of exp2, a warp and
    then a CTA merge of the statistics (mask_lse_sm90's docstring).

    threads: per CTA, a multiple of 32 in 64..1024.
    """

    op = "indexer_scores_mask_lse"
    template = "lightning_indexer/mask_lse_{arch}.py.j2"

    threads: int = 256

    def reasons(self) -> list[str]:
        return super().reasons() + row_pass_reasons(self.arch, self.threads, "the indexer_scores mask / LSE kernel")


@register_spec
@dataclass(frozen=True)
class IndexerTopkSoftmaxSpec(KernelSpec):
    """The finishing pass of dsagen.indexer_forward_topk (sm_90a): after the forward top-k kernel wrote each row's
    selected ids (row-local) and scores, it writes the row's logsumexp and softmax over the selected slots (0 on
    padding; -inf LSE for a row without one) and, when asked at run time, turns the ids into global key rows.
    Persistent, one row per CTA at a time, `threads` threads (topk_softmax_sm90's docstring).

    threads: per CTA, a multiple of 32 in 64..1024.
    """

    op = "indexer_forward_topk_softmax"
    template = "lightning_indexer/topk_softmax_{arch}.py.j2"

    threads: int = 256

    def reasons(self) -> list[str]:
        return super().reasons() + row_pass_reasons(self.arch, self.threads, "the indexer_forward_topk softmax kernel")


@dataclass(frozen=True)
class ScoresConfig:
    """Every choice of a fused dsagen.indexer_scores call (scores_config_for picks it).

    score: the dense_scores score kernel.  mask: the finishing kernel.  chunk_rows: candidates per score work item.
    launch_rows: query rows per score launch (a multiple of the token block; a launch's Q tiles stay in L2 while
    its CTAs stream each K chunk, as the lightning indexer's 1024-row slabs do).  mask_ctas_per_sm: the finishing
    kernel's persistent CTAs per SM.  score_fills: the score kernel writes the -inf tails (its filler warp, under the
    consumers' MMA) and the finishing kernel runs only for the LSE; False: the finishing kernel writes them (its own
    pass over the masked half of the matrix)."""

    score: IndexerScoreSpec
    mask: IndexerScoresMaskSpec
    chunk_rows: int
    launch_rows: int
    mask_ctas_per_sm: int
    score_fills: bool = True

    def specs(self) -> tuple[KernelSpec, ...]:
        """The kernels a call runs: the score kernel, then the finishing kernel."""
        return (self.score, self.mask)


def dense_score_consumers(dtype: str) -> int:
    """Consumer warpgroups of the dense_scores score kernel for dtype: 4 for FP8 E4M3 (104 registers each fit its
    accumulators; H 64 on the H200, 2026-12-03, same process: 0.611 against 0.641 ms at T 8192, 9.129 against
    9.891 at T 32768, scores bitwise equal), 3 for BF16 / FP16 (152 registers each; 4 do not fit the CTA's pool)."""
    return 4 if dtype == INDEXER_FP8_DTYPE else 3


@functools.lru_cache(maxsize=None)
def scores_config_for(num_heads: int, head_dim: int, dtype: str, arch: str) -> ScoresConfig:
    """The configuration of the fused indexer_scores for H, D, dtype and arch: the lightning indexer's measured score
    kernel (4 stages, work items of 4096 candidates) in its dense_scores form, 8192 query rows per launch, and a
    256-thread finishing kernel with 8 CTAs per SM (2048 threads: every SM's thread slots, for the memory-bound pass).
    Launch rows, same process on the H200 (2026-12-03, H 64, +lse, bench/indexer_forward.py --scores-variant): 1024 /
    8192 / 16384 / 32768 rows: T 4096 0.482 / 0.321 / 0.320 / 0.318 ms, T 8192 1.049 / 0.933 / 0.944 / 0.937, T 32768
    15.12 / 14.56 / 14.35 / 14.87 (and 14.49 against 13.95 for 1024 / 8192 in another run); work items of 1024
    candidates were slower (T 32768 16.10 against 14.49). The score kernel writes the -inf tails (score_fills):
    same process, scores without the LSE, T 8192 / 32768, BF16 0.847 / 13.57 ms against 0.872 / 14.40 with the
    finishing kernel's pass, FP8 0.637 / 10.56 against 0.670 / 11.21. The score kernel takes its items longest first
    (longest_first) and, in FP8, two Q tiles per item (q_tiles=2): same process (2026-12-03, H 64, scores without
    the LSE into a preallocated output, T 4096 / 8192 / 32768), BF16 0.261 / 0.913 / 14.18 ms against 0.266 /
    0.943 / 14.13 in the forward order; FP8 longest first 0.205 / 0.677 / 9.738 against 0.210 / 0.684 / 9.898, two
    Q tiles 0.206 / 0.655 / 9.106 against 0.213 / 0.686 / 9.808."""
    score = IndexerScoreSpec(arch=arch, num_heads=num_heads, head_dim=head_dim, dtype=dtype, stages=4,
                             dense_scores=True, consumers=dense_score_consumers(dtype), longest_first=True,
                             q_tiles=2 if dtype == INDEXER_FP8_DTYPE else 1)
    return ScoresConfig(score=score, mask=IndexerScoresMaskSpec(arch=arch, threads=256), chunk_rows=4096,
                        launch_rows=8192, mask_ctas_per_sm=8)


@dataclass(frozen=True)
class IndexerConfig:
    """Every measured choice of a fused lightning_indexer call (config_for picks it; a benchmark passes a variant
    to dsagen.kernels.lightning_indexer.host.lightning_indexer(..., config=...)).

    score: the score kernel.  topk: the top-k kernels and the per-slab choice among them.
    chunk_rows: candidates per score work item.  slab_bytes / slab_max_rows: caps of the fp32 score slab (bytes,
    rows); the slab never grows with T. The SM count enters per slab, at run time: the persistent score grid
    (min(#items, #SMs)) and TopkPlan.pick (rows <= #SMs: one wave)."""

    score: IndexerScoreSpec
    topk: TopkPlan
    chunk_rows: int
    slab_bytes: int
    slab_max_rows: int

    def specs(self) -> tuple[KernelSpec, ...]:
        """Every kernel a call with this config may run (what a build compiles): the score kernel, then the plan's."""
        return (self.score, *self.topk.specs())


@functools.lru_cache(maxsize=None)
def config_for(num_heads: int, head_dim: int, dtype: str, arch: str) -> IndexerConfig:
    """The GPU-measured configuration of the fused lightning_indexer for H, D, dtype and arch (figures:
    notes/kernels/indexer.md, notes/kernels/indexer-topk.md and BENCHMARKS.md, H200, measured 2026-11-29).

    - Score kernel: the persistent ping-pong kernel with 3 consumer warpgroups, 4 stages (a ring of 8 K slots).
    - Top-k, by the longest row a slab can hold (its causal bound); bench/indexer_topk.py, topk 2048, ns per row:
      128 threads (8 rows in flight per SM) are fastest up to ~12K candidates (n = 4096: 31 vs 54 at 512 threads;
      8192: 45 vs 59), then 512 threads with the sampled threshold (16384: 88 vs 90 plain; 32768: 113 vs 143 plain;
      65536: 155 vs 318), and for the longest rows 1024 (131072 in 256-row slabs: 306 vs 473 at 512, whose entries
      cannot hold a 512-key sample's margin there). Slabs whose rows fit one wave (rows <= SMs) take 1024 threads
      (twice the warps per row at no cost in waves), sampled beyond 12288 candidates.
    - Slab: at most 128 MiB (the best of 8 / 16 / 32 / 64 / 128 MiB: T=131072 312 -> 268 ms against 32 MiB) and
      1024 rows; work items of 4096 candidates (2048 / 8192 / 16384: within the noise).
    """
    plan = measured_plan(lambda threads, sample: IndexerTopkSpec(arch=arch, threads=threads, sample=sample))
    return IndexerConfig(score=IndexerScoreSpec(arch=arch, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
                                                stages=4),
                         topk=plan, chunk_rows=4096, slab_bytes=128 * 2 ** 20, slab_max_rows=1024)


@dataclass(frozen=True)
class ForwardTopkConfig:
    """Every choice of a fused dsagen.indexer_forward_topk call (forward_topk_config_for picks it; a benchmark passes
    a variant to dsagen.kernels.lightning_indexer.forward_topk_host.indexer_forward_topk(..., config=...)).

    score: the dense_scores score kernel (it fills the slab).  topk: the forward top-k kernels and the per-slab
    choice among them.  softmax: the finishing kernel, or None when the top-k kernels finish their rows themselves
    (their specs' softmax=True).  chunk_rows: candidates per score work item.
    slab_bytes / slab_max_rows: caps of the fp32 score slab (bytes, rows), which never grows with S_q or B.
    softmax_ctas_per_sm: the finishing kernel's persistent CTAs per SM. The score kernel has one Q tile per item
    (q_tiles=1: the slab's token blocks are tokens_per_cta(H) rows)."""

    score: IndexerScoreSpec
    topk: TopkPlan
    softmax: IndexerTopkSoftmaxSpec | None
    chunk_rows: int
    slab_bytes: int
    slab_max_rows: int
    softmax_ctas_per_sm: int

    def __post_init__(self) -> None:
        if self.score.q_tiles != 1:
            raise ValueError(f"ForwardTopkConfig.score.q_tiles={self.score.q_tiles}: the slab pipeline takes score "
                             f"kernels of one Q tile per item")
        finishing = [spec.softmax for spec in self.topk.specs()]
        if any(f != (self.softmax is None) for f in finishing):
            raise ValueError("ForwardTopkConfig: the top-k kernels must finish their rows (IndexerTopkSpec.softmax) "
                             "exactly when there is no finishing kernel (softmax=None)")

    def specs(self) -> tuple[KernelSpec, ...]:
        """Every kernel a call may run: the score kernel, the plan's top-k kernels, the finishing kernel if any."""
        return (self.score, *self.topk.specs()) + ((self.softmax,) if self.softmax is not None else ())


@functools.lru_cache(maxsize=None)
def forward_topk_config_for(num_heads: int, head_dim: int, dtype: str, arch: str,
                            finish_in_topk: bool = True) -> ForwardTopkConfig:
    """The configuration of the fused indexer_forward_topk for H, D, dtype (bf16 / fp16, or float8_e4m3fn at D 128)
    and arch: the lightning indexer's pipeline (config_for's score kernel, in its dense_scores form, and top-k plan,
    in their forward_topk form; work items of 4096 candidates) over a slab of at most 128 MiB and 4096 rows; the
    top-k kernels finish their rows (IndexerTopkSpec.softmax), or with finish_in_topk=False a 256-thread finishing
    kernel with 8 CTAs per SM does, after the last slab. Same process on the H200 (2026-12-03, topk 2048, H 64,
    bench/indexer_forward.py): at T = 32768 a 32 MiB slab took 16.81 ms against 15.71 with 128 MiB
    (lightning_indexer 15.27); row caps 1024 / 2048 / 4096 / 8192 (128 MiB): T 4096 0.467 / 0.448 / 0.425 / 0.419 ms,
    T 8192 1.238 / 1.196 / 1.149 / 1.154, T 32768 16.52 / 16.27 / 16.36 / 16.54 (1024 rows there either way).
    The score kernel takes its items longest first (longest_first; same process, 2026-12-03, bf16 through the host
    loop: 0.369 / 1.200 / 16.52 ms at T 4096 / 8192 / 32768 against 0.378 / 1.201 / 16.66)."""
    plan = measured_plan(lambda threads, sample: IndexerTopkSpec(arch=arch, threads=threads, sample=sample,
                                                                 forward_topk=True, softmax=finish_in_topk))
    score = IndexerScoreSpec(arch=arch, num_heads=num_heads, head_dim=head_dim, dtype=dtype, stages=4,
                             dense_scores=True, consumers=dense_score_consumers(dtype), longest_first=True)
    finish = None if finish_in_topk else IndexerTopkSoftmaxSpec(arch=arch, threads=256)
    return ForwardTopkConfig(score=score, topk=plan, softmax=finish,
                             chunk_rows=4096, slab_bytes=128 * 2 ** 20, slab_max_rows=4096, softmax_ctas_per_sm=8)


#: the decode-time indexer's page size: one K tile of the score kernel
DECODE_PAGE_ROWS = 64


def decode_config_for(num_heads: int, head_dim: int, dtype: str, arch: str) -> ForwardTopkConfig:
    """The configuration of the fused dsagen.indexer_decode_topk: forward_topk_config_for's pipeline (score into a
    bounded slab, the forward top-k) with its score kernel reading K from a paged cache of DECODE_PAGE_ROWS-row pages
    (IndexerScoreSpec.paged); the top-k kernels are indexer_forward_topk's."""
    cfg = forward_topk_config_for(num_heads, head_dim, dtype, arch)
    # work items of 1024 candidates (a multiple of the 64-row page): a decode step has few query rows (B x next_n),
    # so the candidates must make the items (B 4, next_n 1, 16K cached tokens: 64 items); not measured yet
    return dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, paged=True), chunk_rows=1024)
