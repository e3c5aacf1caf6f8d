"""Spec family of the fused sparse MLA attention forward (cuDNN frontend DSA §1 Sparse Attention Forward, DeepSeek-V4 inference kernel).

One kernel computes, for every query row t and head h,
    out[t, h]   = sum_j p_j * kv[idx[t, j], :d_v] / (sum_j p_j + exp(sink[h] - m))
    p_j         = exp(scale * q[t, h] . kv[idx[t, j]] - m),  m = max_j of the scaled scores
    lse[t, h]   = m + log(sum_j p_j)          (KV only: the sink is not in it)
    max_logits  = m
over the valid slots j of the row (0 <= id < total_S_kv and j < topk_length[t]).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec, warps_per_cta_reasons
from .checks import check_grid, dtype_name, grid_ctas, mla_shape_reasons, register_budget_reasons
from .checks import kernel_heads  # noqa: F401  (the model config's head padding reads it here)


@register_spec
@dataclass(frozen=True)
class SparseAttnFwdSpec(KernelSpec):
    """Fused sparse MLA forward for Hopper (kernel: sparse_mla/fwd_sm90.py, bound by fwd_sm90.py.j2): FlashMLA's SM90 sparse
    prefill protocol. Tiles go in pairs: consumer A (WG1) does QK^T + softmax of the even tile, consumer B (WG2) of
    the odd one, and each accumulates its half of O over both; per-half-stage ready / free mbarriers (a stage's left
    half V[:, :256] and right half are refilled as soon as the consumer that reads them last is done: V0L, V1R, V0R,
    V1L), an asymmetric max exchange (A runs its softmax with its own running max and issues its PV at once, then
    rescales P and O by the pair max from B), the next pair's QK^T issued before the last PV of the pair retires, and
    validity bytes the producer writes per pair. The CTAs loop over the items (query row, 64 heads) of a grid of
    min(items, n_ctas) CTAs, n_ctas a run-time argument (SparseAttnFwdConfig.grid). The epilogue writes O as
    16-byte stores after a 4 x 4 word transpose over each quad; Q loads and O stores carry an L2 evict_first policy.

    num_heads: query heads the kernel is built for (64 or 128; 64 heads per item).
      Other head counts are padded to 64 or 128 by dsagen.kernels.sparse_mla.host.
    d_qk: query/key width (512, or 576 = 512 latent + 64 RoPE); the whole width is scored.
    d_v: value/output width: the first d_v columns of each gathered row (512).
    dtype: q, kv and out dtype ("bfloat16" or "float16").
    block_n: gathered rows per pipeline stage (64).
    stages: KV stages in shared memory (2; a 64 x 576 stage is 72 KiB).
    regs_producer / regs_qk / regs_pv: setmaxnreg budgets of the three warpgroups (producer, consumer A = WG1,
      consumer B = WG2). The defaults are the op's (SparseAttnFwdConfig).
    lse_prefix: also write lse_prefix, the KV-only LSE over each row's first n_prefix slots (cuDNN frontend DSA §1's
      lse_indexer; n_prefix a run-time multiple of 128: each consumer keeps its running max and row sum after the
      prefix's last pair of tiles). Two more kernel parameters (lse_prefix, n_prefix); False builds the kernel
      without them.
    kv_fp8: kv is DeepSeek-V3.2's FP8 cache (reference.kv_cache: 656-byte rows of 512 E4M3 values, 4 FP32 scales,
      64 bf16 RoPE values; kv a uint8 pointer, ld_kv in bytes), dequantized to bf16 by the producer warpgroup into the
      stages the BF16 kernel gathers into (d_qk 576, bfloat16 only).
    split_kv: each item is (query row, 64 heads, one of n_splits ranges of split_slots slots; both run-time
      arguments), and out / lse are FP32 partials of the (row, range) rows, O / its own row sum with no sink and its
      KV-only LSE (+inf: no valid slot), which SparseAttnCombineSpec's kernel merges (the decode's split over the KV
      slots when the rows alone leave SMs idle; sparse_attention_decode). Not with lse_prefix.
    shared_dequant: (kv_fp8, num_heads 128) the two CTAs of a cluster of two run a row's two head blocks and share
      the dequantization: each dequantizes half of every tile's rows into its own stage and, by st.async, into its
      partner's (FlashMLA's "crossover"), which frees its own half of the producer's work; items go (row, head block)
      with the head block fastest in both the whole-row and the split forms; the grid is a multiple of two.

    Sequence lengths, top-k width, KV pool size, softmax scale and the CTA count are run-time arguments.
    """

    op = "sparse_attention_fwd"
    template = "sparse_mla/fwd_{arch}.py.j2"

    num_heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    dtype: str = "bfloat16"
    block_n: int = 64
    stages: int = 2
    regs_producer: int = 48
    regs_qk: int = 232
    regs_pv: int = 224
    lse_prefix: bool = False
    kv_fp8: bool = False
    split_kv: bool = False
    shared_dequant: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons() + mla_shape_reasons("sparse attention forward", self.arch, self.num_heads, self.d_qk)
        if not isinstance(self.shared_dequant, bool):
            out.append(f"shared_dequant={self.shared_dequant!r} must be a bool")
        elif self.shared_dequant and not (self.kv_fp8 is True and self.num_heads == 128):
            out.append(f"shared_dequant=True takes kv_fp8=True and num_heads=128 (a row's two head blocks share the "
                       f"dequantization), got kv_fp8={self.kv_fp8!r}, num_heads={self.num_heads}")
        if not isinstance(self.kv_fp8, bool):
            out.append(f"kv_fp8={self.kv_fp8!r} must be a bool")
        elif self.kv_fp8 and (self.d_qk != 576 or self.dtype != "bfloat16"):
            out.append(f"kv_fp8=True takes d_qk=576 and dtype='bfloat16' (the FP8 cache's rows), got d_qk={self.d_qk}, "
                       f"dtype={self.dtype!r}")
        if not isinstance(self.split_kv, bool):
            out.append(f"split_kv={self.split_kv!r} must be a bool")
        elif self.split_kv and self.lse_prefix:
            out.append("split_kv=True does not take lse_prefix=True (the prefix LSE is a whole row's)")
        if self.d_v != 512:
            out.append(f"d_v={self.d_v} must be 512 (two 256-column halves, one per consumer warpgroup)")
        if self.dtype not in ("bfloat16", "float16"):
            out.append(f"dtype={self.dtype!r} must be 'bfloat16' or 'float16'")
        if self.block_n != 64:
            out.append(f"block_n={self.block_n} must be 64 (the P tile aliases a 64 x 64 RoPE tile)")
        if not isinstance(self.lse_prefix, bool):
            out.append(f"lse_prefix={self.lse_prefix!r} must be a bool")
        if self.stages != 2:
            out.append(f"stages={self.stages} must be 2 (two 64-row stages plus Q fill shared memory)")
        out.extend(register_budget_reasons({"regs_producer": self.regs_producer, "regs_qk": self.regs_qk,
                                            "regs_pv": self.regs_pv}))
        return out


COMBINE_MAX_SPLITS = 32     # slot ranges per row the combine kernel merges (one per lane of its warp)


@register_spec
@dataclass(frozen=True)
class SparseAttnCombineSpec(KernelSpec):
    """The split-KV combine of the sparse MLA decode (kernel: sparse_mla/combine.py, bound by combine.py.j2): the
    split_kv forward's FP32 partials of each (row, head) merged by their LSEs (the sink in the denominator) into bf16
    out and the KV-only LSE. One warp per (row, head); up to 32 ranges per row.

    d_v: values per row (512). warps_per_cta: (row, head) pairs per CTA (1, 2, 4, 8, 16 or 32)."""

    op = "sparse_attention_combine"
    template = "sparse_mla/combine.py.j2"

    d_v: int = 512
    warps_per_cta: int = 4

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.d_v != 512:
            out.append(f"d_v={self.d_v!r} must be 512")
        out.extend(warps_per_cta_reasons(self.warps_per_cta))
        return out


@dataclass(frozen=True)
class SparseAttnFwdConfig:
    """Every measured launch and tile choice of the fused sparse MLA forward (notes/kernels/sparse_attention.md):
    the code-changing ones become SparseAttnFwdSpec fields (spec()), the grid is a launch argument (n_ctas()).
    config_for picks the op's; a benchmark or test that tries a variant passes dataclasses.replace(config, ...) to
    dsagen.kernels.sparse_mla.host.sparse_attention(..., config=...).

    block_n, stages: gathered rows per stage (64) and stages (2): 2 x 72 KiB at D576 next to Q's 72 KiB.
    regs_producer / regs_qk / regs_pv: setmaxnreg budgets, 48 + 232 + 224 = 504, the launch's 3 x 168 registers. The
      producer keeps both tiles' ids over a pair (40 spills ~23 values in its loop, 48 ~12); consumer A holds the
      most (O, S, P and the next tile's QK^T), B the least.
    grid: "persistent" (one CTA per SM, each looping over the items) or an int n (at most n CTAs; n >= the item
      count runs one CTA per item). Persistent measured 1.02-1.05x one CTA per item at H128 and, with the 16-byte O
      stores, 1.02-1.03x at H64 (H200, 2026-11-29).
    shared_dequant: the FP8 cache's 128-head kernels pair a row's two head blocks in a cluster that shares the
      dequantization (SparseAttnFwdSpec.shared_dequant); the other kernels ignore it.
    """

    block_n: int = 64
    stages: int = 2
    regs_producer: int = 48
    regs_qk: int = 232
    regs_pv: int = 224
    grid: str | int = "persistent"
    shared_dequant: bool = False

    def __post_init__(self) -> None:
        check_grid(self.grid, "SparseAttnFwdConfig")

    def spec(self, num_heads: int, d_qk: int, dtype, arch: str = "sm_90a", d_v: int = 512,
             lse_prefix: bool = False, kv_fp8: bool = False, split_kv: bool = False) -> SparseAttnFwdSpec:
        """The kernel spec of this config for a kernel of `num_heads` (64 or 128) heads; lse_prefix: the kernel that
        also writes the LSE over each row's first n_prefix slots; kv_fp8: the kernel that reads the FP8 cache;
        split_kv: the kernel whose items are slot ranges of a row (FP32 partial outputs)."""
        return SparseAttnFwdSpec(arch=arch, num_heads=num_heads, d_qk=d_qk, d_v=d_v, dtype=dtype_name(dtype),
                                 block_n=self.block_n, stages=self.stages, regs_producer=self.regs_producer,
                                 regs_qk=self.regs_qk, regs_pv=self.regs_pv, lse_prefix=bool(lse_prefix),
                                 kv_fp8=bool(kv_fp8), split_kv=bool(split_kv),
                                 shared_dequant=bool(self.shared_dequant and kv_fp8 and num_heads == 128))

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(items, n_ctas)); even when
        shared_dequant may pair CTAs into clusters of two (the items then come in pairs too)."""
        n = grid_ctas(self.grid, num_sms)
        return max(2, n - n % 2) if self.shared_dequant else n


# the FP8 cache kernel's budgets: its dequantizing producer spills 29 values at 48 registers, 3 at 56 (CPU compile,
# 2026-12-04); consumer A at 224 keeps the same wgmma waits as at 232. At 128 heads a cluster of two shares the
# dequantization: 1.03-1.20x the one-CTA kernel at B 1-128 (H200, 2026-12-05, bench/sparse_attention_decode.py)
FP8_CACHE_CONFIG = SparseAttnFwdConfig(regs_producer=56, regs_qk=224, regs_pv=224, shared_dequant=True)


def config_for(num_heads: int, d_qk: int, dtype, rows: int | None, arch: str, num_sms: int | None,
               kv_fp8: bool = False) -> SparseAttnFwdConfig:
    """The config the op runs for `num_heads` query heads (padded to 64 or 128), `d_qk`, `dtype`, `rows` query rows
    (None: any) on `arch` with `num_sms` SMs (None: any). One config for every shape, call size and SM count: the
    same budgets, tiles and persistent grid measured fastest at H64 / H128, D 512 / 576, prefill and decode (H200,
    2026-11-29; notes/kernels/sparse_attention.md); kv_fp8 (the FP8 cache's decode): FP8_CACHE_CONFIG."""
    return FP8_CACHE_CONFIG if kv_fp8 else SparseAttnFwdConfig()
