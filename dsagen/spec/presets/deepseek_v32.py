"""DeepSeek-V3.2 (DSA): indexer H=64, D=128, top-k 2048 (compress ratio 1 and 4); sparse MLA with
H=128, d_qk=576, d_v=512. The kernels are those of `specs_for_model` (dsagen.spec.model_config) for these
attention fields, so the preset and `dsagen build --model` of DeepSeek-V3.2's config.json build the same set;
a new fused op adds its specs to `specs_for_model`."""

from __future__ import annotations

from ..base import KernelSpec
from ..model_config import DEEPSEEK_V32, specs_for_model

NAME = "deepseek-v3.2"
DESCRIPTION = "DeepSeek-V3.2 sparse attention (indexer H64 D128 top-2048; MLA H128 576/512)"


def specs(arch: str, serving: bool = False) -> list[KernelSpec]:
    """Every kernel DeepSeek-V3.2's sparse attention needs on `arch` (those that exist there so far); serving: only
    those a serving deployment runs (no training kernels)."""
    return specs_for_model(DEEPSEEK_V32, arch, serving)
