"""The window ordering of the sparse MLA backward's ids: row t's valid ids (0 <= id < n_kv, slot < its length) in
the order of their KV window id // bucket_rows, stable (ids of one window keep their slot order), then -1; and the
row's slot window [0, count of valid ids), which the backward kernel walks (host.slot_windows); with has_perm, also
each ordered slot's slot in the input row (the indexer backward reads its per-slot score gradient through it).

One warp per row, `warps_per_cta` rows per CTA, a counter per window of its row in shared memory: pass 1 counts the
row's valid ids per window (match.sync gives the lanes of a 32-slot step that share a window, and the first of them
adds their count), an exclusive scan turns the counts into each window's first slot, and pass 2 writes every valid
id at its window's next slot plus its rank among the earlier lanes of its step that share its window. The row
width, the row count, n_kv and bucket_rows are run-time arguments; ceil(n_kv / bucket_rows) <= max_windows.

`build(warps_per_cta, max_windows)` returns a fresh kernel and host entry with those values bound as Python
constants, plus the flat ABI (`params`) and the launch declaration (`launch`) of the rendered kernel module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.reduce import warp_inclusive_scan

FULL = 0xFFFFFFFF


def params() -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    return [
        {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_rows, ld_idx) input ids
        {"name": "length", "kind": "ptr", "dtype": "int32", "align": 4},      # (n_rows,) optional limits
        {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_rows, k) ordered ids
        {"name": "win", "kind": "ptr", "dtype": "int32", "align": 4},         # (n_rows, 2) slot windows
        {"name": "n_rows", "kind": "i32"},
        {"name": "k", "kind": "i32"},
        {"name": "ld_idx", "kind": "i64"},                                    # input row stride, elements
        {"name": "has_length", "kind": "i32"},                                # 0: `length` is not read
        {"name": "n_kv", "kind": "i32"},
        {"name": "bucket_rows", "kind": "i32"},                               # KV rows per window, >= 1
        {"name": "perm", "kind": "ptr", "dtype": "int32", "align": 4},        # (n_rows, k) input slot of out
        {"name": "has_perm", "kind": "i32"},                                  # 0: `perm` is not written
    ]


def launch(warps_per_cta: int, max_windows: int) -> dict:
    """The launch declaration: one CTA per `warps_per_cta` rows, a counter per window and warp in shared memory."""
    return {"grid": [f"ceil_div(n_rows, {warps_per_cta})", 1, 1], "block": [warps_per_cta * 32, 1, 1],
            "cluster": [1, 1, 1], "smem": warps_per_cta * max_windows * 4}


def build(warps_per_cta: int, max_windows: int) -> BuiltKernel:
    """A new window-ordering kernel for `warps_per_cta` rows per CTA and at most `max_windows` windows (a multiple
    of 32).

    Arguments of `kernel` and `host` (the PARAMS order): idx (n_rows, ld_idx) int32, length (n_rows,) int32 (read
    only when has_length != 0), out (n_rows, k) int32 contiguous (every slot written: the ordered valid ids, then
    -1), win (n_rows, 2) int32 contiguous (written: 0 and the row's count of valid ids), n_rows, k, ld_idx
    (elements, int64), has_length, n_kv, bucket_rows (ceil(n_kv / bucket_rows) <= max_windows), perm (n_rows, k)
    int32 contiguous (written when has_perm != 0: the input slot of each ordered valid id, -1 past them), has_perm.
    Each call returns distinct function objects, so every rendered module names its own kernel.
    """
    warps, mw = warps_per_cta, max_windows
    per_lane = mw // 32                     # counters each lane scans

    @cute.struct
    class Smem:
        counts: cute.struct.MemRange[Int32, warps * mw]

    @cute.jit
    def window_of(src, j, limit, n_kv, bucket_rows):
        """(id, window) of slot j: window -1 where the slot is past limit or its id is invalid."""
        v = Int32(-1)
        w = Int32(-1)
        if j < limit:
            v = src[j]
            if v >= 0 and v < n_kv:
                w = v // bucket_rows
        return v, w

    @cute.kernel
    def kernel(p_idx: cute.Pointer, p_len: cute.Pointer, p_out: cute.Pointer, p_win: cute.Pointer,
               n_rows: Int32, k: Int32, ld_idx: Int64, has_length: Int32, n_kv: Int32, bucket_rows: Int32,
               p_perm: cute.Pointer, has_perm: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        st = cutlass.memory.SmemAllocator().allocate(Smem)
        cnt = st.counts.get_tensor(cute.make_layout(warps * mw))
        row = bidx * warps + warp
        if row < n_rows:                       # warp-uniform: every lane of a warp has the same row
            src = cute.make_tensor(p_idx + Int64(row) * ld_idx, cute.make_layout(k))
            dst = cute.make_tensor(p_out + Int64(row) * Int64(k), cute.make_layout(k))
            perm = cute.make_tensor(p_perm + Int64(row) * Int64(k), cute.make_layout(k))
            base = warp * mw
            limit = k
            if has_length != 0:
                limit = cutlass.min(cutlass.max((p_len + row).load(), Int32(0)), k)
            below = cute.arch.lanemask_lt()
            for i in cutlass.range_constexpr(per_lane):
                cnt[base + lane * per_lane + i] = Int32(0)
            cute.arch.sync_warp()
            # pass 1: ids per window (the first lane of each window's lanes adds their count)
            for j0 in cutlass.range(0, limit, 32, unroll=4):
                _, w = window_of(src, j0 + lane, limit, n_kv, bucket_rows)
                peers = cute.arch.match_sync(FULL, w)
                if w >= 0 and (peers & below) == 0:
                    cnt[base + w] = cnt[base + w] + Int32(cute.arch.popc(peers))
                cute.arch.sync_warp()
            # each window's first slot: lane l holds windows [l * per_lane, (l + 1) * per_lane)
            own = Int32(0)
            for i in cutlass.range_constexpr(per_lane):
                own += cnt[base + lane * per_lane + i]
            incl = warp_inclusive_scan(own, lane)
            total = cute.arch.shuffle_sync(incl, 31)
            run = incl - own
            for i in cutlass.range_constexpr(per_lane):
                c = cnt[base + lane * per_lane + i]
                cnt[base + lane * per_lane + i] = run
                run += c
            cute.arch.sync_warp()
            # pass 2: each valid id at its window's next slot + its rank among the step's lanes of that window
            for j0 in cutlass.range(0, limit, 32, unroll=4):
                v, w = window_of(src, j0 + lane, limit, n_kv, bucket_rows)
                peers = cute.arch.match_sync(FULL, w)
                rank = Int32(cute.arch.popc(peers & below))
                at = Int32(0)
                if w >= 0:
                    at = cnt[base + w]
                    dst[at + rank] = v
                    if has_perm != 0:
                        perm[at + rank] = j0 + lane
                cute.arch.sync_warp()
                if w >= 0 and rank == 0:
                    cnt[base + w] = at + Int32(cute.arch.popc(peers))
                cute.arch.sync_warp()
            for j in cutlass.range(total + lane, k, 32, unroll=1):
                dst[j] = Int32(-1)
                if has_perm != 0:
                    perm[j] = Int32(-1)
            if lane == 0:
                (p_win + Int64(row) * 2).store(Int32(0))
                (p_win + (Int64(row) * 2 + 1)).store(total)

    @cute.jit
    def host(p_idx: cute.Pointer, p_len: cute.Pointer, p_out: cute.Pointer, p_win: cute.Pointer,
             n_rows: Int32, k: Int32, ld_idx: Int64, has_length: Int32, n_kv: Int32, bucket_rows: Int32,
             p_perm: cute.Pointer, has_perm: Int32):
        kernel(p_idx, p_len, p_out, p_win, n_rows, k, ld_idx, has_length, n_kv, bucket_rows, p_perm,
               has_perm).launch(
            grid=((n_rows + warps - 1) // warps, 1, 1), block=(warps * 32, 1, 1), smem=Smem.size_in_bytes())

    return BuiltKernel(params(), launch(warps_per_cta, max_windows), kernel, host)
