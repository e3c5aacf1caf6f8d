"""The ids of a gathered tile: which KV rows its slots name, loaded by the producer's threads and checked.

A row t of a sparse op names up to `topk` KV rows in `idx[t, :]`; its valid slots are [0, kmax) (`row_slots`:
topk, or topk_length[t] clamped) or a host-given window [lo, hi). A tile is `bn` = 64 consecutive slots. The
producer threads work in 16 groups of 8 (gather.GatherLanes): group `grp` owns the tile's rows grp + 16 i, so each
helper fills a register tensor `ids` of bn / 16 entries per thread: the KV row id, or -1 where the slot lies past
the limit or the id lies outside [0, n_rows) (a row the gather zero-fills and the consumers mask). Ids are local to
the pool the caller's row pointer points at (the host adds any batch offset).

`load_tile_ids_raw` only issues the loads; `valid_tile_ids` checks them. Between the two a producer may wait on a
barrier, so the loads' latency hides under the wait (`tile_ids` with prefetch, one tile ahead).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@cute.jit
def row_slots(p_len: cute.Pointer, has_length, topk, tok, bn: int):
    """Row tok's valid slots [0, kmax) and its bn-slot tiles: kmax = clamp(p_len[tok], 0, topk) when has_length is
    non-zero, else topk. Returns (kmax, ceil(kmax / bn))."""
    kmax = topk
    if has_length != 0:
        kmax = cutlass.min(cutlass.max((p_len + tok).load(), Int32(0)), topk)
    return kmax, (kmax + bn - 1) // bn


@cute.jit
def load_tile_ids(ids, mIdx: cute.Tensor, slot0, limit, n_rows, grp) -> None:
    """The ids of a gathered tile's rows grp + 16 i (i < len(ids)): ids[i] = mIdx[slot0 + grp + 16 i] where that slot
    is below `limit` and the id lies in [0, n_rows), else -1 (a row gather_tile_rows zero-fills). mIdx: the query
    row's ids (slots). It is load_tile_ids_raw followed by valid_tile_ids."""
    load_tile_ids_raw(ids, mIdx, slot0, limit, grp)
    valid_tile_ids(ids, ids, n_rows)


@cute.jit
def load_tile_ids_raw(ids, mIdx: cute.Tensor, slot0, limit, grp) -> None:
    """The raw ids of a gathered tile's rows grp + 16 i (i < len(ids)): ids[i] = mIdx[slot0 + grp + 16 i] where that
    slot is below `limit`, else -1. Nothing reads the loaded values here, so the loads stay in flight until
    valid_tile_ids checks them: a producer issues the next tile's id loads before it waits for a free stage."""
    for i in cutlass.range_constexpr(cute.size(ids)):
        slot = slot0 + grp + 16 * i
        kv = Int32(-1)
        if slot < limit:
            kv = mIdx[slot]
        ids[i] = kv


@cute.jit
def valid_tile_ids(ids, raw, n_rows) -> None:
    """ids[i] = raw[i] where it lies in [0, n_rows), else -1 (a row gather_tile_rows zero-fills)."""
    for i in cutlass.range_constexpr(cute.size(ids)):
        kv = raw[i]
        ids[i] = kv if kv >= 0 and kv < n_rows else Int32(-1)


@cute.jit
def row_ids_ahead(raw, mIdx: cute.Tensor, ntiles, limit, grp, prefetch: bool) -> None:
    """At a row's start, with prefetch: its first tile's raw ids into `raw` (load_tile_ids_raw), for tile_ids to check;
    nothing without it. No branch on ntiles (slots past `limit` load nothing): ptxas took such a branch in the
    producer as a divergent path and serialized the consumers' wgmma (C7520)."""
    if const_expr(prefetch):
        load_tile_ids_raw(raw, mIdx, 0, limit, grp)


@cute.jit
def tile_ids(ids, raw, mIdx: cute.Tensor, j, ntiles, limit, n_rows, grp, bn: int, prefetch: bool) -> None:
    """The ids of tile j of a row (bn slots per tile) into `ids`, as load_tile_ids gives them. With prefetch they come
    from `raw`, loaded by the previous call (or row_ids_ahead), and tile j + 1's raw ids are loaded into `raw`: their
    loads are in flight while the producer then waits for tile j's stage. Without it they are loaded here."""
    if const_expr(prefetch):
        valid_tile_ids(ids, raw, n_rows)
        if j + 1 < ntiles:
            load_tile_ids_raw(raw, mIdx, (j + 1) * bn, limit, grp)
    else:
        load_tile_ids(ids, mIdx, j * bn, limit, n_rows, grp)


@cute.jit
def tile_keep_mask(keep, sIds: cute.Tensor, base, cS: cute.Tensor) -> None:
    """keep[c] = the slot of accumulator column c holds a valid id, for a consumer whose S accumulator has the
    tile's slots as columns: sIds[base + n] >= 0 with n = cS[0, c][1] (cS: the accumulator's coordinate view,
    layout.acc_mn_view; base: the tile's first entry in the shared id buffer)."""
    for c in cutlass.range_constexpr(cute.size(keep)):
        keep[c] = sIds[base + cS[0, c][1]] >= 0
