"""Specs of the QSA kernels (FlashInfer QSA's `qsa_indexed_forward` and bitmap API, dsagen.qsa_indexed_forward /
qsa_bitmap_forward): the forward (per query token and query head, softmax attention over the key tokens the query
selects, GQA with G query heads per KV head; BF16 and FP32 outputs and the natural-log LSE [Hq, T]) and the
backward's two kernels, dq and dk / dv, over the forward's work items."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...spec.base import KernelSpec, register_spec

QSA_HEAD_DIMS = (64, 128, 256)
QSA_MAX_GROUP = 64           # the tile's 64 rows hold one query's G heads
SMEM_LIMIT = 227 * 1024


@register_spec
@dataclass(frozen=True)
class QsaFwdSpec(KernelSpec):
    """The QSA indexed forward on Hopper (kernel: qsa/fwd_sm90.py, bound by fwd_sm90.py.j2). A CTA (256 threads)
    takes one query token and one KV head: the 64 rows of its wgmma tile are the G query heads of that KV head
    (rows G..63 zero padding). The producer warpgroup gathers the Q rows once and, per tile of 64 index slots, the
    listed tokens' K and V rows (16-byte cp.async, an id outside [0, T) zero-filled and masked) through a ring of
    `stages` stages; one consumer warpgroup runs S = Q K^T, the masked online softmax and O += P V per tile, the next
    tile's S issued before this tile's PV. Every sum runs in slot order: bitwise repeatable, no scratch.

    group: query heads per KV head (Hq / Hkv), 1..64 (FlashInfer QSA: 12).
    head_dim / v_dim: D of q and k, Dv of v and the outputs (64, 128 or 256 each; FlashInfer QSA: 256).
    dtype: q / k / v / output element type ("bfloat16" or "float16").
    stages: K / V tiles in flight (2 or 3, within the shared memory of one CTA).
    bitmap: the bitmap form (FlashInfer QSA's bitmap API): the producer reads the query's row of the four-token
        block bitmap instead of an index row, counts its selected causal blocks, then finds each tile's next 16 in
        ascending order (no compacted-index scratch).

    Tokens, KV heads, the index width or the packed sequences, and the softmax scale are run-time arguments.
    """

    op = "qsa_fwd"
    template = "qsa/fwd_{arch}.py.j2"
    what: ClassVar[str] = "the QSA forward"

    group: int = 12
    head_dim: int = 256
    v_dim: int = 256
    dtype: str = "bfloat16"
    stages: int = 2
    bitmap: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"{self.what} is implemented for sm_90a only, not {self.arch}")
        if not 1 <= self.group <= QSA_MAX_GROUP:
            out.append(f"group={self.group} must be in 1..{QSA_MAX_GROUP} (query heads per KV head)")
        for name in ("head_dim", "v_dim"):
            if getattr(self, name) not in QSA_HEAD_DIMS:
                out.append(f"{name}={getattr(self, name)} must be one of {QSA_HEAD_DIMS}")
        if self.dtype not in ("bfloat16", "float16"):
            out.append(f"dtype={self.dtype!r} must be 'bfloat16' or 'float16'")
        if self.stages not in (2, 3):
            out.append(f"stages={self.stages} must be 2 or 3")
        elif not out and self.smem_bytes() > SMEM_LIMIT:
            # smem_bytes is the spec's kernel's: the backward's include the dO tile
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory at "
                       f"head_dim={self.head_dim}, v_dim={self.v_dim}; at most {SMEM_LIMIT}")
        return out

    def smem_bytes(self) -> int:
        """The kernel's dynamic shared memory (its Smem struct): smem_bytes of the spec's dims and stages."""
        return smem_bytes(self.head_dim, self.v_dim, self.stages)


@register_spec
@dataclass(frozen=True)
class QsaDqSpec(QsaFwdSpec):
    """The QSA backward's dq on Hopper (kernel: qsa/dq_sm90.py, bound by dq_sm90.py.j2): the forward's work items,
    producer and K / V ring (producer_sm90.py), the item's dO rows gathered once beside its Q rows; per tile S = Q K^T
    and dP = dO V^T as one wgmma group, dS = P (dP - delta) in registers, dq += dS K; dq * scale stored in q's dtype.
    Bitwise repeatable. Fields as QsaFwdSpec's (bitmap: the bitmap form's producer makes the tiles)."""

    op = "qsa_dq"
    template = "qsa/dq_{arch}.py.j2"
    what: ClassVar[str] = "the QSA backward (dq)"

    def smem_bytes(self) -> int:
        """The forward's shared memory plus the 64-row dO tile."""
        return smem_bytes(self.head_dim, self.v_dim, self.stages, with_do=True)


@register_spec
@dataclass(frozen=True)
class QsaDkvSpec(QsaFwdSpec):
    """The QSA backward's dk / dv on Hopper (kernel: qsa/dkv_sm90.py, bound by dkv_sm90.py.j2): the forward's work
    items, producer and ring with the dO rows beside Q (as QsaDqSpec); keys as the wgmma M: per tile S^T = K Q^T and
    dP^T = V dO^T, then dv_part = P^T dO and dk_part = scale dS^T Q (P^T and dS^T from registers), added into FP32
    [T, Hkv, D] / [T, Hkv, Dv] accumulators by 16-byte red.add (slots outside [0, T) skipped): the sums' order, and
    so the low bits, change from call to call. Fields as QsaFwdSpec's."""

    op = "qsa_dkv"
    template = "qsa/dkv_{arch}.py.j2"
    what: ClassVar[str] = "the QSA backward (dk / dv)"

    def smem_bytes(self) -> int:
        """As QsaDqSpec's: the forward's plus the dO tile."""
        return smem_bytes(self.head_dim, self.v_dim, self.stages, with_do=True)


def smem_bytes(head_dim: int, v_dim: int, stages: int, with_do: bool = False) -> int:
    """The kernels' shared memory (producer_sm90.make_smem): the mbarriers, the tiles' ids and the bitmap form's
    search state (under 1 KiB up to 3 stages), then, 1024-byte aligned, the 64-row Q tile, with_do (the backward's)
    the 64-row dO tile, and `stages` K and V tiles of 64 rows (16-bit elements)."""
    return 1024 + 2 * 64 * (head_dim + (v_dim if with_do else 0) + stages * (head_dim + v_dim))


def _stages(head_dim: int, v_dim: int, with_do: bool) -> int:
    """Three stages where they fit, else two."""
    return 3 if smem_bytes(head_dim, v_dim, 3, with_do) <= SMEM_LIMIT else 2


def spec_for(group: int, head_dim: int, v_dim: int, dtype: str, arch: str, bitmap: bool = False) -> QsaFwdSpec:
    """The forward spec a call of these shapes runs (bitmap: of the bitmap form): three stages where they fit, else
    two."""
    return QsaFwdSpec(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, dtype=dtype,
                      stages=_stages(head_dim, v_dim, False), bitmap=bitmap)


def backward_specs_for(group: int, head_dim: int, v_dim: int, dtype: str, arch: str, bitmap: bool = False
                       ) -> tuple[QsaDqSpec, QsaDkvSpec]:
    """The backward's (dq, dk / dv) specs a call of these shapes runs: three stages where they fit with the dO tile
    (D = Dv = 256: two)."""
    kw = dict(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, dtype=dtype,
              stages=_stages(head_dim, v_dim, True), bitmap=bitmap)
    return QsaDqSpec(**kw), QsaDkvSpec(**kw)
