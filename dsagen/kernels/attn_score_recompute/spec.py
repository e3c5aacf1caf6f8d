"""Spec family of the fused sparse attention score recompute (cuDNN frontend DSA §7).

For query row t and slot j of its top-k (valid: 0 <= id < total_S_kv and j < topk_length[t]):
    S[t, j]      = sum_h exp(scale * q[t, h] . kv[id] - lse[t, h])      (0 at invalid slots)
    target[t, j] = S[t, j] / sum_j S[t, j]                              (all zeros when that sum is 0)
The kernel writes S; the host divides by the row sums (a fixed-order torch reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec
from ..sparse_mla.checks import check_grid, dtype_name, grid_ctas, mla_shape_reasons, register_budget_reasons


def recompute_reasons(spec, what: str) -> list[str]:
    """Why a score recompute spec (sparse or dense form; fields num_heads, d_qk, dtype, regs_producer,
    regs_consumer) cannot be built: the MLA shape, the dtype and the three warpgroups' register budgets."""
    out = mla_shape_reasons(what, spec.arch, spec.num_heads, spec.d_qk)
    if spec.dtype not in ("bfloat16", "float16"):
        out.append(f"dtype={spec.dtype!r} must be 'bfloat16' or 'float16'")
    out.extend(register_budget_reasons({"regs_producer": spec.regs_producer,
                                        "regs_consumer (WG1)": spec.regs_consumer,
                                        "regs_consumer (WG2)": spec.regs_consumer}))
    return out


@register_spec
@dataclass(frozen=True)
class AttnScoreRecomputeSpec(KernelSpec):
    """Fused sparse attention score recompute for Hopper (kernel: attn_score_recompute/recompute_sm90.py, bound by
    recompute_sm90.py.j2). An item is one query row with all its heads; a persistent grid of CTAs loops over the
    rows; per row Q (num_heads x d_qk) stays in shared memory and the row's slots go by in 64-row tiles gathered by a
    producer warpgroup, block by block of 64 columns, into the KV stages (one at 128 heads, two at 64). Two consumer
    warpgroups take alternate tiles, each for all heads: S = Q K^T on wgmma, then P = exp2(S scale log2 e - lse
    log2 e), masked, summed over the heads (warp shuffles, then the warps' partial sums in shared memory), while the
    other consumer's wgmmas run.

    num_heads: query heads the kernel is built for (64 or 128; other counts are padded by the host).
    d_qk: query/key width (512 or 576). dtype: q and kv dtype ("bfloat16" or "float16").
    regs_producer / regs_consumer: setmaxnreg budgets of WG0 and of each consumer warpgroup.
    prefetch_ids: the producer loads tile j + 1's ids before it waits for tile j's stage (False: each tile's ids
      just before its gather).
    """

    op = "sparse_attn_score_recompute"
    template = "attn_score_recompute/recompute_{arch}.py.j2"

    num_heads: int = 128
    d_qk: int = 576
    dtype: str = "bfloat16"
    regs_producer: int = 88
    regs_consumer: int = 208
    prefetch_ids: bool = False

    def reasons(self) -> list[str]:
        return super().reasons() + recompute_reasons(self, "score recompute")


@register_spec
@dataclass(frozen=True)
class DenseAttnScoreRecomputeSpec(KernelSpec):
    """Fused dense attention score recompute for Hopper (cuDNN frontend DSA §8; kernel:
    attn_score_recompute/dense_sm90.py, bound by dense_sm90.py.j2): the sparse form's kernel with each query row's
    visible keys (the ratio-causal limit with per-batch q_causal_offsets) as its consecutive tiles, the dense
    [rows, S] output (-inf past the visible keys) and each row's denominator (the sum of its visible entries,
    reduced in a fixed order). Fields as AttnScoreRecomputeSpec's (no prefetch_ids: the ids are computed);
    budgets 96 / 200: the producer computes its ids and spilled 2 registers at the sparse form's 88 (CPU compile,
    H 128 D 576).

    row_pairs (num_heads 64 only): each CTA item is two consecutive query rows of a batch element, their 2 x 64
    heads one N = 128 operand of resident Q, so each key tile feeds both rows (half the key traffic per FLOP).
    """

    op = "dense_attn_score_recompute"
    template = "attn_score_recompute/dense_{arch}.py.j2"

    num_heads: int = 128
    d_qk: int = 576
    dtype: str = "bfloat16"
    regs_producer: int = 96
    regs_consumer: int = 200
    row_pairs: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons() + recompute_reasons(self, "dense score recompute")
        if self.row_pairs and self.num_heads != 64:
            out.append(f"row_pairs needs num_heads=64 (two rows' heads make the N = 128 operand), got "
                       f"{self.num_heads}")
        return out


@dataclass(frozen=True)
class AttnScoreRecomputeConfig:
    """The launch choices of the fused score recompute: register budgets (spec fields) and the grid ("persistent",
    one CTA per SM, or an int n: at most n CTAs)."""

    regs_producer: int = 88
    regs_consumer: int = 208
    grid: str | int = "persistent"
    prefetch_ids: bool = False

    def __post_init__(self) -> None:
        check_grid(self.grid, "AttnScoreRecomputeConfig")

    def spec(self, num_heads: int, d_qk: int, dtype, arch: str = "sm_90a") -> AttnScoreRecomputeSpec:
        """The kernel spec of this config for a kernel of `num_heads` (64 or 128) heads."""
        return AttnScoreRecomputeSpec(arch=arch, num_heads=num_heads, d_qk=d_qk, dtype=dtype_name(dtype),
                                      regs_producer=self.regs_producer, regs_consumer=self.regs_consumer,
                                      prefetch_ids=self.prefetch_ids)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(rows, n_ctas))."""
        return grid_ctas(self.grid, num_sms)


def config_for(num_heads: int, d_qk: int, dtype, arch: str, num_sms: int | None) -> AttnScoreRecomputeConfig:
    """The config the op runs for `num_heads` (padded to 64 or 128), `d_qk`, `dtype` on `arch`. 64 heads at D 512
    load each tile's ids a tile ahead (prefetch_ids): 1.414 -> 1.375 ms at T 4096 / KV 32768, where 128 heads at D 576
    were slower with it (2.407 -> 2.459 ms; H200, 2026-12-02, timed interleaved)."""
    if num_heads == 64 and d_qk == 512:
        return AttnScoreRecomputeConfig(prefetch_ids=True)
    return AttnScoreRecomputeConfig()


@dataclass(frozen=True)
class DenseAttnScoreRecomputeConfig:
    """The launch choices of the fused dense score recompute: register budgets (spec fields), the grid
    ("persistent", one CTA per SM, or an int n: at most n CTAs) and row_pairs (the spec field; used by kernels of
    64 heads, ignored at 128)."""

    regs_producer: int = 96
    regs_consumer: int = 200
    grid: str | int = "persistent"
    row_pairs: bool = False

    def __post_init__(self) -> None:
        check_grid(self.grid, "DenseAttnScoreRecomputeConfig")

    def spec(self, num_heads: int, d_qk: int, dtype, arch: str = "sm_90a") -> DenseAttnScoreRecomputeSpec:
        """The kernel spec of this config for a kernel of `num_heads` (64 or 128) heads."""
        return DenseAttnScoreRecomputeSpec(arch=arch, num_heads=num_heads, d_qk=d_qk, dtype=dtype_name(dtype),
                                           regs_producer=self.regs_producer, regs_consumer=self.regs_consumer,
                                           row_pairs=self.row_pairs and num_heads == 64)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(rows, n_ctas))."""
        return grid_ctas(self.grid, num_sms)


def dense_config_for(num_heads: int, d_qk: int, dtype, arch: str, num_sms: int | None
                     ) -> DenseAttnScoreRecomputeConfig:
    """The config the dense op runs: the sparse form's budgets; at 64 heads two query rows per item (row_pairs):
    H 64 D 512 0.858 / 13.41 ms against one row's 1.105 / 18.48 at T 4096 / 16384 (cuDNN 1.196 / 17.74; H200,
    2026-12-03, bench/dense_attn_recompute.py --one-row). num_heads: the kernel's (64 or 128)."""
    return DenseAttnScoreRecomputeConfig(row_pairs=num_heads == 64)
