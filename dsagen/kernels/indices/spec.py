"""Specs of the index utilities: compactify and local_to_global."""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec, warps_per_cta_reasons


@register_spec
@dataclass(frozen=True)
class CompactifySpec(KernelSpec):
    """Stable compaction of -1-padded top-k rows (cuDNN frontend DSA, "Compact vs. non-compact sparse indices").

    One warp per row. Specialized on nothing but the arch and the warps per CTA: the row width K and
    the number of rows are run-time arguments.
    """

    op = "compactify"
    template = "indices/compactify.py.j2"

    warps_per_cta: int = 8

    def reasons(self) -> list[str]:
        out = super().reasons()
        out.extend(warps_per_cta_reasons(self.warps_per_cta))
        return out


@register_spec
@dataclass(frozen=True)
class LocalToGlobalSpec(KernelSpec):
    """Per-batch local top-k ids -> flat global ids `b * S_k + local` (cuDNN frontend DSA, local_to_global_wrapper).

    Element-wise; `items_per_thread` consecutive ids per thread. Shapes are run-time arguments.
    """

    op = "local_to_global"
    template = "indices/local_to_global.py.j2"

    threads: int = 256
    items_per_thread: int = 4

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.threads not in (64, 128, 256, 512, 1024):
            out.append(f"threads={self.threads} must be one of 64, 128, 256, 512, 1024")
        if self.items_per_thread not in (1, 2, 4, 8):
            out.append(f"items_per_thread={self.items_per_thread} must be one of 1, 2, 4, 8")
        return out
