"""The local_to_global kernel (cuDNN frontend DSA, local_to_global_wrapper): per-batch local top-k ids to flat
global ids, out[b, i] = b * seqlen_k + x when 0 <= x < seqlen_k, else -1.

grid.y is the batch index, so there is no division per element; each thread handles `items_per_thread` ids,
strided by the block size so that every load and store is coalesced. Batch, ids per batch and seqlen_k are
run-time arguments.

`build(threads, items_per_thread)` returns a fresh kernel and host entry with both values bound as Python
constants, plus the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dsagen.kernels.built import BuiltKernel


def params() -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    return [
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},   # (batch, per_batch) local ids
        {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},   # (batch, per_batch) global ids
        {"name": "per_batch", "kind": "i64"},                           # S_q * K
        {"name": "batch", "kind": "i32"},
        {"name": "seqlen_k", "kind": "i32"},
    ]


def launch(threads: int, items_per_thread: int) -> dict:
    """The launch declaration: grid (ceil(per_batch / (threads * items_per_thread)), batch), `threads` threads."""
    return {"grid": [f"ceil_div(per_batch, {threads * items_per_thread})", "batch", 1], "block": [threads, 1, 1],
            "cluster": [1, 1, 1], "smem": 0}


def build(threads: int, items_per_thread: int) -> BuiltKernel:
    """A new local_to_global kernel for `threads` (64..1024, a power of two) threads per CTA, each handling
    `items_per_thread` (1, 2, 4 or 8) ids.

    Arguments of `kernel` and `host` (the PARAMS order): idx (batch, per_batch) int32 contiguous, out
    (batch, per_batch) int32 contiguous, per_batch (int64), batch (at most 65535: the grid's y), seqlen_k.
    Each call returns distinct function objects, so every rendered module names its own kernel.
    """
    items = items_per_thread

    @cute.kernel
    def kernel(p_idx: cute.Pointer, p_out: cute.Pointer, per_batch: Int64, batch: Int32, seqlen_k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, b, _ = cute.arch.block_idx()
        base = Int64(b) * per_batch
        src = cute.make_tensor(p_idx + base, cute.make_layout(per_batch))
        dst = cute.make_tensor(p_out + base, cute.make_layout(per_batch))
        offset = b * seqlen_k
        first = Int64(bidx) * (threads * items) + Int64(tidx)
        for u in cutlass.range_constexpr(items):
            i = first + u * threads
            if i < per_batch:
                x = src[i]
                y = Int32(-1)
                if x >= 0 and x < seqlen_k:
                    y = x + offset
                dst[i] = y

    @cute.jit
    def host(p_idx: cute.Pointer, p_out: cute.Pointer, per_batch: Int64, batch: Int32, seqlen_k: Int32):
        kernel(p_idx, p_out, per_batch, batch, seqlen_k).launch(
            grid=((per_batch + threads * items - 1) // (threads * items), batch, 1), block=(threads, 1, 1))

    return BuiltKernel(params(), launch(threads, items_per_thread), kernel, host)
