"""Spec families of the fused lightning indexer (seed 000): a tensor-core score kernel that fills a
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
#: The fp32 score slab is capped at this many bytes (rows * row stride * 4); see the fused module.
SLAB_BYTES = 32 * 2 ** 20
#: ... and at this many rows.
SLAB_MAX_ROWS = 1024


#: wgmma N tiles of the lock-step score kernel ((token, head) columns per CTA). 256 is an option (n_tile) for
#: H >= 32: a K tile read from L2 then serves twice as many tokens (half the K traffic).
INDEXER_N_TILES = (128, 256)
#: Heads for which n_tile=256 is implemented (below 32 the per-token bounds take too many registers).
INDEXER_N256_HEADS = (32, 64, 128)


#: Timing ablations of the score kernel (IndexerScoreSpec.ablate), NOT correct kernels: each leaves one
#: stage out so that the time of that stage is the difference to the default (notes/kernels/indexer.md,
#: "Look back (session 1)"). "" is the real kernel.
#:   no_epilogue  MMA kept (all D/16 HGMMAs per tile), epilogue replaced by one FADD per tile (MMA + loads time)
#:   mma_k16      one HGMMA (k = 16) per tile instead of D/16, epilogue and stores kept (loads + epilogue time)
#:   skeleton     mma_k16 + no_epilogue: TMA ring, barriers and one HGMMA per tile (pipeline skeleton time)
#:   no_store     epilogue computed, the slab stores replaced by a register sum (store cost)
#:   no_kload     K tiles not loaded (stage barriers complete on the arrive; MMA reads stale smem): K traffic cost
#:   one_tile     at most one K tile per CTA: launch + per-CTA fixed cost (prologue, Q load, pipeline fill)
INDEXER_SCORE_ABLATIONS = ("", "no_epilogue", "mma_k16", "skeleton", "no_store", "no_kload", "one_tile")
#: The ablations the ping-pong / persistent kernel implements (same meaning; without turn_after_mma / share_k).
INDEXER_PINGPONG_ABLATIONS = ("", "no_epilogue", "mma_k16")
#: Timing ablations of the top-k kernel (IndexerTopkSpec.ablate), NOT correct kernels (rows with more than
#: topk candidates write no output; notes/kernels/indexer-topk.md):
#:   hist1    the first radix pass only (vector loads of the row + per-warp histogram atomics + bin scan)
#:   read1    the first pass's loads only (xor-reduced, no atomics): one vectorized read of every row
#:   no_emit  the radix passes, no ordered emit
INDEXER_TOPK_ABLATIONS = ("", "hist1", "read1", "no_emit")
#: Threads of the top-k kernel. Registers are budgeted for 2 CTAs per SM at 256 / 512 threads (64 at 512)
#: and for 1 CTA per SM at 1024 (64 registers; the host uses it only when a slab's rows fit one wave).
INDEXER_TOPK_THREADS = (256, 512, 1024)
#: Top-k threads per row when a slab's rows fit one wave of one CTA per SM (long rows: S = 131072 gives 64
#: rows per 32 MiB slab): twice the warps per row of the default 512-thread kernel.
TOPK_WIDE_THREADS = 1024
#: IndexerTopkSpec(compact=True): (key, id) entries of shared memory per row, by threads. Sized so that the
#: CTAs per SM of the register budget still fit (2 x 115,712 B of 233,472 B at 256 / 512 threads, 1 at 1024):
#: 8 B per entry next to the 1 KiB-per-warp histograms.
TOPK_COMPACT_CAP = {256: 12288, 512: 12288, 1024: 24576}
#: Schedules of the score kernel (IndexerScoreSpec.schedule):
#:   lockstep    one CTA per (token block, chunk); both consumer warpgroups take 64 rows of the same 128-row
#:               stage, so their MMAs and epilogues run at the same time (template lightning_indexer_score)
#:   pingpong    alternate 64-row tiles per consumer warpgroup, named barriers order their wgmma issues, so
#:               one warpgroup's epilogue runs under the other's MMA; one CTA per work item
#:               (template lightning_indexer_score_pingpong)
#:   persistent  pingpong with about one CTA per SM, each looping over work items; a scheduler warp and
#:               2 Q buffers prepare the next item while the current one runs
INDEXER_SCORE_SCHEDULES = ("lockstep", "pingpong", "persistent")


def tokens_per_cta(num_heads: int, n_tile: int = 128) -> int:
    """Query tokens one score CTA covers: the wgmma N tile (n_tile columns) holds tokens x heads."""
    return n_tile // num_heads


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
    same kernel with one CTA per work item. "lockstep" (session 1): one CTA per item, both warpgroups take
    64 rows of the same 128-row stage (`stages` of them), so their MMAs and epilogues run at the same time.
    The host passes the grid size (n_ctas) to the ping-pong / persistent kernel.

    num_heads: H, one of INDEXER_HEADS.  head_dim: D, one of INDEXER_HEAD_DIMS.
    dtype: q / k / weights element type ("bfloat16" or "float16").  stages: K buffering in 128-row units.
    overlap (lockstep only): two accumulators per warpgroup, the second tile's wgmma runs during the first
    tile's epilogue. GPU-measured 4% slower than without.
    n_tile (lockstep only): wgmma N, the (token, head) columns of one CTA: 128 or 256 (H in INDEXER_N256_HEADS;
    2 x the tokens per CTA, so every K tile read from L2 serves twice the tokens). GPU-measured 5% slower.
    ablate: "" (the real kernel) or a timing probe that leaves one stage out: one of INDEXER_SCORE_ABLATIONS
    (lockstep) or INDEXER_PINGPONG_ABLATIONS (pingpong / persistent). Its output is NOT the indexer's; only
    bench/indexer.py --variant ablate-* and launch smoke tests use it.
    turn_after_mma (ping-pong schedules): a warpgroup passes the wgmma turn to the other once all but the last
    quarter of its tile's wgmmas have completed (False: right after issuing them). GPU-measured: no change.
    share_k (ping-pong schedules, H in INDEXER_N256_HEADS; the host turns it off for other H): a work item is
    2 x 128 // H tokens, one Q tile per consumer warpgroup, both warpgroups multiply every 64-row K tile (in
    turn), so each K tile read from L2 serves twice the tokens (K ring of `stages` 64-row slots, 4 Q
    buffers). GPU-measured 15% slower at T=32768.
    consumers (ping-pong schedules): consumer warpgroups, 2 or 3 (512 threads; setmaxnreg 40 / 3 x 152); with 3,
    64-row tiles go round WG0 -> WG1 -> WG2, so each warpgroup has two other tiles' MMA time for its epilogue.
    GPU-measured 8% faster than 2 at T=32768 (13.68 vs 14.94 ms); the dataclass default stays 2 and
    indexer_specs() picks 3 wherever the other options allow it (DEFAULT_PINGPONG_CONSUMERS).
    lean_epilogue (ping-pong schedules, not with ablate): a shorter epilogue per tile: at most 8 FFMAs per dependent
    chain (independent partial sums), a reduce-scatter over the quad (each lane ends with its own sums: 3 SHFL
    instead of 8 at H=64) and per kept sum one unsigned bounds compare and a 32-bit slab offset precomputed per
    work item, one store per lane. Not GPU-measured yet (notes/kernels/indexer.md, session 3).
    free_issue (ping-pong schedules, not with turn_after_mma): no turn barriers; each consumer warpgroup issues its
    tiles' wgmmas as soon as their K tile has landed (work-conserving: the tensor cores idle only while every
    warpgroup is in its epilogue; the order of issue is no longer WG0, WG1, ...). A probe of the turn hand-off
    (session-2 ncu: top stall the named barrier). Not GPU-measured yet.
    """

    op = "lightning_indexer_score"

    @property
    def template(self) -> str:  # type: ignore[override]
        """The lock-step kernel and the ping-pong / persistent kernel are separate templates."""
        if self.schedule == "lockstep":
            return "lightning_indexer_score.py.j2"
        return "lightning_indexer_score_pingpong.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    stages: int = 4
    overlap: bool = False
    n_tile: int = 128
    ablate: str = ""
    schedule: str = "persistent"
    turn_after_mma: bool = False
    share_k: bool = False
    consumers: int = 2
    lean_epilogue: bool = False
    free_issue: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.schedule not in INDEXER_SCORE_SCHEDULES:
            out.append(f"schedule={self.schedule!r} is not supported; choose one of {INDEXER_SCORE_SCHEDULES}")
        elif self.schedule != "lockstep":
            if self.n_tile != 128 or self.overlap or self.ablate not in INDEXER_PINGPONG_ABLATIONS:
                out.append(f"schedule={self.schedule!r} is implemented for n_tile=128 without overlap and with "
                           f"ablate in {INDEXER_PINGPONG_ABLATIONS} only; n_tile=256, overlap and the other "
                           f"ablations need schedule='lockstep'")
            elif self.ablate and (self.turn_after_mma or self.share_k):
                out.append("the ping-pong ablations apply without turn_after_mma and share_k only")
        if self.consumers not in (2, 3):
            out.append(f"consumers={self.consumers} must be 2 or 3")
        elif self.consumers == 3 and (self.schedule == "lockstep" or self.share_k or self.turn_after_mma or self.ablate):
            out.append("consumers=3 is an option of the ping-pong schedules without share_k, turn_after_mma and ablate")
        if self.lean_epilogue and (self.schedule == "lockstep" or self.ablate):
            out.append("lean_epilogue is an option of the ping-pong schedules (pingpong, persistent) without ablate")
        if self.free_issue and (self.schedule == "lockstep" or self.turn_after_mma):
            out.append("free_issue is an option of the ping-pong schedules (pingpong, persistent) without turn_after_mma")
        if self.schedule == "lockstep" and (self.turn_after_mma or self.share_k):
            out.append("turn_after_mma and share_k are options of the ping-pong schedules (pingpong, persistent)")
        if self.share_k and self.num_heads in INDEXER_HEADS and self.num_heads not in INDEXER_N256_HEADS:
            out.append(f"share_k needs num_heads in {INDEXER_N256_HEADS} (2 x 128 // H tokens per block keep the "
                       f"slab bound), got {self.num_heads}")
        if self.arch != "sm_90a":
            out.append(f"the lightning-indexer score kernel is implemented for sm_90a only, not {self.arch}")
        if self.num_heads not in INDEXER_HEADS:
            out.append(f"num_heads={self.num_heads} is not supported; choose one of {INDEXER_HEADS}")
        if self.head_dim not in INDEXER_HEAD_DIMS:
            out.append(f"head_dim={self.head_dim} is not supported; choose one of {INDEXER_HEAD_DIMS}")
        if self.dtype not in INDEXER_DTYPES:
            out.append(f"dtype={self.dtype!r} is not supported; choose one of {INDEXER_DTYPES}")
        if self.n_tile not in INDEXER_N_TILES:
            out.append(f"n_tile={self.n_tile} is not supported; choose one of {INDEXER_N_TILES}")
        elif self.n_tile == 256:
            if self.num_heads in INDEXER_HEADS and self.num_heads not in INDEXER_N256_HEADS:
                out.append(f"n_tile=256 needs num_heads in {INDEXER_N256_HEADS}, got {self.num_heads}")
            if self.overlap:
                out.append("n_tile=256 cannot be combined with overlap=True (two 128-register accumulators "
                           "per thread do not fit in the register file)")
        if self.ablate not in INDEXER_SCORE_ABLATIONS:
            out.append(f"ablate={self.ablate!r} is not a score-kernel ablation; choose one of {INDEXER_SCORE_ABLATIONS}")
        elif self.ablate and self.overlap:
            out.append("ablate applies to the one-accumulator kernel only (overlap=False)")
        if not 2 <= self.stages <= 8:
            out.append(f"stages={self.stages} must be in 2..8")
        elif self.head_dim in INDEXER_HEAD_DIMS and self.smem_bytes() > 220 * 1024:
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory at "
                       f"head_dim={self.head_dim}; the limit is 220 KiB, use fewer stages")
        return out

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (Q tile + K stages + barriers/bounds), an estimate
        kept in step with the template's smem struct (the generator checks the real value)."""
        n = self.n_tile if self.n_tile in INDEXER_N_TILES else 128
        if self.schedule != "lockstep":                  # 2 item slots x (1 or 2) Q tiles, 64-row K slots
            nq = 2 if self.share_k else 1
            kslots = self.stages if self.share_k else 2 * self.stages
            return 2 * nq * 128 * self.head_dim * 2 + kslots * 64 * self.head_dim * 2 + 4096
        return n * self.head_dim * 2 + self.stages * 128 * self.head_dim * 2 + 2048


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
    """

    op = "lightning_indexer_topk"
    template = "lightning_indexer_topk.py.j2"

    threads: int = 512
    ablate: str = ""
    compact: bool = False

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
        return out

    def template_context(self) -> dict[str, Any]:
        """The fields plus `compact_cap` (TOPK_COMPACT_CAP of this thread count)."""
        return {**super().template_context(), "compact_cap": TOPK_COMPACT_CAP.get(self.threads, 0)}


#: Consumer warpgroups of the ping-pong score kernel that indexer_specs() picks when the options leave
#: `consumers` open and allow 3 (GPU-measured fastest: notes/kernels/indexer.md, session 2).
DEFAULT_PINGPONG_CONSUMERS = 3
#: lean_epilogue that indexer_specs() picks for the ping-pong kernels when the options leave it open (False until a
#: GPU run shows it faster than the default in the same run: notes/kernels/indexer.md, session 3).
DEFAULT_LEAN_EPILOGUE = False
#: free_issue that indexer_specs() picks likewise (ping-pong schedules without turn_after_mma); False until measured.
DEFAULT_FREE_ISSUE = False


def with_default_consumers(score_options: dict) -> dict:
    """score_options plus consumers=DEFAULT_PINGPONG_CONSUMERS when they leave it open and the kernel they
    select supports it (a ping-pong schedule without share_k, turn_after_mma or ablate), and likewise
    lean_epilogue=True / free_issue=True when DEFAULT_LEAN_EPILOGUE / DEFAULT_FREE_ISSUE is set (a ping-pong schedule
    without ablate / without turn_after_mma); else unchanged."""
    opts = dict(score_options)
    defaults = {f: IndexerScoreSpec.__dataclass_fields__[f].default
                for f in ("schedule", "share_k", "turn_after_mma", "ablate")}
    o = {**defaults, **opts}
    if ("consumers" not in opts and o["schedule"] != "lockstep" and not o["share_k"] and not o["turn_after_mma"]
            and not o["ablate"]):
        opts["consumers"] = DEFAULT_PINGPONG_CONSUMERS
    if DEFAULT_LEAN_EPILOGUE and "lean_epilogue" not in opts and o["schedule"] != "lockstep" and not o["ablate"]:
        opts["lean_epilogue"] = True
    if DEFAULT_FREE_ISSUE and "free_issue" not in opts and o["schedule"] != "lockstep" and not o["turn_after_mma"]:
        opts["free_issue"] = True
    return opts


def indexer_specs(arch: str, num_heads: int, head_dim: int, dtype: str = "bfloat16", *,
                  score_options: dict | None = None, topk_options: dict | None = None
                  ) -> tuple[IndexerScoreSpec, IndexerTopkSpec, IndexerTopkSpec]:
    """The kernels a fused lightning_indexer call may run, for these plan-time facts (the options override
    tile choices, e.g. {"overlap": True}; the defaults are the GPU-verified ones, including
    with_default_consumers for the score kernel): the score kernel, the
    top-k kernel and the wide top-k kernel (TOPK_WIDE_THREADS threads per row, which the host runs when a
    slab's rows fit one wave). When topk_options pins "threads", the wide kernel is the top-k kernel."""
    topk = dict(topk_options or {})
    score = with_default_consumers(score_options or {})
    return (IndexerScoreSpec(arch=arch, num_heads=num_heads, head_dim=head_dim, dtype=dtype, **score),
            IndexerTopkSpec(arch=arch, **topk),
            IndexerTopkSpec(arch=arch, **{"threads": TOPK_WIDE_THREADS, **topk}))
