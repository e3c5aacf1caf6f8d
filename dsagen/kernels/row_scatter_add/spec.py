"""Spec of the deterministic row scatter-add: acc[target[i]] += rows[i] for every row i of an FP32 matrix, each
accumulator row's additions in increasing i. The deterministic modes of the sparse MLA backward (dkv) and of the
indexer backward (d_index_k) sum their per-slot rows with it."""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec, warps_per_cta_reasons

MAX_WIDTH = 4096


@register_spec
@dataclass(frozen=True)
class RowScatterAddSpec(KernelSpec):
    """Deterministic scatter-add of FP32 rows (kernel: row_scatter_add/scatter.py, bound by scatter.py.j2). One warp
    per accumulator row r: it loads acc[r] into registers, adds the rows whose target is r one at a time in
    increasing row order (16-byte loads, each lane 4 consecutive values of a row), and stores the sum; rows without
    a contribution are not touched. The order of the additions depends on nothing but `target`, so the result is
    bitwise the same run to run (host.scatter_add_rows builds the reverse index).

    width: FP32 values per row (a multiple of 4 in 4..4096). warps_per_cta: accumulator rows per CTA (one warp
    each; 1, 2, 4, 8, 16 or 32). unroll: contributing rows a warp loads before it adds them (1, 2, 4 or 8). The row
    counts are run-time arguments.
    """

    op = "row_scatter_add"
    template = "row_scatter_add/scatter.py.j2"

    width: int = 576
    warps_per_cta: int = 8
    unroll: int = 4

    def reasons(self) -> list[str]:
        out = super().reasons()
        w = self.width
        if isinstance(w, bool) or not isinstance(w, int) or w % 4 or not 4 <= w <= MAX_WIDTH:
            out.append(f"width={w!r} must be a multiple of 4 in 4..{MAX_WIDTH}")
        out.extend(warps_per_cta_reasons(self.warps_per_cta))
        if self.unroll not in (1, 2, 4, 8):
            out.append(f"unroll={self.unroll!r} must be one of 1, 2, 4, 8")
        return out
