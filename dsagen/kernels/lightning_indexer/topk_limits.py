"""Limits and plans of the radix top-k kernels (lightning_indexer/topk_sm90.py), shared by the specs of the lightning
indexer's slab top-k (lightning_indexer/spec.py) and of the standalone indexer_topk (indexer_topk/spec.py). A leaf
module: it imports no dsagen module, so both spec modules can use it while `dsagen.spec` is still loading the
families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: Threads of the top-k kernel (each one in some entry of a plan). Registers are budgeted for 2 CTAs per SM at 512
#: threads (64 registers), for 1 CTA per SM at 1024 (64 registers; the plans use it when the rows fit one wave, and
#: for the longest rows) and for 8 CTAs per SM at 128 (64 registers: 8 rows in flight per SM; each thread then scans 2
#: bins of the block histogram).
INDEXER_TOPK_THREADS = (128, 512, 1024)
#: sample=True: (key, id) entries of shared memory per row, by threads. Sized so that the CTAs per SM of the register
#: budget still fit (2 x 115,712 B of 233,472 B at 512 threads, 1 at 1024): 8 B per entry next to the 1 KiB-per-warp
#: histograms.
TOPK_COMPACT_CAP = {512: 12288, 1024: 24576}



def topk_kernel_reasons(threads: int, sample: bool) -> list[str]:
    """Why a top-k kernel of `threads` threads (sample: the sampled threshold) cannot be built ([] when it can)."""
    if threads not in INDEXER_TOPK_THREADS:
        return [f"threads={threads} must be one of {INDEXER_TOPK_THREADS}"]
    if sample and threads not in TOPK_COMPACT_CAP:
        return [f"sample=True needs threads in {tuple(TOPK_COMPACT_CAP)}"]
    return []


def compact_cap(threads: int, sample: bool) -> int:
    """The (key, id) shared-memory entries per row a top-k kernel is built with: TOPK_COMPACT_CAP[threads] with
    sample, else 0."""
    return TOPK_COMPACT_CAP.get(threads, 0) if sample else 0

@dataclass(frozen=True)
class TopkPlan:
    """Top-k kernels and the per-launch choice among them (the lightning indexer's per slab, indexer_topk's per call).

    narrow / wide: ((max_candidates or None, spec), ...): the first entry whose max_candidates is None or >= the
    launch's longest possible row wins; `wide` applies when the launch's rows fit one wave (rows <= SMs). The specs
    are IndexerTopkSpec or IndexerTopkRowsSpec (one kind per plan)."""

    narrow: tuple[tuple[int | None, Any], ...]
    wide: tuple[tuple[int | None, Any], ...]

    @classmethod
    def single(cls, narrow: Any, wide: Any = None) -> "TopkPlan":
        """One kernel for every launch (`wide`, when given, for launches whose rows fit one wave): benchmark
        baselines."""
        return cls(((None, narrow),), ((None, wide or narrow),))

    def specs(self) -> tuple:
        """Every distinct top-k spec of the plan, in plan order (what a build must compile)."""
        return tuple(dict.fromkeys(spec for _, spec in (*self.narrow, *self.wide)))

    def pick(self, max_candidates: int, rows: int, num_sms: int):
        """The spec for `rows` rows of at most `max_candidates` candidates on a GPU of `num_sms` SMs."""
        for limit, spec in (self.wide if rows <= num_sms else self.narrow):
            if limit is None or max_candidates <= limit:
                return spec
        raise AssertionError("a top-k plan ends with an entry for any length")


def measured_plan(spec: Callable[[int, bool], Any]) -> TopkPlan:
    """The plan measured on the lightning indexer's slab rows (lightning_indexer/spec.py config_for has the figures),
    with `spec(threads, sample)` making each kernel's spec: 128 threads per row up to 12288 candidates, 512 threads
    with the sampled threshold up to 65536, 1024 sampled beyond; rows that fit one wave take 1024 threads (sampled
    beyond 12288)."""
    return TopkPlan(narrow=((12288, spec(128, False)), (65536, spec(512, True)), (None, spec(1024, True))),
                    wide=((12288, spec(1024, False)), (None, spec(1024, True))))
