"""Device helpers for the Hopper attention kernels: SW128 shared-memory layouts, views of a wgmma
accumulator fragment, the SW128 swizzle of a byte offset (for cp.async gathers into a swizzled tile) and a
cp.async with an L2 prefetch size and cache policy (FlashMLA's gather; CuTe-DSL's cp_async_shared_global has
neither).

Fragment ownership of a wgmma m64nN accumulator (one warpgroup, thread t = 32 w + l): rows 16 w + l / 4
and 16 w + l / 4 + 8; columns 8 j + 2 (l % 4) + {0, 1}. A row therefore lives in the 4 lanes of a quad.
"""

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def sw128(dtype, shape):
    """K-major 128-byte-swizzled layout (a ComposedLayout) for a 16-bit `shape` = (rows, cols[, stages]):
    8 x 64 atoms tiled rows first, then 64-column blocks, then stages. It is the wgmma SW128 operand layout
    and the TMA SWIZZLE_128B box layout."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def acc_mn_view(t):
    """A ((2, 2, V), M, N) accumulator fragment (or its coordinate tensor) viewed as
    (rows = (2, M), cols = (2, V, N)), so that [r, c] walks the rows and columns a thread owns."""
    s, d = t.layout.shape, t.layout.stride
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


def tree_reduce(op, vals):
    """`op` over `vals` (a non-empty list, unrolled at trace time) as a balanced tree: depth ceil(log2(len))
    instead of a len - 1 long dependency chain (row maxima / sums of a softmax)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def swizzled_byte_offset(b):
    """The SW128 (S<3,4,3>) image of a byte offset `b` (Int32, >= 0) from a 1024-byte-aligned tile base."""
    return b ^ ((b >> 3) & 0x70)


@dsl_user_op
def l2_evict_last_policy(*, loc=None, ip=None) -> Int64:
    """`createpolicy.fractional.L2::evict_last.b64 1.0`: an L2 cache policy that keeps the lines it touches
    (for cp_async_16_l2_hint)."""
    return Int64(llvm.inline_asm(T.i64(), [], "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def cp_async_16_l2_hint(dst: cute.Pointer, src: cute.Pointer, src_bytes: Int32, policy: Int64, *,
                        loc=None, ip=None) -> None:
    """16-byte `cp.async.cg.shared.global.L2::cache_hint.L2::256B [dst], [src], 16, src_bytes, policy`:
    like prims.cp_async_shared_global(dst, src, 16, "cg", cp_size=src_bytes) (src_bytes 0 zero-fills and reads
    nothing), plus a 256-byte L2 prefetch and the L2 cache policy `policy` (l2_evict_last_policy())."""
    llvm.inline_asm(None,
                    [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                     src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                     Int32(src_bytes).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global.L2::cache_hint.L2::256B [$0], [$1], 16, $2, $3;",
                    "r,l,r,l,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


__all__ = ["sw128", "acc_mn_view", "acc_as_frg_a", "tree_reduce", "swizzled_byte_offset", "l2_evict_last_policy",
           "cp_async_16_l2_hint"]
