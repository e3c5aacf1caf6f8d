"""Warpgroup MMA helpers of the Hopper kernels: the set-up of one product (`wgmma_tile`: tiled MMA, fragments,
accumulator and its views; `wgmma_tile_sibling`: another product on the same tiled MMA), one whole product over a K loop of k16 steps, issued, committed as one group and
waited (`gemm_tile`), and the issue alone of a product that overwrites its accumulator (`issue_gemm`), for groups of
several products or a product left in flight. Called by the 128 threads of the consumer warpgroup that owns the accumulator
(wgmma is a warpgroup instruction: every thread of the warpgroup must reach it, converged)."""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from dsagen.kernels.common.sm90.layout import acc_as_frg_a, acc_mn_view


@cute.jit
def gemm_tile(mma, acc, tA, tB, k_steps: int, a_stage=None, b_stage=None) -> None:
    """acc = sum over the k16 steps ks < k_steps of A[.., .., ks] B[.., .., ks] on wgmma: zero acc, fence the
    warpgroup's registers, issue, commit one group and wait until it retired. tA / tB: wgmma fragments with the
    k step as mode 2; where a_stage / b_stage is given, mode 3 is a ring stage and that stage is read."""
    acc.fill(0.0)
    warpgroup.fence()
    for ks in cutlass.range_constexpr(k_steps):
        cute.gemm(mma, acc, k_step(tA, ks, a_stage), k_step(tB, ks, b_stage), acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


def k_step(frag, ks: int, stage=None):
    """k16 step ks of a wgmma fragment whose mode 2 is the k step: frag[.., .., ks], or, where `stage` is given
    (mode 3 a ring stage), frag[.., .., ks, stage]. Trace-time indexing only."""
    return frag[None, None, ks] if stage is None else frag[None, None, ks, stage]


@cute.jit
def issue_gemm(mma, acc, tA, tB, k_steps: int, b_stage, a_stage=None) -> None:
    """acc = sum over the k16 steps ks < k_steps of A[.., .., ks] B[.., .., ks, b_stage] on wgmma, the first step
    overwriting acc (no zero fill), issued only: the caller fences the warpgroup's registers before and commits the
    group after (one group may hold several products), then waits for it. Leaves ACCUMULATE set. b_stage None: B
    has no stage mode; a_stage: A's ring stage (mode 3), None: A has none."""
    mma.set(warpgroup.Field.ACCUMULATE, False)
    for ks in cutlass.range_constexpr(k_steps):
        cute.gemm(mma, acc, k_step(tA, ks, a_stage), k_step(tB, ks, b_stage), acc)
        mma.set(warpgroup.Field.ACCUMULATE, True)


@cute.jit
def issue_gemm_group(mma, acc, tA, tB, k_steps: int, b_stage) -> None:
    """One wgmma group of acc = A B (issue_gemm: the first step overwrites acc): fence the warpgroup's registers,
    issue, commit; the caller waits (wait_group), e.g. with another group still in flight."""
    warpgroup.fence()
    issue_gemm(mma, acc, tA, tB, k_steps, b_stage)
    warpgroup.commit_group()


@cute.jit
def issue_accumulate_group(mma, acc, tA, tB, k_steps: int, b_stage) -> None:
    """One wgmma group of acc += A B over k_steps k16 steps (A's mode 2 the step, from registers or shared memory;
    B's mode 3 the ring stage b_stage): fence, issue, commit; the caller waits."""
    warpgroup.fence()
    for ks in cutlass.range_constexpr(k_steps):
        cute.gemm(mma, acc, tA[None, None, ks], tB[None, None, ks, b_stage], acc)
    warpgroup.commit_group()


class WgmmaTile(NamedTuple):
    """The trace-time objects of one wgmma product for the calling consumer thread: the tiled MMA and its slice,
    the A and B fragments, the FP32 accumulator and its (rows, cols) views of values and of coordinates
    (layout.acc_mn_view)."""
    mma: Any
    thr: Any
    tA: Any
    tB: Any
    acc: Any
    acc_mn: Any
    coord_mn: Any


def wgmma_tile(dtype, sA, sB, tiler_mn: tuple, ctid, a_mn_major: bool = False, b_mn_major: bool = False,
               a_regs=None) -> WgmmaTile:
    """A WgmmaTile of C (tiler_mn = (M, N)) = A B for consumer thread `ctid` (0..127 of its warpgroup): A from the
    shared tile sA (K-major, or MN-major with a_mn_major) or, when a_regs is given, from registers (an m64 FP32-shaped
    16-bit fragment, viewed by layout.acc_as_frg_a: the RS form); B from the shared tile sB (None: the caller makes
    its B fragments, e.g. one per column block). Every product accumulates into the accumulator (gemm_tile zeroes
    it first)."""
    major = {False: OperandMajorMode.K, True: OperandMajorMode.MN}
    extra = {} if a_regs is None else {"a_source": warpgroup.OperandSource.RMEM}
    mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, major[a_mn_major], major[b_mn_major], Float32, (1, 1, 1),
                                            tiler_mn=tiler_mn, **extra)
    mma.set(warpgroup.Field.ACCUMULATE, True)
    thr = mma.get_slice(ctid)
    tA = acc_as_frg_a(a_regs) if a_regs is not None else mma.make_fragment_A(thr.partition_A(sA))
    tB = mma.make_fragment_B(thr.partition_B(sB)) if sB is not None else None
    acc = cute.make_rmem_tensor(thr.partition_shape_C(tiler_mn), Float32)
    return WgmmaTile(mma=mma, thr=thr, tA=tA, tB=tB, acc=acc, acc_mn=acc_mn_view(acc),
                     coord_mn=acc_mn_view(thr.partition_C(cute.make_identity_tensor(tiler_mn))))


def wgmma_tile_sibling(tile: WgmmaTile, sA, sB) -> WgmmaTile:
    """A second product of `tile`'s shape on its tiled MMA (one wgmma group may issue both, e.g. S = Q K^T and
    dP = dO V^T of an attention backward): the A and B fragments of the shared tiles sA and sB (majorness and mode
    order as tile's, K may differ) and a new FP32 accumulator with its views."""
    tA = tile.mma.make_fragment_A(tile.thr.partition_A(sA))
    tB = tile.mma.make_fragment_B(tile.thr.partition_B(sB))
    acc = cute.make_rmem_tensor(tile.acc.layout, Float32)
    return WgmmaTile(mma=tile.mma, thr=tile.thr, tA=tA, tB=tB, acc=acc, acc_mn=acc_mn_view(acc),
                     coord_mn=tile.coord_mn)
