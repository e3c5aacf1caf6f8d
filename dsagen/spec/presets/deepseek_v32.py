"""DeepSeek-V3.2 (DSA): indexer H=64, D=128, top-k 2048 (compress ratio 1 and 4); sparse MLA with
H=128, d_qk=576, d_v=512. Lists the kernels that exist so far; each new fused op adds its specs here."""

from __future__ import annotations

from ..base import KernelSpec
from ..families import CompactifySpec, LocalToGlobalSpec

NAME = "deepseek-v3.2"
DESCRIPTION = "DeepSeek-V3.2 sparse attention (indexer H64 D128 top-2048; MLA H128 576/512)"


def specs(arch: str) -> list[KernelSpec]:
    return [
        CompactifySpec(arch=arch),
        LocalToGlobalSpec(arch=arch),
    ]
