"""Spec family of the fused sparse MLA attention backward (cuDNN frontend DSA §2 Sparse Attention Backward).

With the forward's KV-only lse and the per-head sink in the denominator only, for every query row t, head h and
valid slot j (0 <= id < total_S_kv and j < topk_length[t]):
    lse_s[t, h] = logaddexp(lse[t, h], sink[h])           (lse alone without a sink; +inf stays +inf)
    P[t, h, j]  = exp(scale * q[t, h] . kv[id] - lse_s)
    delta[t, h] = sum_d out[t, h, d] * dout[t, h, d]
    dS[t, h, j] = scale * P * (dout[t, h] . kv[id, :d_v] - delta)
    dq[t, h]    = sum_j dS[t, h, j] * kv[id]
    dkv[id]    += sum_h P[t, h, j] * dout[t, h] (columns < d_v) + dS[t, h, j] * q[t, h]
    d_sink[h]   = -sum_t exp(sink[h] - lse_s[t, h]) * delta[t, h]     (host side, from the kernel's delta)
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import WARPS_PER_CTA, KernelSpec, register_spec
from ..sparse_mla.checks import check_grid, dtype_name, grid_ctas, mla_shape_reasons, register_budget_reasons

@register_spec
@dataclass(frozen=True)
class SparseAttnBwdSpec(KernelSpec):
    """Fused sparse MLA backward for Hopper (kernel: sparse_mla_bwd/bwd_sm90.py, bound by bwd_sm90.py.j2). An item
    is (query row, 64 heads); a persistent grid of CTAs loops over the items; per item Q and dO stay in shared
    memory and the item's top-k slots go by in 64-row tiles gathered by a producer warpgroup (cp.async, zero-filled
    for invalid ids) into one KV stage. Consumer A (WG1) computes S = Q K^T, P, dQ[:, 256:] += dS K[:, 256:] and
    the dKV column chunks 0..3; consumer B (WG2) delta, dP = dO V^T, dS, dQ[:, :256] += dS K[:, :256] and the
    chunks 4..; a chunk is dKV[rows, 64 columns] = P^T dO + dS^T Q. The KV stage is refilled while the consumers
    compute the dKV chunks (they read only Q, dO, P and dS).

    num_heads: query heads the kernel is built for (64 or 128; 64 heads per item). Other head counts are padded
      to 64 or 128 by dsagen.kernels.sparse_mla_bwd.host.
    d_qk: query/key width (512, or 576 = 512 latent + 64 RoPE). d_v: value width, the first d_v columns (512).
    dtype: q, kv, out, dout and dq dtype ("bfloat16" or "float16").
    deterministic: False: the dKV chunks go to an FP32 (total_S_kv, d_qk) accumulator by FP32 atomic adds.
      True: no atomics; chunk rows are stored per (item, slot) into a (total_S_q * num_heads / 64, topk, d_qk)
      FP32 buffer that the host sums per id in a fixed order.
    regs_producer / regs_a / regs_b: setmaxnreg budgets of WG0, WG1 and WG2 (the op's: SparseAttnBwdConfig).
    chunk_buffers_a: dKV chunk accumulators of consumer A, 1 or 2 (B has 2: the next chunk's wgmmas are issued
      before the previous chunk's atomics).
    dkv_l2_evict_last: the dKV atomics carry an L2 evict_last cache policy (as cuDNN frontend's SM90 backward's do);
      False: no cache hint.

    Sequence lengths, top-k width, KV pool size, softmax scale and the CTA count are run-time arguments.
    """

    op = "sparse_attention_bwd"
    template = "sparse_mla_bwd/bwd_{arch}.py.j2"

    num_heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    dtype: str = "bfloat16"
    deterministic: bool = False
    regs_producer: int = 40
    regs_a: int = 240
    regs_b: int = 224
    chunk_buffers_a: int = 1
    dkv_l2_evict_last: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons() + mla_shape_reasons("sparse attention backward", self.arch, self.num_heads,
                                                    self.d_qk)
        if self.d_v != 512:
            out.append(f"d_v={self.d_v} must be 512")
        if self.dtype not in ("bfloat16", "float16"):
            out.append(f"dtype={self.dtype!r} must be 'bfloat16' or 'float16'")
        if not isinstance(self.deterministic, bool):
            out.append(f"deterministic={self.deterministic!r} must be a bool")
        if isinstance(self.chunk_buffers_a, bool) or self.chunk_buffers_a not in (1, 2):
            out.append(f"chunk_buffers_a={self.chunk_buffers_a!r} must be 1 or 2")
        out.extend(register_budget_reasons({"regs_producer": self.regs_producer, "regs_a": self.regs_a,
                                            "regs_b": self.regs_b}))
        return out


@register_spec
@dataclass(frozen=True)
class SparseAttnBwdOrderSpec(KernelSpec):
    """The backward's window ordering (kernel: sparse_mla_bwd/order.py, bound by order.py.j2): each row's valid ids
    ordered by their KV window id // bucket_rows (stable), then -1, and each row's slot window, on the device
    (SparseAttnBwdConfig.bucket_rows says why; host.slot_windows launches it).

    warps_per_cta: rows per CTA (one warp each; a power of two in 1..32). max_windows: the most windows a call may
    use (a multiple of 32 in 32..4096: a counter per window and warp in shared memory); a pool of more windows gets
    wider windows (host.slot_windows).

    The row width, the row count, n_kv and bucket_rows are run-time arguments.
    """

    op = "sparse_attention_bwd_order"
    template = "sparse_mla_bwd/order.py.j2"

    warps_per_cta: int = 16
    max_windows: int = 256

    def reasons(self) -> list[str]:
        out = super().reasons()
        warps_ok = self.warps_per_cta in WARPS_PER_CTA
        if not warps_ok:
            out.append(f"warps_per_cta={self.warps_per_cta} must be one of 1, 2, 4, 8, 16, 32")
        mw = self.max_windows
        if isinstance(mw, bool) or not isinstance(mw, int) or mw % 32 or not 32 <= mw <= 4096:
            out.append(f"max_windows={mw!r} must be a multiple of 32 in 32..4096")
        elif warps_ok and self.warps_per_cta * mw * 4 > 48 * 1024:
            out.append(f"warps_per_cta * max_windows * 4 = {self.warps_per_cta * mw * 4} bytes of shared memory "
                       f"exceeds 48 KB")
        return out


@dataclass(frozen=True)
class SparseAttnBwdConfig:
    """Every launch choice of the fused sparse MLA backward: the register budgets become SparseAttnBwdSpec fields
    (spec()), the grid is a launch argument (n_ctas()). config_for picks the op's; a benchmark or test that tries
    a variant passes dataclasses.replace(config, ...) to dsagen.kernels.sparse_mla_bwd.host.

    regs_producer / regs_a / regs_b: setmaxnreg budgets, 40 + 232 + 232 = 504, the launch's 3 x 168 registers.
      Consumer A holds dQ[:, 256:] (160 FP32 at D576) next to its S / chunk accumulator, B dQ[:, :256] (128) next
      to dP and dS; the producer only computes addresses. At 40 / 240 / 224 ptxas serialized every wgmma of the
      deterministic D576 kernels (C7512: one WARPGROUP.DEPBAR per HGMMA); at 232 / 232 no form is serialized and
      none spills more. Same process on the H200 (2026-12-04, T 4096, KV 32768, topk 2048, outputs bitwise equal):
      H128 / D576 deterministic 37.54 against 39.35 ms, atomic 15.25 / 15.41; H64 / D512 deterministic 17.54 /
      17.36, atomic 7.27 / 7.27.
    chunk_buffers_a: consumer A's dKV chunk accumulators (SparseAttnBwdSpec), 1 (the op's) or 2. Two spill at A's
      240 registers (150 spill instructions, 23.14 ms at the headline shape); with budgets 24 / 256 / 224 they pass
      the GPU suites but gain nothing in one process: 16.33 against 16.40 ms at the headline shape, and 9.28 against
      7.48 ms at H64 / D512 (H200, 2026-12-02), so the op keeps 1.
    grid: "persistent" (one CTA per SM, each looping over the items) or an int n (at most n CTAs).
    bucket_rows: KV rows per window (None: no ordering). Each row's valid ids are ordered by the window of their id
      (stable; the SparseAttnBwdOrderSpec kernel, at most 256 windows: a larger pool gets wider windows), so the
      CTAs, which walk their items in step, add into about one window's rows of the FP32 dKV accumulator at a
      time: 4096 rows x 576 x 4 B = 9.4 MB stays in L2, where the whole
      accumulator (75 MB at 32768 rows) does not (H200, 2026-12-01, T 4096 / H128 / D576 / KV 32768: 17.4 ms with
      4096-row windows and the grid barrier, 17.5 with 8192, 18.2 with 16384, 20.4 unordered with the barrier,
      22.0 unordered without it; notes/kernels/sparse_attention_backward.md).
    deterministic_chunk_bytes: the most bytes of the deterministic mode's per-slot buffer (query rows per launch
      follow from it, at least one). 1 GiB: T 4096 / H128 / D576 / KV 32768 in 69.4 ms against 101.5 with 256 MiB
      and 65.7 with 4 GiB (H200, 2026-12-01; a launch of fewer rows leaves SMs idle).
    sync_grid: hold every CTA's producer at the start of each round of items until all CTAs got there (a grid
      barrier; used only when the grid fits the SMs), so the CTAs stay in the same window.
    dkv_l2_evict_last: the dKV atomics with an L2 evict_last policy (SparseAttnBwdSpec); not measured yet, so the
      op keeps False.
    """

    regs_producer: int = 40
    regs_a: int = 232
    regs_b: int = 232
    chunk_buffers_a: int = 1
    grid: str | int = "persistent"
    bucket_rows: int | None = 4096
    sync_grid: bool = True
    deterministic_chunk_bytes: int = 2**30
    dkv_l2_evict_last: bool = False

    def __post_init__(self) -> None:
        check_grid(self.grid, "SparseAttnBwdConfig")
        b = self.bucket_rows
        if not (b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)):
            raise ValueError(f"SparseAttnBwdConfig.bucket_rows={b!r} must be None or a positive int")

    def spec(self, num_heads: int, d_qk: int, dtype, arch: str = "sm_90a", d_v: int = 512,
             deterministic: bool = False) -> SparseAttnBwdSpec:
        """The kernel spec of this config for a kernel of `num_heads` (64 or 128) heads."""
        return SparseAttnBwdSpec(arch=arch, num_heads=num_heads, d_qk=d_qk, d_v=d_v, dtype=dtype_name(dtype),
                                 deterministic=bool(deterministic), regs_producer=self.regs_producer,
                                 regs_a=self.regs_a, regs_b=self.regs_b, chunk_buffers_a=self.chunk_buffers_a,
                                 dkv_l2_evict_last=self.dkv_l2_evict_last)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(items, n_ctas))."""
        return grid_ctas(self.grid, num_sms)


def config_for(num_heads: int, d_qk: int, dtype, arch: str, num_sms: int | None) -> SparseAttnBwdConfig:
    """The config the op runs for `num_heads` query heads (padded to 64 or 128), `d_qk`, `dtype` on `arch` with
    `num_sms` SMs (None: any): one config for every shape (notes/kernels/sparse_attention_backward.md)."""
    return SparseAttnBwdConfig()
