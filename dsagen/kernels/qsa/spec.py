"""Spec of the QSA forward (FlashInfer QSA's `qsa_indexed_forward`, dsagen.qsa_indexed_forward): per query token and
query head, softmax attention over the key tokens the query's index row lists, GQA with G query heads per KV head;
BF16 and FP32 outputs and the natural-log LSE [Hq, T]."""

from __future__ import annotations

from dataclasses import dataclass

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

    group: int = 12
    head_dim: int = 256
    v_dim: int = 256
    dtype: str = "bfloat16"
    stages: int = 2
    bitmap: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the QSA forward is implemented for sm_90a only, not {self.arch}")
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
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory at "
                       f"head_dim={self.head_dim}, v_dim={self.v_dim}; at most {SMEM_LIMIT}")
        return out

    def smem_bytes(self) -> int:
        """The kernel's dynamic shared memory (its Smem struct): smem_bytes of the spec's dims and stages."""
        return smem_bytes(self.head_dim, self.v_dim, self.stages)


def smem_bytes(head_dim: int, v_dim: int, stages: int) -> int:
    """The kernel's shared memory: its mbarriers, the tiles' ids and the bitmap form's search state (under 1 KiB up
    to 3 stages), then, 1024-byte
    aligned, the 64-row Q tile and `stages` K and V tiles of 64 rows (16-bit elements)."""
    return 1024 + 2 * 64 * (head_dim + stages * (head_dim + v_dim))


def spec_for(group: int, head_dim: int, v_dim: int, dtype: str, arch: str, bitmap: bool = False) -> QsaFwdSpec:
    """The spec a call of these shapes runs (bitmap: of the bitmap form): three stages where they fit, else two."""
    stages = 3 if smem_bytes(head_dim, v_dim, 3) <= SMEM_LIMIT else 2
    return QsaFwdSpec(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, dtype=dtype, stages=stages,
                      bitmap=bitmap)
