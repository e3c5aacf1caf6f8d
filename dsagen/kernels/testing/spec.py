"""Spec of the runtime probe kernels (test-only)."""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec


@register_spec
@dataclass(frozen=True)
class RuntimeProbeSpec(KernelSpec):
    """Test-only kernels that exercise runtime capabilities no op uses yet.

    feature:
      "tma"     -- a 2-D fp32 tile loaded by TMA from a runtime-encoded CUtensorMap, scaled, stored.
      "smem"    -- a copy staged through `smem_bytes` (> 48 KB) of dynamic shared memory.
      "cluster" -- a 2x1x1 cluster; each CTA writes its cluster rank after a cluster barrier.
    """

    op = "runtime_probe"
    template = "testing/runtime_probe.py.j2"

    feature: str = ""
    smem_bytes: int = 0

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.feature not in ("tma", "smem", "cluster"):  # "" (the default) is rejected: say which
            out.append(f"feature={self.feature!r} must be one of 'tma', 'smem', 'cluster'")
        if self.feature == "smem" and not (49152 < self.smem_bytes <= 227 * 1024 and self.smem_bytes % 1024 == 0):
            out.append(f"smem_bytes={self.smem_bytes} must be a multiple of 1024 in (48 KiB, 227 KiB] "
                       f"for feature 'smem'")
        if self.feature != "smem" and self.smem_bytes:
            out.append("smem_bytes is only meaningful for feature 'smem'; leave it 0")
        return out
