"""Query sparse attention (QSA) at FlashInfer QSA's shapes: 12 / 1 and 24 / 2 query / KV heads (G 12), head dims 256,
bf16. The kernels: the indexed and the bitmap form's forward (the backward has no kernel yet)."""

from __future__ import annotations

from ...kernels.qsa.spec import spec_for
from ..base import KernelSpec

NAME = "qsa"
DESCRIPTION = "QSA (Hq / Hkv 12 / 1 and 24 / 2, D 256, bf16; the indexed and the bitmap forward)"


def specs(arch: str, serving: bool = False) -> list[KernelSpec]:
    """The QSA kernels that exist on `arch` (sm_90a only so far); every one is a forward kernel, so serving takes
    them all."""
    if arch != "sm_90a":
        return []
    return [spec_for(12, 256, 256, "bfloat16", arch, bitmap=b) for b in (False, True)]
