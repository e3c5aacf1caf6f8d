"""Spec family of the fused standalone indexer top-k (cuDNN frontend DSA §5, Indexer Top-K): the radix top-k of the
lightning indexer (lightning_indexer/topk_sm90.py, `build(..., rows=True)`) over the rows of an FP32 matrix, row r
over its first clamp(lens[r // rows_per_len], 0, n_cols) columns, writing the ids of its topk largest values in
ascending order (ties at the k-th value toward the lower ids), -1 padded. Deterministic; no topk limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...spec.base import KernelSpec, register_spec
from ..lightning_indexer.topk_limits import TopkPlan, compact_cap, measured_plan, topk_kernel_reasons


@register_spec
@dataclass(frozen=True)
class IndexerTopkRowsSpec(KernelSpec):
    """Radix top-k over the rows of a matrix with per-row lengths (sm_90a): one CTA of `threads` threads per row, the
    lightning indexer's selection (its IndexerTopkSpec docstring describes the passes, the sampled threshold and the
    compaction into shared memory).

    threads: one of INDEXER_TOPK_THREADS (the plan picks it per call: config_for).
    sample: the sampled threshold and the candidates in shared memory (threads in TOPK_COMPACT_CAP).
    """

    op = "indexer_topk"
    template = "indexer_topk/topk_rows_{arch}.py.j2"

    threads: int = 512
    sample: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the indexer top-k kernel is implemented for sm_90a only, not {self.arch}; use "
                       f"impl='reference' elsewhere")
        return out + topk_kernel_reasons(self.threads, self.sample)

    def template_context(self) -> dict[str, Any]:
        """The fields plus `compact_cap` (TOPK_COMPACT_CAP of this thread count with sample, else 0)."""
        return {**super().template_context(), "compact_cap": compact_cap(self.threads, self.sample)}


def config_for(arch: str) -> TopkPlan:
    """The plan of the fused indexer_topk on `arch` (the launch's rows and columns pick the kernel): the lightning
    indexer's top-k plan (topk_limits.measured_plan, measured on its slab rows, 2026-11-29)."""
    return measured_plan(lambda threads, sample: IndexerTopkRowsSpec(arch=arch, threads=threads, sample=sample))
