"""Native sparse attention (NSA) at the NSA paper's benchmark shape: 64 query heads over 4 KV heads (and the small
group of 16 over 4), head dims 128, blocks of 64 tokens, 16 selected blocks. The kernels are the selected branch's
forward (the compressed branch and the backward have no generated kernels yet)."""

from __future__ import annotations

from ...kernels.nsa.spec import select_fwd_spec_for
from ..base import KernelSpec

NAME = "nsa"
DESCRIPTION = "NSA selected attention (HQ 64 / 16 over H 4, D 128, blocks of 64, 16 slots; forward)"


def specs(arch: str, serving: bool = False) -> list[KernelSpec]:
    """The NSA kernels that exist on `arch` (sm_90a only so far); serving builds the same (all are forward)."""
    if arch != "sm_90a":
        return []
    return [select_fwd_spec_for(g, 128, 128, 64, 16, dtype, arch) for g in (16, 4)
            for dtype in ("bfloat16", "float16")]
