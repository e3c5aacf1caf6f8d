"""Query sparse attention (QSA) at FlashInfer QSA's shapes: 12 / 1 and 24 / 2 query / KV heads (G 12), head dims 256,
bf16. The kernels: the indexed and the bitmap form's forward and, unless serving, each form's backward (dq and
dk / dv)."""

from __future__ import annotations

from ...kernels.qsa.spec import backward_specs_for, spec_for
from ..base import KernelSpec

NAME = "qsa"
DESCRIPTION = "QSA (Hq / Hkv 12 / 1 and 24 / 2, D 256, bf16; the indexed and the bitmap forward and backward)"


def specs(arch: str, serving: bool = False) -> list[KernelSpec]:
    """The QSA kernels that exist on `arch` (sm_90a only so far); serving leaves out the backward's."""
    if arch != "sm_90a":
        return []
    out: list[KernelSpec] = [spec_for(12, 256, 256, "bfloat16", arch, bitmap=b) for b in (False, True)]
    if not serving:
        out += [s for b in (False, True) for s in backward_specs_for(12, 256, 256, "bfloat16", arch, bitmap=b)]
    return out
