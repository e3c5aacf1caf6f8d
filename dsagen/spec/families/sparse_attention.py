"""Spec family of the fused sparse MLA attention forward (cuDNN frontend DSA §1 Sparse Attention Forward, DeepSeek-V4 inference kernel).

One kernel computes, for every query row t and head h,
    out[t, h]   = sum_j p_j * kv[idx[t, j], :d_v] / (sum_j p_j + exp(sink[h] - m))
    p_j         = exp(scale * q[t, h] . kv[idx[t, j]] - m),  m = max_j of the scaled scores
    lse[t, h]   = m + log(sum_j p_j)          (KV only: the sink is not in it)
    max_logits  = m
over the valid slots j of the row (0 <= id < total_S_kv and j < topk_length[t]).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import KernelSpec, register_spec

# Register budget of the 3-warpgroup kernel: a producer warpgroup that gathers rows with cp.async and two
# consumer warpgroups (QK^T + softmax + left half of O; right half of O). The CTA launches with
# floor(65536 / 384 / 8) * 8 = 168 registers per thread (64512 in all) and setmaxnreg only moves registers
# between warpgroups inside that pool: the three budgets must sum to at most 3 * 168 = 504, or the
# increasing warpgroups spin in setmaxnreg.inc forever (a hang, not an error).
_REGS_AT_LAUNCH = 65536 // 384 // 8 * 8
_REG_TOTAL = 3 * _REGS_AT_LAUNCH

SCHEDULES = ("serial", "split_halves", "serial_lean")
# setmaxnreg budgets of schedule="split_halves": 48 + 232 + 224 = 504. The producer keeps both tiles' ids over a
# pair (40 spills ~23 values in its loop, 48 ~12); consumer A (WG1) holds the most (O, S, P and the next tile's
# ids), B the least.
HALVES_REGS = {"regs_producer": 48, "regs_qk": 232, "regs_pv": 224}
# the register budget the op uses per schedule
SCHEDULE_REGS = {"serial": {}, "split_halves": HALVES_REGS, "serial_lean": {}}
# the options the op turns on per schedule (dsagen.fused.sparse_attention.OPTIONS overrides them at run time).
# GPU-measured (H200, 2026-11-29, interleaved with the kernel without them in the same run): split_halves' vec_store
# is 1.05-1.07x on every prefill shape (H64 / H128, D 512 / 576, S_q 4096 / 32768, KV 32768 / 131072) and 1.06x at
# decode 128 rows; stream_hint on top of it 1.01-1.02x (rotated rounds; ncu: DRAM reads 2.80 -> 2.21 GB per call, L2
# hit rate 67 -> 74%, at the headline shape). q_prefetch and l2_hint: no gain, off.
SCHEDULE_OPTIONS = {"serial": {}, "split_halves": {"vec_store": True, "stream_hint": True}, "serial_lean": {}}


def op_spec_fields(schedule: str) -> dict:
    """The SparseAttnFwdSpec fields the op runs `schedule` with: the schedule, its register budget
    (SCHEDULE_REGS) and its options (SCHEDULE_OPTIONS)."""
    return {"schedule": schedule, **SCHEDULE_REGS[schedule], **SCHEDULE_OPTIONS[schedule]}
# The schedule the op runs: DEFAULT_SCHEDULE for every kernel shape and call size, unless DEFAULT_SCHEDULES lists
# the shape as (schedule, min rows) (then that schedule from `min rows` query rows on). GPU-measured in one run
# (H200, 2026-11-29, notes/kernels/sparse_attention.md): split_halves with its lean softmax and producer-built
# validity bytes is 1.06-1.08x serial_lean at H128 / D576 prefill (S_q 4096 and 32768, KV 32768 and 131072),
# 1.02-1.12x serial at decode (64 / 128 rows), 1.11-1.15x serial at H64 / D512, H64 / D576 and H128 / D512.
DEFAULT_SCHEDULE = "split_halves"
DEFAULT_SCHEDULES: dict[tuple[int, int], tuple[str, int]] = {}


def default_schedule(num_heads: int, d_qk: int, rows: int | None = None) -> str:
    """The schedule the op runs for a kernel of `num_heads` (64 or 128) and `d_qk` over `rows` query rows
    (DEFAULT_SCHEDULES, else DEFAULT_SCHEDULE; rows None: a large call, e.g. a preset's kernel list)."""
    schedule, min_rows = DEFAULT_SCHEDULES.get((num_heads, d_qk), (DEFAULT_SCHEDULE, 0))
    return schedule if rows is None or rows >= min_rows else DEFAULT_SCHEDULE

# Boolean options of schedule "split_halves" (SparseAttnFwdSpec fields; dsagen.fused.sparse_attention.OPTIONS
# selects them at run time)
HALVES_OPTIONS = ("l2_hint", "vec_store", "stream_hint", "q_prefetch")

# Timing-only ablations (SparseAttnFwdSpec.ablate): each leaves one stage of the kernel out, so that the time
# difference to the full kernel on the same inputs places that stage's cost. Their outputs are NOT attention.
ABLATIONS = {
    "no_gather": "only the first 2 tiles are gathered; later tiles reuse the rows resident in their stage "
                 "(no KV traffic from L2/HBM, no producer id loads): the compute chain alone",
    "no_math": "consumers only wait / hand off / release the stages (no QK^T, softmax, P store, PV, id loads): "
               "the gather and the barrier protocol alone",
    "no_softmax": "P = S * scale: no validity mask (nor its id loads), row max, exp2, row sums or O rescale",
    "no_pv": "no P V wgmma in either consumer (P is still written to smem and handed off)",
    "no_mask": "no consumer id loads and no -inf masking (the softmax itself stays): what a producer-built "
               "validity mask could save at most",
    "trace": "split_halves: the real kernel plus %globaltimer timestamps at fixed points of every item (producer, "
             "consumer A and B; 8-byte slots written over the item's max_logits / lse-free stats region: max_logits "
             "holds the timestamps, lse is not written): where an item's time goes (bench --trace)",
    "no_ready_fence": "split_halves: no fence.proxy.async after the consumers' ready-barrier waits (2 per tile per "
                      "consumer, issued while wgmmas are in flight; FlashMLA has none there): their cost. Nothing "
                      "then orders the cp.async writes before the wgmma reads",
}
# The ablations each schedule has (its template blocks implement exactly these).
SCHEDULE_ABLATIONS = {
    "serial": ("no_gather", "no_math", "no_softmax", "no_pv", "no_mask"),
    "split_halves": ("no_gather", "no_ready_fence", "trace"),
    "serial_lean": ("no_gather",),
}


@register_spec
@dataclass(frozen=True)
class SparseAttnFwdSpec(KernelSpec):
    """Fused sparse MLA forward for Hopper (template sm90/sparse_attention_fwd.py.j2).

    num_heads: query heads the kernel is built for (64 or 128; one CTA per query row and 64 heads).
      Other head counts are padded to 64 by dsagen.fused.sparse_attention.
    d_qk: query/key width (512, or 576 = 512 latent + 64 RoPE); the whole width is scored.
    d_v: value/output width: the first d_v columns of each gathered row (512).
    dtype: q, kv and out dtype ("bfloat16" or "float16").
    block_n: gathered rows per pipeline stage (64).
    stages: KV stages in shared memory (2; a 64 x 576 stage is 72 KiB).
    regs_producer / regs_qk / regs_pv: setmaxnreg budgets of the three warpgroups (producer, consumer
      WG1, consumer WG2).
    schedule: how the two consumer warpgroups share a tile.
      "serial" (this dataclass's default; the op runs DEFAULT_SCHEDULE): WG1 does QK^T + softmax of every
        tile and O[:, :256]; WG2 only O[:, 256:] from the P tile WG1 leaves in smem.
      "split_halves" (FlashMLA's SM90 sparse prefill protocol; the op's default): tiles go in pairs, WG1
        does QK^T + softmax of the even tile, WG2 of the odd one, and each accumulates its half of O over
        both; per-half-stage ready/free mbarriers (a stage's left half V[:, :256] and right half are refilled
        as soon as the consumer that reads them last is done: V0L, V1R, V0R, V1L), an asymmetric max exchange
        (WG1 runs its softmax with its own running max and issues its PV at once, then rescales P and O by the
        pair max from WG2), the next pair's QK^T issued before the last PV of the pair retires, and validity
        bytes the producer writes per pair. The CTAs loop over the items (query row, 64 heads) of a grid of
        min(items, n_ctas) CTAs, n_ctas a run-time argument (dsagen.fused.sparse_attention.GRID): one CTA per
        item, or one per SM with the next item's Q and rows loaded while the consumers finish the current one.
        The two consumers run different code (HALVES_REGS is the budget the op uses).
      "serial_lean": serial with WG1's next-tile QK^T issued right behind its P V_L (waited with
        wait_group(1), so the tensor cores run P V(t) -> QK^T(t+1) with no drain between them) and a lean
        softmax (FMNMX tree row maxima, tree row sums, P packed to bf16 once, stmatrix P store); the producer
        loads a tile's ids one tile ahead, before waiting for its stage. Same registers and shared memory as
        serial.
    l2_hint: the KV gather's cp.async carries FlashMLA's hints, a 256-byte L2 prefetch and an L2 evict_last
      cache policy (schedule "split_halves" only). Default off.
    vec_store: the epilogue writes O as 16-byte stores after a 4 x 4 word transpose over each quad (shuffles)
      instead of 4-byte stores (schedule "split_halves" only). Off in this dataclass; the op turns it on
      (SCHEDULE_OPTIONS).
    stream_hint: Q loads (and, with vec_store, O stores) carry an L2 evict_first policy, so that the streamed
      data leaves L2 before the gathered rows, which other CTAs read again (schedule "split_halves" only). Off in
      this dataclass; the op turns it on (SCHEDULE_OPTIONS).
    q_prefetch: the producer prefetches its next item's Q into L2 (cp.async.bulk.prefetch) ~3 pairs before
      the current item ends (schedule "split_halves" only).
    ablate: "" (the real kernel) or one of ABLATIONS: a TIMING-ONLY variant that leaves one stage out
      (bench/sparse_attention.py --ablate); its outputs are not attention and the op never selects it.

    Sequence lengths, top-k width, KV pool size and softmax scale are run-time arguments.
    """

    op = "sparse_attention_fwd"
    template = "sparse_attention_fwd.py.j2"

    num_heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    dtype: str = "bfloat16"
    block_n: int = 64
    stages: int = 2
    regs_producer: int = 40
    regs_qk: int = 248
    regs_pv: int = 216
    schedule: str = "serial"
    l2_hint: bool = False
    vec_store: bool = False
    stream_hint: bool = False
    q_prefetch: bool = False
    ablate: str = ""

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"arch {self.arch!r}: the fused sparse attention forward exists for sm_90a only "
                       f"(Hopper wgmma); use impl='reference' elsewhere")
        if self.num_heads not in (64, 128):
            out.append(f"num_heads={self.num_heads} must be 64 or 128 (pad 16/32 heads to 64 in the op)")
        if self.d_qk not in (512, 576):
            out.append(f"d_qk={self.d_qk} must be 512 or 576")
        if self.d_v != 512:
            out.append(f"d_v={self.d_v} must be 512 (two 256-column halves, one per consumer warpgroup)")
        if self.dtype not in ("bfloat16", "float16"):
            out.append(f"dtype={self.dtype!r} must be 'bfloat16' or 'float16'")
        if self.block_n != 64:
            out.append(f"block_n={self.block_n} must be 64 (the P tile aliases a 64 x 64 RoPE tile)")
        if self.stages != 2:
            out.append(f"stages={self.stages} must be 2 (two 64-row stages plus Q fill shared memory)")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        for name in HALVES_OPTIONS:
            if getattr(self, name) and self.schedule != "split_halves":
                out.append(f"{name}=True exists for schedule 'split_halves' only, not {self.schedule!r}")
        if self.ablate and self.ablate not in ABLATIONS:
            out.append(f"ablate={self.ablate!r} must be '' or one of {tuple(ABLATIONS)}")
        elif self.ablate and self.ablate not in SCHEDULE_ABLATIONS.get(self.schedule, ()):
            out.append(f"ablate={self.ablate!r} does not exist for schedule {self.schedule!r} (it has "
                       f"{SCHEDULE_ABLATIONS.get(self.schedule, ())})")
        regs = (self.regs_producer, self.regs_qk, self.regs_pv)
        if any(r % 8 or not 24 <= r <= 256 for r in regs):
            out.append(f"regs_producer/regs_qk/regs_pv={regs} must each be a multiple of 8 in [24, 256]")
        elif sum(regs) > _REG_TOTAL:
            out.append(f"regs_producer + regs_qk + regs_pv = {sum(regs)} exceeds {_REG_TOTAL} "
                       f"(3 warpgroups x {_REGS_AT_LAUNCH} registers at launch; setmaxnreg cannot grow the pool)")
        return out
