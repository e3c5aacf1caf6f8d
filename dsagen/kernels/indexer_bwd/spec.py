"""Spec family of the fused sparse indexer backward (cuDNN frontend DSA §9, Indexer Backward).

For query row t and slot j of its top-k (valid: 0 <= local id < S_k), with the score gradient
dI[t, j] = c * sm_scale * (p_j * sum_J tgt - tgt_j) of the indexer KL loss (c = grad_loss * loss_coeff / (B S_q)):
    d_weights[t, h] = sum_j dI[t, j] relu(q[t, h] . k[id_j])
    G[j, h]         = dI[t, j] w[t, h] [q[t, h] . k[id_j] > 0]
    d_index_q[t]    = G^T K          d_index_k[id_j] += (G Q)[j]
The host computes dI (a fixed-order torch reduction per row); the kernel the three products.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec

_SMEM_PER_SM = 228 * 1024


@register_spec
@dataclass(frozen=True)
class IndexerBwdSpec(KernelSpec):
    """Fused sparse indexer backward for Hopper (kernel: indexer_bwd/bwd_sm90.py, bound by bwd_sm90.py.j2). An item is
    one query row; a persistent grid of 256-thread CTAs, two per SM, loops over the rows. Per row, Q (64 heads x
    head_dim) stays in shared memory and the row's slots go by in 64-row tiles that a producer warpgroup gathers with
    cp.async into a ring of `stages` buffers; the consumer warpgroup recomputes S = K Q^T, forms G and runs
    dQ += G^T K and dK = G Q on wgmma, adding dK into an FP32 accumulator with 16-byte atomics (deterministic: storing
    each slot's row for a fixed-order reduction on the host).

    num_heads: 64 (fewer are padded by the host with zero weights). head_dim: 64 or 128.
    dtype: index_q / index_k dtype ("bfloat16" or "float16"). deterministic: store per-slot dK rows instead of atomics.
    stages: gathered tiles in flight per CTA (2..4). regs_producer / regs_consumer: setmaxnreg budgets (two CTAs of
    256 threads per SM launch with 128 registers per thread; the two budgets sum to at most 256).
    """

    op = "indexer_backward"
    template = "indexer_bwd/bwd_{arch}.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    deterministic: bool = False
    stages: int = 4
    regs_producer: int = 24
    regs_consumer: int = 232

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (upper bound): Q, G, the tile ring, ids, dI, dW partials, barriers."""
        return bwd_smem_bytes(self)

    def reasons(self) -> list[str]:
        return super().reasons() + bwd_reasons(self, "the fused sparse indexer backward")


def bwd_smem_bytes(spec) -> int:
    """Dynamic shared memory of one CTA of an indexer backward kernel (sparse or dense form; upper bound)."""
    return (2 * (spec.num_heads + 64 * spec.stages) * spec.head_dim + 2 * 64 * spec.num_heads
            + 8 * 64 * spec.stages + 32 * spec.num_heads + 3 * 1024)


def bwd_reasons(spec, what: str) -> list[str]:
    """Why an indexer backward spec (sparse or dense form) cannot be built: arch, heads, head dim, dtype, stages
    (two CTAs per SM) and the two warpgroups' register budgets."""
    out = []
    if spec.arch != "sm_90a":
        out.append(f"arch {spec.arch!r}: {what} exists for sm_90a only (Hopper wgmma); use impl='reference' elsewhere")
    if spec.num_heads != 64:
        out.append(f"num_heads={spec.num_heads} must be 64 (the op pads fewer heads)")
    if spec.head_dim not in (64, 128):
        out.append(f"head_dim={spec.head_dim} must be 64 or 128")
    if spec.dtype not in ("bfloat16", "float16"):
        out.append(f"dtype={spec.dtype!r} must be 'bfloat16' or 'float16'")
    if not 2 <= spec.stages <= 4:
        out.append(f"stages={spec.stages} must be in 2..4")
    elif spec.num_heads == 64 and spec.head_dim in (64, 128) and 2 * (bwd_smem_bytes(spec) + 1024) > _SMEM_PER_SM:
        out.append(f"stages={spec.stages}: two CTAs of {bwd_smem_bytes(spec)} bytes of shared memory do not fit an SM")
    regs = (spec.regs_producer, spec.regs_consumer)
    if any(r % 8 or not 24 <= r <= 256 for r in regs):
        out.append(f"regs_producer/regs_consumer={regs} must each be a multiple of 8 in [24, 256]")
    elif sum(regs) > 256:
        out.append(f"regs_producer + regs_consumer = {sum(regs)} exceeds 256 (2 warpgroups x 128 registers at "
                   f"launch; setmaxnreg cannot grow the pool)")
    return out


@register_spec
@dataclass(frozen=True)
class DenseIndexerBwdSpec(KernelSpec):
    """Fused dense indexer backward for Hopper (cuDNN frontend DSA §10; kernel: indexer_bwd/dense_sm90.py, bound by
    dense_sm90.py.j2): the sparse form's kernel with each query row's visible keys (the ratio-causal limit with
    per-batch offsets) as its slots and the score gradient computed from the dense attention / indexer score rows
    by the producer. dK by FP32 atomics, or with deterministic=True the sparse form's per-slot dK rows (slot = key:
    a [rows, S_k, D] FP32 buffer per launch, which the host sums over the rows in a fixed order). Fields as
    IndexerBwdSpec's (budgets 24 / 232 as the sparse form's: no spills, where 40 / 216 spilled; CPU compile,
    2026-12-03). kl_loss: the kernel of dense_indexer_kl_backward's fused path, whose producer also sums each row's
    KL loss (atomic d_index_k only). A compile-time field, not a run-time flag: the flag's unused branch made the
    plain kernel 5-7% slower (H200, 2026-12-03, beside cuDNN: 1.20-1.25x where it was 1.27-1.33x).
    """

    op = "dense_indexer_backward"
    template = "indexer_bwd/dense_{arch}.py.j2"

    num_heads: int = 64
    head_dim: int = 128
    dtype: str = "bfloat16"
    stages: int = 4
    regs_producer: int = 24
    regs_consumer: int = 232
    deterministic: bool = False
    kl_loss: bool = False

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (upper bound), the sparse form's."""
        return bwd_smem_bytes(self)

    def reasons(self) -> list[str]:
        out = super().reasons() + bwd_reasons(self, "the fused dense indexer backward")
        if self.kl_loss and self.deterministic:
            out.append("kl_loss=True needs deterministic=False (the KL path's kernel adds d_index_k atomically)")
        return out


@dataclass(frozen=True)
class IndexerBwdConfig:
    """The launch choices of the fused indexer backward: the ring depth and register budgets (spec fields), the grid
    ("persistent": two CTAs per SM, or an int n: at most n CTAs), for deterministic mode the most bytes of per-slot
    dK rows one launch stores (the rows of a launch are chosen so that it fits), and the key-window ordering.

    bucket_rows: key rows per window (None: the ids as given). In atomic mode, when the FP32 d_index_k accumulator
      (n_k x D x 4 bytes) is at least `order_min_bytes`, each row's valid ids are ordered by the window of their id
      (stable; the sparse MLA backward's ordering kernel, sparse_mla_bwd/order.py, which also gives each ordered
      slot's input slot for its dI). H200, 2026-12-02, T 4096 / topk 2048 / D 128, in one process: 2.937 against
      3.239 ms at KV 131072 (a 67 MB accumulator), but 18.6-19.6 against 15.3 ms at T 32768 / KV 32768, whose 16 MB
      accumulator stays in L2 anyway; a grid barrier per round of rows on top of the ordering (as the sparse MLA
      backward has) took the gain away again (3.23 ms), and 8192 / 32768-row windows gave 3.27 / 3.19 with it.
    """

    stages: int = 4
    regs_producer: int = 24
    regs_consumer: int = 232
    grid: str | int = "persistent"
    chunk_bytes: int = 1 << 30
    bucket_rows: int | None = 16384
    order_min_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if not (self.grid == "persistent" or (isinstance(self.grid, int) and not isinstance(self.grid, bool)
                                              and self.grid >= 1)):
            raise ValueError(f"IndexerBwdConfig.grid={self.grid!r} must be 'persistent' or a positive int")
        if not (isinstance(self.chunk_bytes, int) and self.chunk_bytes >= 1 << 20):
            raise ValueError(f"IndexerBwdConfig.chunk_bytes={self.chunk_bytes!r} must be an int >= 1 MiB")
        b = self.bucket_rows
        if not (b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)):
            raise ValueError(f"IndexerBwdConfig.bucket_rows={b!r} must be None or a positive int")
        if not (isinstance(self.order_min_bytes, int) and self.order_min_bytes >= 0):
            raise ValueError(f"IndexerBwdConfig.order_min_bytes={self.order_min_bytes!r} must be an int >= 0")

    def ordered(self, n_k: int, head_dim: int, deterministic: bool) -> bool:
        """Whether a call over `n_k` key rows of `head_dim` orders its ids by key window (atomic mode only: the
        deterministic mode adds no atomics)."""
        return not deterministic and self.bucket_rows is not None and n_k * head_dim * 4 >= self.order_min_bytes

    def spec(self, head_dim: int, dtype, arch: str = "sm_90a", deterministic: bool = False) -> IndexerBwdSpec:
        """The kernel spec of this config (64 heads)."""
        return IndexerBwdSpec(arch=arch, num_heads=64, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                              deterministic=deterministic, stages=self.stages, regs_producer=self.regs_producer,
                              regs_consumer=self.regs_consumer)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (the most CTAs a launch uses; its grid is min(rows, n_ctas))."""
        return 2 * num_sms if self.grid == "persistent" else self.grid


def config_for(head_dim: int, dtype, arch: str, num_sms: int | None) -> IndexerBwdConfig:
    """The config the op runs for `head_dim` and `dtype` on `arch`: one for every shape so far."""
    return IndexerBwdConfig()


@dataclass(frozen=True)
class DenseIndexerBwdConfig:
    """The launch choices of the fused dense indexer backward: the ring depth and register budgets (spec fields),
    the grid ("persistent": two CTAs per SM, or an int n: at most n CTAs) and, for deterministic mode, the most
    bytes of per-slot dK rows one launch stores (its query rows are chosen so that they fit)."""

    stages: int = 4
    regs_producer: int = 24
    regs_consumer: int = 232
    grid: str | int = "persistent"
    slot_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not (self.grid == "persistent" or (isinstance(self.grid, int) and not isinstance(self.grid, bool)
                                              and self.grid >= 1)):
            raise ValueError(f"DenseIndexerBwdConfig.grid={self.grid!r} must be 'persistent' or a positive int")

    def spec(self, head_dim: int, dtype: str, arch: str = "sm_90a", deterministic: bool = False,
             kl_loss: bool = False) -> DenseIndexerBwdSpec:
        """The kernel spec of this config (64 heads): the atomic kernel, the deterministic one, or (kl_loss) the
        atomic one that also sums the KL loss (dense_indexer_kl_backward's)."""
        return DenseIndexerBwdSpec(arch=arch, head_dim=head_dim, dtype=dtype, stages=self.stages,
                                   regs_producer=self.regs_producer, regs_consumer=self.regs_consumer,
                                   deterministic=deterministic, kl_loss=kl_loss)

    def n_ctas(self, num_sms: int) -> int:
        """The kernel's n_ctas argument (grid = min(rows, n_ctas))."""
        return 2 * num_sms if self.grid == "persistent" else int(self.grid)


def dense_config_for(head_dim: int, dtype, arch: str, num_sms: int | None) -> DenseIndexerBwdConfig:
    """The config the dense op runs: the sparse form's ring and budgets (1.27-1.33x cuDNN's SM90 kernel at T 2048-16384
    on the H200, 2026-12-03; BENCHMARKS.md "Dense warm-up step")."""
    return DenseIndexerBwdConfig()
