"""Single PTX instructions that CuTe-DSL 4.8 does not expose, as `dsl_user_op`s: an L2 cache policy and the
cp.async and 16-byte store that carry it (cp_async_shared_global has no cache hint), a bf16 / fp16 pair pack, the
16-byte FP32 atomic add (also with an L2 evict_last policy) and streaming store (red / st .global.v4.f32), and the
release / acquire / sleep instructions of the grid barrier, read-only-path global loads, 8-byte / FP32 shared loads, a
16-byte shared store, the E4M3-pair dequantization of an FP8 KV cache, and a cluster peer's shared-memory address
and the 16-byte asynchronous store into it. Any thread may call any of them; none waits on a barrier.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _l2_policy(priority: str, loc, ip) -> Int64:
    """`createpolicy.fractional.L2::<priority>.b64 1.0`: an L2 cache policy for every line it touches."""
    return Int64(llvm.inline_asm(T.i64(), [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """`createpolicy.fractional.L2::evict_first.b64 1.0`: an L2 cache policy for data read or written once (a
    kernel's streamed Q and O), so that it is evicted before the lines other CTAs will read again."""
    return _l2_policy("evict_first", loc, ip)


@dsl_user_op
def cp_async_16_policy(dst: cute.Pointer, src: cute.Pointer, policy: Int64, *, loc=None, ip=None) -> None:
    """16-byte `cp.async.cg.shared.global.L2::cache_hint [dst], [src], 16, policy` (always reads 16 bytes)."""
    llvm.inline_asm(None,
                    [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                     src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;",
                    "r,l,l,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, fp16: bool = False, *, loc=None, ip=None) -> Int32:
    """Two FP32 values rounded to bf16 (fp16=True: fp16) and packed into one 32-bit word, `lo` in the low half
    (the element at the lower address when stored)."""
    op = "cvt.rn.f16x2.f32" if fp16 else "cvt.rn.bf16x2.f32"
    return Int32(llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                                 f"{op} $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def st_global_v4_b32(dst: cute.Pointer, w0: Int32, w1: Int32, w2: Int32, w3: Int32, policy: Int64, *,
                     loc=None, ip=None) -> None:
    """One 16-byte global store `st.global.L2::cache_hint.v4.b32 [dst], {w0, w1, w2, w3}, policy` (`dst` 16-byte
    aligned) with the L2 cache policy `policy` (e.g. l2_evict_first_policy())."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip)
                                                                   for w in (w0, w1, w2, w3)]
    ops.append(Int64(policy).ir_value(loc=loc, ip=ip))
    llvm.inline_asm(None, ops, "st.global.L2::cache_hint.v4.b32 [$0], {$1, $2, $3, $4}, $5;", "l,r,r,r,r,l,~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _v4_f32(ptx: str, dst: cute.Pointer, values, loc, ip) -> None:
    """`ptx [dst], {a, b, c, d}` for four FP32 values (dst 16-byte aligned)."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    llvm.inline_asm(None, ops, f"{ptx} [$0], {{$1, $2, $3, $4}};", "l,f,f,f,f,~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def red_add_v4_f32(dst: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """`red.global.add.v4.f32 [dst], {a, b, c, d}` (dst 16-byte aligned): four FP32 atomic adds, one transaction."""
    _v4_f32("red.global.add.v4.f32", dst, (a, b, c, d), loc, ip)


@dsl_user_op
def red_add_v4_f32_evict_last(dst: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None,
                              ip=None) -> None:
    """red_add_v4_f32 with an L2 evict_last cache policy made in the same asm block
    (`createpolicy.fractional.L2::evict_last.b64 1.0` then `red.global.add.L2::cache_hint.v4.f32`): the FP32
    accumulator rows it adds into stay in L2 ahead of streamed data, and no policy register stays live between
    transactions (the callers run at their register limit)."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip)
                                                                   for v in (a, b, c, d)]
    llvm.inline_asm(None, ops,
                    "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                    "red.global.add.L2::cache_hint.v4.f32 [$0], {$1, $2, $3, $4}, pol; }",
                    "l,f,f,f,f,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_f32(dst: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """`st.global.cs.v4.f32 [dst], {a, b, c, d}` (dst 16-byte aligned): a streaming store (evict-first in L2), for
    the deterministic modes' per-slot rows, which are written once and read once by a later kernel and should not
    push the gathered key pool out of L2."""
    _v4_f32("st.global.cs.v4.f32", dst, (a, b, c, d), loc, ip)


@dsl_user_op
def red_release_add_s32(dst: cute.Pointer, v: Int32, *, loc=None, ip=None) -> None:
    """`red.release.gpu.global.add.s32 [dst], v`: an add that orders this thread's earlier memory operations
    before it, GPU-wide."""
    llvm.inline_asm(None, [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
                    "red.release.gpu.global.add.s32 [$0], $1;", "l,r,~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ld_acquire_s32(src: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """`ld.acquire.gpu.global.s32`: a load that orders this thread's later memory operations after it."""
    return Int32(llvm.inline_asm(T.i32(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                 "ld.acquire.gpu.global.s32 $0, [$1];", "=r,l,~{memory}", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """`nanosleep.u32 ns` (a hint: the warp sleeps for about ns nanoseconds)."""
    llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ld_global_nc_b64(src: cute.Pointer, *, loc=None, ip=None) -> Int64:
    """`ld.global.nc.b64`: 8 bytes (src 8-byte aligned) through the non-coherent read-only path, for data no thread
    writes while the kernel runs (a KV cache)."""
    return Int64(llvm.inline_asm(T.i64(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                 "ld.global.nc.b64 $0, [$1];", "=l,l", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_f32(src: cute.Pointer, *, loc=None, ip=None) -> Float32:
    """`ld.global.nc.f32`: one FP32 value (src 4-byte aligned) through the non-coherent read-only path."""
    return Float32(llvm.inline_asm(T.f32(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                   "ld.global.nc.f32 $0, [$1];", "=f,l", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_b64(src: cute.Pointer, *, loc=None, ip=None) -> Int64:
    """`ld.shared.b64`: 8 bytes at a shared-memory pointer (8-byte aligned). Ordered after the thread's earlier
    shared-memory instructions and barrier waits (a memory clobber), so it reads what a completed cp.async wrote."""
    return Int64(llvm.inline_asm(T.i64(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                 "ld.shared.b64 $0, [$1];", "=l,r,~{memory}", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_f32(src: cute.Pointer, *, loc=None, ip=None) -> Float32:
    """`ld.shared.f32`: one FP32 value at a shared-memory pointer (4-byte aligned), ordered as ld_shared_b64."""
    return Float32(llvm.inline_asm(T.f32(), [src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                                   "ld.shared.f32 $0, [$1];", "=f,r,~{memory}", has_side_effects=True,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def st_shared_v4_b32(dst: cute.Pointer, w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None, ip=None) -> None:
    """`st.shared.v4.b32 [dst], {w0, w1, w2, w3}` (dst a 16-byte aligned shared-memory pointer)."""
    ops = [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip)
                                                                   for w in (w0, w1, w2, w3)]
    llvm.inline_asm(None, ops, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def e4m3x2_scaled_bf16x2(word: Int32, high: bool, scale: Float32, *, loc=None, ip=None) -> Int32:
    """Two E4M3 values of `word` (its low 16 bits, or with high=True its high 16 bits; the lower byte is the first
    value) times `scale`, as a packed bf16 pair (the first value in the low half): each value converted exactly to
    fp16 (`cvt.rn.f16x2.e4m3x2`) and to FP32, multiplied by scale in FP32 and rounded to bf16 (round to nearest
    even): the bytes torch gives for (e4m3.float() * scale).to(bfloat16)."""
    half = "hi" if high else "lo"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi, a0, a1; .reg .b32 h; .reg .f32 f0, f1; "
        f"mov.b32 {{lo, hi}}, $1; cvt.rn.f16x2.e4m3x2 h, {half}; mov.b32 {{a0, a1}}, h; "
        "cvt.f32.f16 f0, a0; cvt.f32.f16 f1, a1; mul.f32 f0, f0, $2; mul.f32 f1, f1, $2; "
        "cvt.rn.bf16x2.f32 $0, f1, f0; }",
        "=r,r,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def mapa_shared(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """`mapa.shared::cluster.u32`: the shared::cluster address of the same shared-memory offset `addr` (a 32-bit
    shared::cta address) in the CTA of cluster rank `rank`."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
                                 "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def st_async_v4_b32(dst: Int32, w0: Int32, w1: Int32, w2: Int32, w3: Int32, mbar: Int32, *, loc=None,
                    ip=None) -> None:
    """`st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32`: 16 bytes into another CTA's shared memory at
    the shared::cluster address `dst` (mapa_shared), completing 16 bytes of the transaction count of that CTA's
    mbarrier at shared::cluster address `mbar` once they land."""
    ops = [Int32(dst).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)]
    ops.append(Int32(mbar).ir_value(loc=loc, ip=ip))
    llvm.inline_asm(None, ops,
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
                    "r,r,r,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def bf16_to_f32(word: Int32, high: bool, *, loc=None, ip=None) -> Float32:
    """The bf16 value in the low (high=False) or high 16 bits of `word`, as FP32 (exact)."""
    half = "hi" if high else "lo"
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; cvt.f32.bf16 $0, {half}; }}",
        "=f,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def f32x4_to_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four FP32 values rounded to E4M3 (round to nearest even, finite values past 448 clamped to 448:
    `cvt.rn.satfinite.e4m3x2.f32`), packed a in the lowest byte .. d in the highest: the bytes torch's
    .to(float8_e4m3fn) gives for |values| <= 464."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
        ip=ip))


@dsl_user_op
def st_global_b32(dst: cute.Pointer, w: Int32, *, loc=None, ip=None) -> None:
    """`st.global.b32` of one word (dst 4-byte aligned)."""
    llvm.inline_asm(None, [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(w).ir_value(loc=loc, ip=ip)],
                    "st.global.b32 [$0], $1;", "l,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The 32 bits of an FP32 value."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def bits_f32(w: Int32, *, loc=None, ip=None) -> Float32:
    """The FP32 value of 32 bits."""
    return Float32(llvm.inline_asm(T.f32(), [Int32(w).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                   loc=loc, ip=ip))
