"""Spec families of the fused lightning indexer (attention-gym lightning_indexer): a tensor-core score kernel that fills a
bounded fp32 score slab, and a radix top-k kernel that selects from it.

    score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h, :] . k[b, s, :]) / sqrt(H * D)

The host (dsagen.fused.lightning_indexer) walks the query rows in slabs of R rows; for each slab the
score kernel writes the rows' valid candidates (causal / document bounds) into an R x S fp32 slab and
the top-k kernel turns each row into `topk` ascending candidate ids, -1 padded. The slab is capped
(SLAB_BYTES), so scratch never grows with T.

Kernels specialize only on what changes the code: heads H, head dim D, the input dtype and tile
choices. Sequence lengths, batch, topk, causal, compress_ratio and packed offsets are run-time
arguments: a new length or topk never compiles a new kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base import KernelSpec, register_spec

#: Heads the score kernel implements. The wgmma N tile is 128 (token, head) columns, i.e. 128 // H
#: query tokens per CTA, so H must divide 128 and be a multiple of 8 (one 8-column accumulator block).
INDEXER_HEADS = (8, 16, 32, 64, 128)
#: Head dims: multiples of 64 (one 128-byte swizzled TMA box per 64 columns) up to 128.
INDEXER_HEAD_DIMS = (64, 128)
INDEXER_DTYPES = ("bfloat16", "float16")
#: Largest sequence length (query rows per batch element, and candidates S) the fused path accepts.
INDEXER_MAX_T = 2 ** 20
#: The fp32 score slab is capped at this many bytes (rows * row stride * 4); see the fused module. 128 MiB: the
#: GPU-measured best of 8 / 16 / 32 / 64 / 128 (notes/kernels/indexer.md, measured 2026-11-29: fewer launches and more
#: top-k rows in flight; T=131072: 312 -> 268 ms against 32 MiB).
SLAB_BYTES = 128 * 2 ** 20
#: ... and at this many rows.
SLAB_MAX_ROWS = 1024

#: Timing ablations of the score kernel (IndexerScoreSpec.ablate), NOT correct kernels: each leaves one
#: stage out so that the time of that stage is the difference to the default (notes/kernels/indexer.md,
#: measured 2026-11-29). "" is the real kernel. (The removed lock-step kernel's other probes were pruned with it.)
#:   no_epilogue  MMA kept (all D/16 HGMMAs per tile), epilogue replaced by one FADD per tile (MMA + loads time)
#:   mma_k16      one HGMMA (k = 16) per tile instead of D/16, epilogue and stores kept (loads + epilogue time)
INDEXER_SCORE_ABLATIONS = ("", "no_epilogue", "mma_k16")
#: Timing ablations of the top-k kernel (IndexerTopkSpec.ablate), NOT correct kernels (rows with more than
#: topk candidates write no output; notes/kernels/indexer-topk.md):
#:   hist1    the first radix pass only (vector loads of the row + per-warp histogram atomics + bin scan)
#:   read1    the first pass's loads only (xor-reduced, no atomics): one vectorized read of every row
#:   no_emit  the radix passes, no ordered emit
INDEXER_TOPK_ABLATIONS = ("", "hist1", "read1", "no_emit")
#: Threads of the top-k kernel. Registers are budgeted for 2 CTAs per SM at 256 / 512 threads (64 at 512),
#: for 1 CTA per SM at 1024 (64 registers; the host uses it only when a slab's rows fit one wave) and for
#: 1024 / threads CTAs per SM at 64 / 128 (64 registers: 16 / 8 rows in flight per SM; each thread then scans
#: 4 / 2 bins of the block histogram).
INDEXER_TOPK_THREADS = (64, 128, 256, 512, 1024)
#: Top-k threads per row when a slab's rows fit one wave of one CTA per SM and the top-k options pin no thread
#: count (topk_plan): twice the warps per row of the 512-thread kernel.
TOPK_WIDE_THREADS = 1024
#: IndexerTopkSpec(compact=True): (key, id) entries of shared memory per row, by threads. Sized so that the
#: CTAs per SM of the register budget still fit (2 x 115,712 B of 233,472 B at 256 / 512 threads, 1 at 1024):
#: 8 B per entry next to the 1 KiB-per-warp histograms.
TOPK_COMPACT_CAP = {256: 12288, 512: 12288, 1024: 24576}
#: Schedules of the score kernel (IndexerScoreSpec.schedule; template lightning_indexer_score_pingpong):
#:   pingpong    alternate 64-row tiles per consumer warpgroup, named barriers order their wgmma issues, so
#:               one warpgroup's epilogue runs under the other's MMA; one CTA per work item
#:   persistent  pingpong with about one CTA per SM, each looping over work items; a scheduler warp and
#:               2 Q buffers prepare the next item while the current one runs
INDEXER_SCORE_SCHEDULES = ("pingpong", "persistent")


def tokens_per_cta(num_heads: int) -> int:
    """Query tokens one score work item covers: the wgmma N tile (128 columns) holds tokens x heads."""
    return 128 // num_heads


@register_spec
@dataclass(frozen=True)
class IndexerScoreSpec(KernelSpec):
    """Lightning-indexer scores into an fp32 slab, on sm_90a tensor cores (wgmma).

    Work item = a token block (128 // num_heads consecutive query tokens of one batch element: the wgmma N
    tile of 128 (token, head) columns) x one chunk of candidates. Warp-specialized: a TMA producer warp
    streams K tiles through smem; 2 consumer warpgroups multiply 64 K rows each (wgmma M) by the block's Q
    tile, then apply ReLU, the per-head weights and the head sum in registers and write the scores of the
    candidates each token may select. How the consumers share the work is the `schedule`:

    schedule: one of INDEXER_SCORE_SCHEDULES. "persistent" (the default; GPU-measured fastest, see
    notes/kernels/indexer.md): about one CTA per SM loops over work items; a scheduler warp publishes each
    item's bounds and weights, 2 Q buffers let the next item's Q load during the current one; the consumer
    warpgroups take alternate 64-row K tiles (ring of 2 * stages 64-row slots) and two named barriers order
    their wgmma issues (ping-pong), so one warpgroup's epilogue runs under the other's MMA. "pingpong": the
    same kernel with one CTA per work item. The host passes the grid size (n_ctas).

    num_heads: H, one of INDEXER_HEADS.  head_dim: D, one of INDEXER_HEAD_DIMS.
    dtype: q / k / weights element type ("bfloat16" or "float16").  stages: K buffering in 128-row units.
    ablate: "" (the real kernel) or a timing probe that leaves one stage out: one of INDEXER_SCORE_ABLATIONS.
    Its output is NOT the indexer's; only bench/indexer.py --variant ablate-* and launch smoke tests use it.
    consumers: consumer warpgroups, 2 or 3 (512 threads; setmaxnreg 40 / 3 x 152); with 3,
    64-row tiles go round WG0 -> WG1 -> WG2, so each warpgroup has two other tiles' MMA time for its epilogue.
    GPU-measured 8% faster than 2 at T=32768 (13.68 vs 14.94 ms); the dataclass default stays 2 and
    indexer_specs() picks 3 wherever the other options allow it (DEFAULT_CONSUMERS).
    lean_epilogue (not with ablate): a shorter epilogue per tile: at most 8 FFMAs per dependent
    chain (independent partial sums), a reduce-scatter over the quad (each lane ends with its own sums: 3 SHFL
    instead of 8 at H=64) and per kept sum one unsigned bounds compare and a 32-bit slab offset precomputed per
    work item, one store per lane. GPU-measured: not faster than the default (notes/kernels/indexer.md, measured 2026-11-29).
    free_issue: no turn barriers; each consumer warpgroup issues its
    tiles' wgmmas as soon as their K tile has landed (work-conserving: the tensor cores idle only while every
    warpgroup is in its epilogue; the order of issue is no longer WG0, WG1, ...). A probe of the turn hand-off
    (ncu, 2026-11-29: top stall the named barrier). GPU-measured: not faster than the default.
    mma_head_sum (bfloat16 only; not with lean_epilogue or ablate): the weighted head sum runs on the tensor
    cores: per tile, ReLU(S) is rounded to bf16 in the wgmma A-operand registers and multiplied (wgmma
    m64nNk16, N = 8 or 16 >= tokens per tile) by a (token, head) x token matrix holding the bf16 weights on
    its block diagonal (written to smem per work item by the scheduler warp); the fp32 products are scaled by
    1/sqrt(H*D) and stored. ~1/3 of the epilogue's instructions; scores then carry the bf16 rounding of each
    ReLU(q.k) term (relative 2**-9 per term, well inside the tests' 2**-8 x row-max tolerance).
    """

    op = "lightning_indexer_score"
    template = "lightning_indexer_score_pingpong.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    stages: int = 4
    ablate: str = ""
    schedule: str = "persistent"
    consumers: int = 2
    lean_epilogue: bool = False
    free_issue: bool = False
    mma_head_sum: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.schedule not in INDEXER_SCORE_SCHEDULES:
            out.append(f"schedule={self.schedule!r} is not supported; choose one of {INDEXER_SCORE_SCHEDULES}")
        if self.consumers not in (2, 3):
            out.append(f"consumers={self.consumers} must be 2 or 3")
        elif self.consumers == 3 and self.ablate:
            out.append("consumers=3 is an option of the real kernel, not of the ablations")
        if self.lean_epilogue and self.ablate:
            out.append("lean_epilogue is an option of the real kernel, not of the ablations")
        if self.mma_head_sum and (self.ablate or self.lean_epilogue or self.dtype != "bfloat16"):
            out.append("mma_head_sum is an option of the real bfloat16 kernel without lean_epilogue")
        if self.arch != "sm_90a":
            out.append(f"the lightning-indexer score kernel is implemented for sm_90a only, not {self.arch}")
        if self.num_heads not in INDEXER_HEADS:
            out.append(f"num_heads={self.num_heads} is not supported; choose one of {INDEXER_HEADS}")
        if self.head_dim not in INDEXER_HEAD_DIMS:
            out.append(f"head_dim={self.head_dim} is not supported; choose one of {INDEXER_HEAD_DIMS}")
        if self.dtype not in INDEXER_DTYPES:
            out.append(f"dtype={self.dtype!r} is not supported; choose one of {INDEXER_DTYPES}")
        if self.ablate not in INDEXER_SCORE_ABLATIONS:
            out.append(f"ablate={self.ablate!r} is not a score-kernel ablation; choose one of {INDEXER_SCORE_ABLATIONS}")
        if not 2 <= self.stages <= 8:
            out.append(f"stages={self.stages} must be in 2..8")
        elif self.head_dim in INDEXER_HEAD_DIMS and self.smem_bytes() > 220 * 1024:
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory at "
                       f"head_dim={self.head_dim}; the limit is 220 KiB, use fewer stages")
        return out

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (Q tile + K stages + barriers/bounds), an estimate
        kept in step with the template's smem struct (the generator checks the real value)."""
        # 2 item slots x one 128-column Q tile, 2 x stages 64-row K slots
        return 2 * 128 * self.head_dim * 2 + 2 * self.stages * 64 * self.head_dim * 2 + 4096


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

    threads: one of INDEXER_TOPK_THREADS (512, the default: 2 CTAs per SM; 1024: 1 CTA per SM, for slabs
    whose rows fit one wave, chosen by the fused host).
    ablate: "" (the real kernel) or one of INDEXER_TOPK_ABLATIONS: a timing probe, NOT a correct kernel.
    compact: at the first radix pass after the first whose keys that can still be selected (above or in the
    crossing bin) fit TOPK_COMPACT_CAP[threads] entries, that pass also writes them as (key, id) in id order
    to shared memory; the later passes and the emit then read shared memory instead of the row (rows that
    never fit run as without it). Same results.
    sample: (with compact) rows of n >= 4 * topk first pick a 16-bit key prefix from THREADS evenly spaced keys
    (rank ~2 * topk * THREADS / n among them, two radix passes over the sample), then read the row ONCE, storing
    every key at or above that prefix as (key, id) in its warp's CAP / warps entries; when those hold at least
    topk keys and no warp overflowed, the top-k lies among them and every radix pass and the emit read shared
    memory (one global read of the row instead of two). Otherwise (an unlucky sample, skewed rows, all-equal
    keys) the row runs as without it. Same results.
    """

    op = "lightning_indexer_topk"
    template = "lightning_indexer_topk.py.j2"

    threads: int = 512
    ablate: str = ""
    compact: bool = False
    sample: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the lightning-indexer top-k kernel is implemented for sm_90a only, not {self.arch}")
        if self.threads not in INDEXER_TOPK_THREADS:
            out.append(f"threads={self.threads} must be one of {INDEXER_TOPK_THREADS}")
        if self.ablate not in INDEXER_TOPK_ABLATIONS:
            out.append(f"ablate={self.ablate!r} is not a top-k ablation; choose one of {INDEXER_TOPK_ABLATIONS}")
        if self.compact and self.ablate:
            out.append("compact=True is an option of the real kernel, not of the ablations")
        if self.compact and self.threads not in TOPK_COMPACT_CAP:
            out.append(f"compact=True needs threads in {tuple(TOPK_COMPACT_CAP)}")
        if self.sample and not self.compact:
            out.append("sample=True needs compact=True (the sampled candidates go to the compact entries)")
        return out

    def template_context(self) -> dict[str, Any]:
        """The fields plus `compact_cap` (TOPK_COMPACT_CAP of this thread count)."""
        return {**super().template_context(), "compact_cap": TOPK_COMPACT_CAP.get(self.threads, 0)}


#: Consumer warpgroups of the score kernel that indexer_specs() picks when the options leave `consumers` open
#: and allow 3 (GPU-measured fastest: notes/kernels/indexer.md, measured 2026-11-29).
DEFAULT_CONSUMERS = 3
#: lean_epilogue that indexer_specs() picks when the options leave it open (False until a GPU run shows it faster
#: than the default in the same run: notes/kernels/indexer.md, measured 2026-11-29).
DEFAULT_LEAN_EPILOGUE = False
#: free_issue that indexer_specs() picks likewise (False: not faster in the same run, measured 2026-11-29).
DEFAULT_FREE_ISSUE = False
#: mma_head_sum that indexer_specs() picks for bfloat16 when the options leave it open (and allow it: not with
#: ablate or lean_epilogue); float16 never takes it (notes/kernels/indexer.md, measured 2026-11-29).
DEFAULT_MMA_HEAD_SUM = False


def with_default_consumers(score_options: dict, dtype: str = "bfloat16") -> dict:
    """score_options plus consumers=DEFAULT_CONSUMERS when they leave it open and select no ablation, and
    likewise lean_epilogue=True / free_issue=True when DEFAULT_LEAN_EPILOGUE / DEFAULT_FREE_ISSUE is set
    (lean_epilogue: without ablate); mma_head_sum is bfloat16-only: dropped for any other `dtype`, else set
    when DEFAULT_MMA_HEAD_SUM is and the options leave it open and allow it (no ablate, no lean_epilogue)."""
    opts = dict(score_options)
    ablate = opts.get("ablate", IndexerScoreSpec.__dataclass_fields__["ablate"].default)
    if "consumers" not in opts and not ablate:
        opts["consumers"] = DEFAULT_CONSUMERS
    if DEFAULT_LEAN_EPILOGUE and "lean_epilogue" not in opts and not ablate:
        opts["lean_epilogue"] = True
    if DEFAULT_FREE_ISSUE and "free_issue" not in opts:
        opts["free_issue"] = True
    if dtype != "bfloat16":
        opts.pop("mma_head_sum", None)           # float16 keeps the CUDA-core head sum
    elif DEFAULT_MMA_HEAD_SUM and "mma_head_sum" not in opts and not ablate and not opts.get("lean_epilogue"):
        opts["mma_head_sum"] = True
    return opts


#: The top-k kernel the host runs per slab, by the longest row the slab can hold (its causal bound): (at most this
#: many candidates, IndexerTopkSpec options), the first entry that fits wins (None: any length). GPU-measured per
#: row length (bench/indexer_topk.py, 2026-11-29, H200, topk 2048, ns per row): 128 threads (8 rows in flight per SM)
#: are fastest up to ~12K candidates (n = 4096: 31 vs 54 at 512 threads; 8192: 45-49 vs 59-65), then 512 threads with
#: the sampled threshold and compacted candidates (16384: 87-88 vs 90 plain; 32768: 113 vs 120 compact / 143 plain;
#: 65536: 155 vs 230 compact), and for the longest rows 1024 (131072 in 256-row slabs: 306 vs 466-473 at 512, whose
#: entries cannot hold a 512-key sample's margin there).
TOPK_BY_ROW_LENGTH: tuple[tuple[int | None, dict], ...] = (
    (12288, {"threads": 128}),
    (65536, {"threads": 512, "compact": True, "sample": True}),
    (None, {"threads": 1024, "compact": True, "sample": True}))
#: The same for slabs whose rows fit one wave of one CTA per SM (rows <= SMs): twice the warps per row.
TOPK_WIDE_BY_ROW_LENGTH: tuple[tuple[int | None, dict], ...] = (
    (12288, {"threads": 1024}),
    (None, {"threads": 1024, "compact": True, "sample": True}))


@dataclass(frozen=True)
class TopkPlan:
    """The top-k kernels of a fused lightning_indexer call and the host's per-slab choice among them.

    narrow / wide: ((max_candidates or None, spec), ...): the first entry whose max_candidates is None or >= the
    slab's longest possible row wins; `wide` applies when the slab's rows fit one wave (rows <= SMs)."""

    narrow: tuple[tuple[int | None, IndexerTopkSpec], ...]
    wide: tuple[tuple[int | None, IndexerTopkSpec], ...]

    def specs(self) -> tuple[IndexerTopkSpec, ...]:
        """Every distinct top-k spec of the plan, in plan order (what a build must compile)."""
        return tuple(dict.fromkeys(spec for _, spec in (*self.narrow, *self.wide)))

    def pick(self, max_candidates: int, rows: int, num_sms: int) -> IndexerTopkSpec:
        """The spec for a slab of `rows` rows of at most `max_candidates` candidates on a GPU of `num_sms` SMs."""
        for limit, spec in (self.wide if rows <= num_sms else self.narrow):
            if limit is None or max_candidates <= limit:
                return spec
        raise AssertionError("a top-k plan ends with an entry for any length")


def topk_plan(arch: str, topk_options: dict | None = None) -> TopkPlan:
    """The default plan (TOPK_BY_ROW_LENGTH / TOPK_WIDE_BY_ROW_LENGTH), or, when topk_options are given (benchmark
    variants, tests), one kernel with those options: threads pinned by them, else 512 threads (TOPK_WIDE_THREADS
    when the rows fit one wave). {"compact": False} is thus the unplanned top-k (512 / 1024 threads)."""
    def one(limit, opts):
        return (limit, IndexerTopkSpec(arch=arch, **opts))

    if not topk_options:
        return TopkPlan(tuple(one(n, o) for n, o in TOPK_BY_ROW_LENGTH),
                        tuple(one(n, o) for n, o in TOPK_WIDE_BY_ROW_LENGTH))
    opts = dict(topk_options)
    if "threads" in opts:
        return TopkPlan((one(None, opts),), (one(None, opts),))
    return TopkPlan((one(None, opts),), (one(None, {"threads": TOPK_WIDE_THREADS, **opts}),))


def indexer_plan(arch: str, num_heads: int, head_dim: int, dtype: str = "bfloat16", *,
                 score_options: dict | None = None, topk_options: dict | None = None
                 ) -> tuple[IndexerScoreSpec, TopkPlan]:
    """The score kernel (with_default_consumers applied to score_options, for `dtype`) and the top-k plan
    (topk_plan) of a fused lightning_indexer call. The options override tile choices, e.g. {"schedule":
    "pingpong"}; the defaults are the GPU-verified ones."""
    score = with_default_consumers(score_options or {}, dtype)
    return (IndexerScoreSpec(arch=arch, num_heads=num_heads, head_dim=head_dim, dtype=dtype, **score),
            topk_plan(arch, topk_options))


def indexer_specs(arch: str, num_heads: int, head_dim: int, dtype: str = "bfloat16", *,
                  score_options: dict | None = None, topk_options: dict | None = None
                  ) -> tuple[KernelSpec, ...]:
    """Every kernel a fused lightning_indexer call may run (what a build compiles): the score kernel first, then
    the top-k plan's kernels (indexer_plan)."""
    score, plan = indexer_plan(arch, num_heads, head_dim, dtype, score_options=score_options,
                               topk_options=topk_options)
    return (score, *plan.specs())
