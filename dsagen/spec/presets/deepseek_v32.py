"""DeepSeek-V3.2 (DSA): indexer H=64, D=128, top-k 2048 (compress ratio 1 and 4); sparse MLA with
H=128, d_qk=576, d_v=512. Lists the kernels that exist so far; each new fused op adds its specs here."""

from __future__ import annotations

from ..base import KernelSpec
from ...kernels.indices.spec import CompactifySpec, LocalToGlobalSpec
from ...kernels.lightning_indexer.spec import config_for as indexer_config
from ...kernels.sparse_mla.spec import config_for

NAME = "deepseek-v3.2"
DESCRIPTION = "DeepSeek-V3.2 sparse attention (indexer H64 D128 top-2048; MLA H128 576/512)"


def specs(arch: str) -> list[KernelSpec]:
    out: list[KernelSpec] = [
        CompactifySpec(arch=arch),
        LocalToGlobalSpec(arch=arch),
        # lightning indexer H=64, D=128, bf16: one score kernel + the top-k plan's kernels (indexer_config)
        # serve topk 2048 and compress ratios 1 and 4 (topk, causal and ratio are run-time arguments);
        # sm_90a only so far.
        *(indexer_config(64, 128, "bfloat16", arch).specs() if arch == "sm_90a" else ()),
    ]
    if arch == "sm_90a":  # the fused sparse MLA forward exists for Hopper only (MLA H128, 576/512)
        # the op's kernel for prefill and decode alike (config_for: one config for every call size)
        out.append(config_for(128, 576, "bfloat16", None, arch, None).spec(128, 576, "bfloat16", arch))
    return out
