"""Native sparse attention (NSA) at the NSA paper's benchmark shape: 64 query heads over 4 KV heads (and the small
group of 16 over 4), head dims 128, blocks of 64 tokens, 16 selected blocks, bf16 and fp16. The kernels: the selected
branch's forward, the compressed branch's forward (its attention over up to 1024 compressed rows, i.e. sequences up
to 65536 tokens, the blocks' importance and their selection) and, unless serving, both branches' backward (dq and
dk / dv)."""

from __future__ import annotations

from ...kernels.nsa.spec import (NsaCmpDkvSpec, NsaCmpTopkSpec, NsaSelectDkvSpec, cmp_dq_spec_for, cmp_fwd_spec_for,
                                 cmp_importance_spec_for, select_dq_spec_for, select_fwd_spec_for)
from ..base import KernelSpec

NAME = "nsa"
DESCRIPTION = "NSA (HQ 64 / 16 over H 4, D 128, blocks of 64, 16 slots; selected and compressed forward, backward)"


def specs(arch: str, serving: bool = False) -> list[KernelSpec]:
    """The NSA kernels that exist on `arch` (sm_90a only so far); serving leaves out the backward's."""
    if arch != "sm_90a":
        return []
    out: list[KernelSpec] = []
    for g in (16, 4):
        for dtype in ("bfloat16", "float16"):
            out += [select_fwd_spec_for(g, 128, 128, 64, 16, dtype, arch),
                    cmp_fwd_spec_for(g, 128, 128, 16, dtype, arch),
                    cmp_importance_spec_for(g, 128, 16, dtype, arch)]
            if not serving:
                out += [select_dq_spec_for(g, 128, 128, 64, 16, dtype, arch),
                        NsaSelectDkvSpec(arch=arch, group=g, dtype=dtype),
                        cmp_dq_spec_for(g, 128, 128, 16, dtype, arch),
                        NsaCmpDkvSpec(arch=arch, group=g, dtype=dtype)]
    return out + [NsaCmpTopkSpec(arch=arch)]
