"""Spec of the NSA selected-branch forward (ejkernel NSA, seed of dsagen.native_sparse_attention): per query token and
query head, softmax attention over the keys of the blocks its KV head's slots name, causal, GQA with G query heads
per KV head, output and natural-log LSE."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec

NSA_GROUPS = (1, 2, 4, 8, 16, 32, 64)
NSA_HEAD_DIMS = (64, 128)
NSA_BLOCK_SIZES = (32, 64, 128)
NSA_MAX_SLOTS = 64
SMEM_LIMIT = 227 * 1024
DKV_ROWS = 64               # key rows of the dk / dv kernel's tile (the wgmma M); blocks of 32 / 128 keys map onto it
CMP_TILE = 64               # compressed rows per tile of the compressed branch's kernels
MAX_TOK = 16                # at most this many tokens per work item (the scheduler's list is TOK x slots entries)


def item_tokens(group: int) -> int:
    """Tokens per work item of the selected-branch kernel for G query heads per KV head: 64 // G (its 64 rows are
    the tokens' query heads), at most MAX_TOK."""
    return min(MAX_TOK, 64 // group)


def _shape_reasons(spec, what: str, dims: tuple[str, ...]) -> list[str]:
    """The checks the NSA specs share: sm_90a (`what` names the kernel), the group, the head dims named in `dims`,
    max_slots where the spec has it, the dtype."""
    out = []
    if spec.arch != "sm_90a":
        out.append(f"the NSA {what} is implemented for sm_90a only, not {spec.arch}")
    if spec.group not in NSA_GROUPS:
        out.append(f"group={spec.group} must be one of {NSA_GROUPS} (query heads per KV head)")
    for name in dims:
        if getattr(spec, name) not in NSA_HEAD_DIMS:
            out.append(f"{name}={getattr(spec, name)} must be one of {NSA_HEAD_DIMS}")
    slots = getattr(spec, "max_slots", None)
    if slots is not None and not 1 <= slots <= NSA_MAX_SLOTS:
        out.append(f"max_slots={slots} must be in 1..{NSA_MAX_SLOTS}")
    if spec.dtype not in ("bfloat16", "float16"):
        out.append(f"dtype={spec.dtype!r} must be 'bfloat16' or 'float16'")
    return out


@register_spec
@dataclass(frozen=True)
class NsaSelectFwdSpec(KernelSpec):
    """The NSA selected-branch forward on Hopper (kernel: nsa/select_fwd_sm90.py, bound by select_fwd_sm90.py.j2).
    A CTA (256 threads, two per SM) takes one KV head and TOK = min(16, 64 // group) consecutive tokens: its 64 rows
    are those tokens' query heads of that KV head. A scheduler warp merges the tokens' selected blocks into a list of
    distinct blocks with the mask of the tokens that chose each, a TMA warp loads Q and each listed block's K and V
    (block_size contiguous rows of the head), and one consumer warpgroup runs S = Q K^T, the masked online softmax and
    O += P V per block.

    group: query heads per KV head (HQ / H), a power of two up to 64 (below 4 the tile's rows are part padding).
    head_dim / v_dim: D of q and k, Dv of v and the output (64 or 128 each).
    block_size: keys per block (32, 64 or 128).
    max_slots: the most slots per token the kernel takes (its shared list holds TOK x max_slots entries).
    dtype: q / k / v / output element type ("bfloat16" or "float16").
    stages: K / V blocks in flight (2..4, within the shared memory of two CTAs per SM at block_size 64).

    Token count, KV heads, packed offsets, slot count, per-token counts and the softmax scale are run-time arguments.
    """

    op = "nsa_select_fwd"
    template = "nsa/select_fwd_{arch}.py.j2"

    group: int = 16
    head_dim: int = 128
    v_dim: int = 128
    block_size: int = 64
    max_slots: int = 16
    dtype: str = "bfloat16"
    stages: int = 2

    def reasons(self) -> list[str]:
        out = super().reasons() + _shape_reasons(self, "selected-branch forward", ("head_dim", "v_dim"))
        if self.block_size not in NSA_BLOCK_SIZES:
            out.append(f"block_size={self.block_size} must be one of {NSA_BLOCK_SIZES}")
        if not 2 <= self.stages <= 4:
            out.append(f"stages={self.stages} must be in 2..4")
        elif not out and self.smem_bytes() > SMEM_LIMIT:
            out.append(f"stages={self.stages} needs {self.smem_bytes()} bytes of shared memory; at most {SMEM_LIMIT}")
        return out

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (an estimate kept in step with select_fwd_sm90's Smem struct)."""
        tok = item_tokens(self.group)
        ne = tok * self.max_slots
        small = 8 * (2 + 3 * self.stages) + 16 + 3 * 4 * 16 + 4 * 4 * ne
        tiles = 2 * (64 * self.head_dim + self.block_size * (self.head_dim + self.v_dim) * self.stages)
        return -(-small // 1024) * 1024 + tiles


@register_spec
@dataclass(frozen=True)
class NsaSelectDqSpec(NsaSelectFwdSpec):
    """The NSA selected branch's dq on Hopper (kernel: nsa/select_dq_sm90.py, bound by select_dq_sm90.py.j2): the
    forward's work items, scheduler and K / V ring, with the item's dO tile beside its Q tile; per listed block S and
    dP by wgmma, dS in registers and dq += dS K. Fields as NsaSelectFwdSpec's."""

    op = "nsa_select_dq"
    template = "nsa/select_dq_{arch}.py.j2"

    def smem_bytes(self) -> int:
        """The forward's shared memory plus the dO tile (64 rows x v_dim)."""
        return super().smem_bytes() + 2 * 64 * self.v_dim


@register_spec
@dataclass(frozen=True)
class NsaCmpFwdSpec(NsaSelectFwdSpec):
    """The NSA compressed branch's attention on Hopper (kernel: nsa/select_fwd_sm90.py with compressed=True, bound by
    cmp_fwd_sm90.py.j2): the selected-branch forward's items, ring and consumer over the mean-pooled keys, token t
    attending the compressed rows of the complete blocks before or at it, (t + 1) // cmp_block of them (cmp_block,
    the NSA block size, is a run-time argument), listed by the scheduler itself in tiles of 64 rows. Output and
    natural-log LSE as the selected branch's.

    block_size: the tile of compressed rows, 64.  max_slots: tiles per token at most (64 x max_slots compressed
    rows: max_slots x 64 x cmp_block tokens per sequence).  Other fields as NsaSelectFwdSpec's."""

    op = "nsa_cmp_fwd"
    template = "nsa/cmp_fwd_{arch}.py.j2"

    def reasons(self) -> list[str]:
        return super().reasons() + _cmp_tile_reasons(self.block_size)


def _cmp_tile_reasons(block_size: int) -> list[str]:
    """The compressed branch's kernels work on tiles of CMP_TILE compressed rows."""
    if block_size != CMP_TILE:
        return [f"block_size={block_size} must be {CMP_TILE} (tiles of compressed rows)"]
    return []


@register_spec
@dataclass(frozen=True)
class NsaCmpImportanceSpec(KernelSpec):
    """The NSA compressed branch's block importance on Hopper (kernel: nsa/cmp_importance_sm90.py, bound by
    cmp_importance_sm90.py.j2): for query token t and KV head h, imp[t, h, c] = sum over h's G query heads of
    exp(scale q . k_cmp[c] - lse_cmp) for the compressed blocks c before t's own block (the probabilities the
    compressed attention gave them), from the compressed forward's LSE. The compressed forward's items, scheduler
    and K ring (no V); the G heads of a token summed in a fixed order (shuffles, then shared memory for G >= 32).

    group / head_dim / max_slots / dtype / stages: as NsaCmpFwdSpec's (tiles of 64 compressed rows)."""

    op = "nsa_cmp_importance"
    template = "nsa/cmp_importance_{arch}.py.j2"

    group: int = 16
    head_dim: int = 128
    max_slots: int = 16
    dtype: str = "bfloat16"
    stages: int = 2

    def reasons(self) -> list[str]:
        out = super().reasons() + _shape_reasons(self, "compressed branch", ("head_dim",))
        if not 2 <= self.stages <= 4:
            out.append(f"stages={self.stages} must be in 2..4")
        return out


@register_spec
@dataclass(frozen=True)
class NsaCmpTopkSpec(KernelSpec):
    """The NSA compressed branch's block selection on Hopper (kernel: nsa/cmp_topk_sm90.py, bound by
    cmp_topk_sm90.py.j2): one warp per (token, KV head) picks the n_select (run-time) blocks of highest importance,
    its own block first (importance G), then the blocks before it by importance, ties to the larger block id, -1 past
    the candidates; ids in that order, int32. No fields beyond the arch: one kernel serves every shape."""

    op = "nsa_cmp_topk"
    template = "nsa/cmp_topk_{arch}.py.j2"

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the NSA compressed branch is implemented for sm_90a only, not {self.arch}")
        return out


@register_spec
@dataclass(frozen=True)
class NsaSelectDkvSpec(KernelSpec):
    """The NSA selected branch's dk and dv on Hopper (kernel: nsa/select_dkv_sm90.py, bound by select_dkv_sm90.py.j2):
    one CTA per (KV head, key block) over the tokens that selected the block (host.inverse_index), keys as the wgmma
    M, chunks of 64 // max(group, 8) tokens through a ring of `stages`; no atomics, bitwise repeatable. One CTA per
    SM (256 consumer registers).

    group / head_dim / v_dim / dtype: as NsaSelectFwdSpec.  block_size: 64 (the keys are the wgmma M).
    stages: chunk tiles in flight (2..3).
    overlap: the next chunk's S^T / dP^T issued before this chunk's dv / dk, its P^T / dS^T formed while they run
      (the same products in the same order: the same bytes as overlap=False); the chunk after the next is then
      loaded only once this chunk's products retired, so it takes stages=3 to keep a load ahead."""

    op = "nsa_select_dkv"
    template = "nsa/select_dkv_{arch}.py.j2"

    group: int = 16
    head_dim: int = 128
    v_dim: int = 128
    block_size: int = 64
    dtype: str = "bfloat16"
    stages: int = 2
    overlap: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons() + _shape_reasons(self, "selected-branch backward", ("head_dim", "v_dim"))
        if self.block_size != 64:
            out.append(f"block_size={self.block_size} must be 64 (the block's keys are the wgmma M)")
        if not 2 <= self.stages <= 3:
            out.append(f"stages={self.stages} must be 2 or 3")
        return out


#: the dk / dv kernel the fused backward runs: two chunk tiles in flight, one chunk at a time. The overlapped form
#: (stages 3, overlap True) spills at D = Dv = 128 (23 local loads / stores per chunk: the next chunk's S^T / dP^T
#: live beside this chunk's register operands and dk / dv, 224 registers) and ptxas splits its dv / dk group in two,
#: so only dk runs under the next chunk's P^T / dS^T; not run on a GPU yet (bench/nsa_forward.py --dkv-variant).
DKV_STAGES, DKV_OVERLAP = 2, False


def select_dkv_spec_for(group: int, head_dim: int, v_dim: int, dtype: str, arch: str,
                        compressed: bool = False) -> "NsaSelectDkvSpec":
    """The dk / dv kernel the fused backward runs for G, D, Dv, dtype: NsaSelectDkvSpec (with compressed=True the
    compressed branch's NsaCmpDkvSpec) of 64-row tiles, DKV_STAGES chunk tiles, DKV_OVERLAP."""
    cls = NsaCmpDkvSpec if compressed else NsaSelectDkvSpec
    return cls(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, block_size=CMP_TILE if compressed else DKV_ROWS,
               dtype=dtype, stages=DKV_STAGES, overlap=DKV_OVERLAP)


def select_fwd_spec_for(group: int, head_dim: int, v_dim: int, block_size: int, slots: int, dtype: str,
                        arch: str) -> NsaSelectFwdSpec:
    """The spec dsagen.native_sparse_attention's fused forward runs: max_slots the slot count rounded up to 16 (so
    the common widths share one kernel), two stages."""
    return NsaSelectFwdSpec(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, block_size=block_size,
                            max_slots=min(NSA_MAX_SLOTS, max(16, -(-slots // 16) * 16)), dtype=dtype, stages=2)


def select_dq_spec_for(group: int, head_dim: int, v_dim: int, block_size: int, slots: int, dtype: str,
                       arch: str) -> NsaSelectDqSpec:
    """The dq kernel the fused backward runs: the fields of the forward's spec (select_fwd_spec_for), whose work
    items it shares."""
    fwd = select_fwd_spec_for(group, head_dim, v_dim, block_size, slots, dtype, arch)
    return NsaSelectDqSpec(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(fwd)})


def cmp_fwd_spec_for(group: int, head_dim: int, v_dim: int, tiles: int, dtype: str, arch: str) -> NsaCmpFwdSpec:
    """The compressed forward the fused op runs for `tiles` tiles of 64 compressed rows per token at most: max_slots
    rounded up to 16."""
    return NsaCmpFwdSpec(arch=arch, group=group, head_dim=head_dim, v_dim=v_dim, block_size=CMP_TILE,
                         max_slots=min(NSA_MAX_SLOTS, max(16, -(-tiles // 16) * 16)), dtype=dtype, stages=2)


def cmp_importance_spec_for(group: int, head_dim: int, tiles: int, dtype: str, arch: str) -> NsaCmpImportanceSpec:
    """The importance kernel beside cmp_fwd_spec_for(...) (the same max_slots)."""
    fwd = cmp_fwd_spec_for(group, head_dim, head_dim, tiles, dtype, arch)
    return NsaCmpImportanceSpec(arch=arch, group=group, head_dim=head_dim, max_slots=fwd.max_slots, dtype=dtype)


@register_spec
@dataclass(frozen=True)
class NsaCmpDqSpec(NsaSelectDqSpec):
    """The NSA compressed branch's dq on Hopper (kernel: nsa/select_dq_sm90.py with compressed=True, bound by
    cmp_dq_sm90.py.j2): the compressed forward's items and scheduler with the selected dq's consumer (S, dP, dq +=
    dS K over the token's compressed rows). block_size: the tile of compressed rows, 64; other fields as
    NsaSelectDqSpec's."""

    op = "nsa_cmp_dq"
    template = "nsa/cmp_dq_{arch}.py.j2"

    def reasons(self) -> list[str]:
        return super().reasons() + _cmp_tile_reasons(self.block_size)


@register_spec
@dataclass(frozen=True)
class NsaCmpDkvSpec(NsaSelectDkvSpec):
    """The NSA compressed branch's dk and dv on Hopper (kernel: nsa/select_dkv_sm90.py with compressed=True, bound by
    cmp_dkv_sm90.py.j2): the selected branch's dk / dv kernel over tiles of 64 compressed rows, each list entry
    bounded by its token's last compressed row, each CTA writing its own rows of a partial output that the host sums
    in a fixed order. Fields as NsaSelectDkvSpec's."""

    op = "nsa_cmp_dkv"
    template = "nsa/cmp_dkv_{arch}.py.j2"


def cmp_dq_spec_for(group: int, head_dim: int, v_dim: int, tiles: int, dtype: str, arch: str) -> NsaCmpDqSpec:
    """The compressed dq kernel beside cmp_fwd_spec_for(...) (its fields)."""
    fwd = cmp_fwd_spec_for(group, head_dim, v_dim, tiles, dtype, arch)
    return NsaCmpDqSpec(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(fwd)})
