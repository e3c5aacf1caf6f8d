"""Shared-memory layouts and register-fragment views of the Hopper kernels.

`sw128` is the K-major 128-byte-swizzled operand layout of wgmma and of TMA's SWIZZLE_128B boxes; the cp.async
gathers address it by byte through `swizzled_byte_offset`. `acc_mn_view` and `acc_as_frg_a` reinterpret a wgmma
accumulator without moving data.

Fragment ownership of a wgmma m64nN accumulator (one warpgroup, thread t = 32 w + l): rows 16 w + l / 4
and 16 w + l / 4 + 8; columns 8 j + 2 (l % 4) + {0, 1}. A row therefore lives in the 4 lanes of a quad.
Every function here is plain trace-time layout algebra (no instructions of its own but the swizzle's XOR).
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def sw128(dtype, shape):
    """K-major 128-byte-swizzled layout (a ComposedLayout) of `dtype` for `shape` = (rows, cols[, stages]): atoms of
    8 rows x 128 bytes (64 columns of a 16-bit type, 128 of an 8-bit one) tiled rows first, then column blocks, then
    stages. It is the wgmma SW128 operand layout and the TMA SWIZZLE_128B box layout."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def acc_mn_view(t):
    """A ((2, 2, V), M, N) accumulator fragment (or its coordinate tensor) viewed as
    (rows = (2, M), cols = (2, V, N)), so that [r, c] walks the rows and columns a thread owns; an N = 8
    accumulator ((2, 2), M, N) (one 8-column block) as (rows = (2, M), cols = (2, N))."""
    s, d = t.layout.shape, t.layout.stride
    if len(s[0]) == 2:
        return cute.make_tensor(t.iterator, cute.make_layout(
            ((s[0][1], s[1]), (s[0][0], s[2])), stride=((d[0][1], d[1]), (d[0][0], d[2]))))
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))))


def acc_as_frg_a(t):
    """An m64nN accumulator ((2, 2, V), 1, 1) viewed as the register A operand ((2, 2, 2), 1, V / 2) of an
    m64nNk16 wgmma: the thread owns the same elements, k16 block j is accumulator column blocks 2j, 2j+1."""
    s, d = t.layout.shape, t.layout.stride
    v = s[0][2]
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((2, 2, 2), s[1], v // 2), stride=((d[0][0], d[0][1], d[0][2]), d[1], 2 * d[0][2])))


def swizzled_byte_offset(b):
    """The SW128 (S<3,4,3>) image of a byte offset `b` (Int32, >= 0) from a 1024-byte-aligned tile base."""
    return b ^ ((b >> 3) & 0x70)
