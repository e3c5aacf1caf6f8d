"""Spec family of the fused sparse indexer score recompute (cuDNN frontend DSA §6, Sparse Indexer Score Recompute).

For query row t and slot j of its top-k (valid: 0 <= id < total_S_k and j < topk_length[t]):
    I[t, j]       = sum_h w[t, h] * relu(q[t, h] . k[id])
    predict[t, j] = softmax over the row's valid slots of sm_scale * I[t, j]     (0 at invalid slots and rows)
The kernel computes both passes: the logits of every slot, then the normalised row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec
from ..sparse_mla.checks import check_grid, dtype_name
from ..sparse_mla.checks import kernel_heads  # noqa: F401  (the family's head padding, read here by its tests)

#: Heads the kernel is built for; the op pads 1..63 heads to 64 and 65..127 to 128 (zero weights).
NATIVE_HEADS = (64, 128)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
_SMEM_LIMIT = 227 * 1024          # the H100 / H200 opt-in limit per CTA
_SMEM_PER_SM = 228 * 1024


@register_spec
@dataclass(frozen=True)
class IndexerScoreRecomputeSpec(KernelSpec):
    """Fused sparse indexer score recompute for Hopper (kernel: indexer_score_recompute/recompute_sm90.py, bound by
    recompute_sm90.py.j2). An item is one query row; a persistent grid of 256-thread CTAs (several per SM) loops over
    the rows. Per row, Q (num_heads x head_dim) is loaded once into shared memory and the row's slots go by in
    64-row tiles that a producer warpgroup gathers with cp.async into a ring of `stages` buffers; the consumer
    warpgroup computes S = K Q^T on wgmma (M = 64 slots, N = num_heads), the weighted ReLU head sum of each slot in
    registers (a quad reduction), writes the logits and keeps an online max and sum, then normalises its row.

    num_heads: heads the kernel is built for (64 or 128; other counts are padded by the host).
    head_dim: q / k width (64 or 128). dtype: q and k dtype ("bfloat16" or "float16").
    stages: gathered 64-row tiles in flight per CTA (2..8, within the shared memory of `ctas_per_sm` CTAs).
    ctas_per_sm: CTAs the launch bound asks to keep resident per SM (1..4; the grid is this many per SM).
    prefetch_ids: the producer loads tile j + 1's ids before it waits for tile j's stage (False: each tile's ids
      just before its gather).
    """

    op = "sparse_indexer_score_recompute"
    template = "indexer_score_recompute/recompute_{arch}.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    stages: int = 4
    ctas_per_sm: int = 2
    prefetch_ids: bool = False

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: Q, the tile ring, ids, barriers and row statistics (upper bound)."""
        return 2 * (self.num_heads + 64 * self.stages) * self.head_dim + 1024 + 4 * 64 * self.stages + 256 + 1024

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"arch {self.arch!r}: the fused sparse indexer score recompute exists for sm_90a only (Hopper "
                       f"wgmma); use impl='reference' elsewhere")
        if self.num_heads not in NATIVE_HEADS:
            out.append(f"num_heads={self.num_heads} must be 64 or 128 (the op pads fewer heads)")
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim={self.head_dim} must be 64 or 128")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} must be 'bfloat16' or 'float16'")
        if not 2 <= self.stages <= 8:
            out.append(f"stages={self.stages} must be in 2..8")
        if self.ctas_per_sm not in (1, 2, 3, 4):
            out.append(f"ctas_per_sm={self.ctas_per_sm} must be one of 1, 2, 3, 4")
        elif self.num_heads in NATIVE_HEADS and self.head_dim in HEAD_DIMS and 2 <= self.stages <= 8:
            need = self.smem_bytes()
            if need > _SMEM_LIMIT or self.ctas_per_sm * (need + 1024) > _SMEM_PER_SM:
                out.append(f"stages={self.stages}: {self.ctas_per_sm} CTA(s) of {need} bytes of shared memory do not "
                           f"fit an SM ({_SMEM_PER_SM} bytes, at most {_SMEM_LIMIT} per CTA)")
        return out


@dataclass(frozen=True)
class IndexerScoreRecomputeConfig:
    """The launch choices of the fused indexer score recompute: the tile ring depth and CTAs per SM (spec fields),
    and the grid ("persistent": ctas_per_sm CTAs per SM, or an int n: at most n CTAs)."""

    stages: int = 4
    ctas_per_sm: int = 2
    grid: str | int = "persistent"
    prefetch_ids: bool = False

    def __post_init__(self) -> None:
        check_grid(self.grid, "IndexerScoreRecomputeConfig")

    def spec(self, num_heads: int, head_dim: int, dtype, arch: str = "sm_90a") -> IndexerScoreRecomputeSpec:
        """The kernel spec of this config for a kernel of `num_heads` (64 or 128) heads."""
        return IndexerScoreRecomputeSpec(arch=arch, num_heads=num_heads, head_dim=head_dim,
                                         dtype=dtype_name(dtype), stages=self.stages,
                                         ctas_per_sm=self.ctas_per_sm, prefetch_ids=self.prefetch_ids)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(rows, n_ctas))."""
        return self.ctas_per_sm * num_sms if self.grid == "persistent" else self.grid


def config_for(num_heads: int, head_dim: int, dtype, arch: str, num_sms: int | None) -> IndexerScoreRecomputeConfig:
    """The config the op runs for `num_heads` (padded to 64 or 128), `head_dim`, `dtype` on `arch`. 64 heads: 2
    stages and three CTAs per SM, whose 12 producer warps per SM gather more rows at once than two CTAs' 8, and each
    tile's ids loaded a tile ahead (prefetch_ids; two interleaved runs on an H200, 2026-12-02, ms without -> with it:
    T 4096 0.434 -> 0.422 and 0.399 -> 0.400, with a 131072-row pool 0.427 -> 0.406 and 0.412 -> 0.410, T 32768
    3.259 -> 3.157 and 3.133 -> 3.108). Two producer warpgroups per CTA at two CTAs per SM were 1.09-1.19x slower
    than this (2026-12-02; at three CTAs per SM ptxas cannot fit the consumer's wgmma in the launch's 56 registers).
    The stages and CTAs (H200, 2026-12-02, H64 / D128 / top-k 2048, two runs timed interleaved, ms for 4 x 2 / 2 x 3
    / 2 x 4 / 3 x 3): T 4096 0.470 / 0.411 / 0.413 / 0.417 and 0.462 / 0.397 / 0.413 / 0.405; with a 131072-row pool
    0.485 / 0.422 / 0.436 / 0.448 and 0.475 / 0.422 / 0.446 / 0.443; T 32768 3.652 / 3.242 / 3.081 / 3.205 and 3.576
    / 3.191 / 3.123 / 3.179. In one causal training step (bench/dsa_training_step.py, T 4096) the stage took 0.489 ms
    at 2 x 3 and 0.669 at 2 x 4 (separate runs). 128 heads: 4 stages and two CTAs per SM (its kernel takes 120
    registers; three CTAs per SM leave 85)."""
    if num_heads == 64:
        return IndexerScoreRecomputeConfig(stages=2, ctas_per_sm=3, prefetch_ids=True)
    return IndexerScoreRecomputeConfig()
