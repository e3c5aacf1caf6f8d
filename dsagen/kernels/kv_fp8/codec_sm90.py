"""The FP8 MLA KV cache codec on sm_90a: the writer and the reader of dsagen/reference/kv_cache.py's token format
(656 bytes: 512 E4M3 NoPE values in 4 tiles of 128, the tiles' FP32 power-of-two scales, 64 bf16 RoPE values).

One warp per token, WARPS per CTA, grid ceil(N / WARPS). Lane l owns NoPE values 16 l .. 16 l + 15, which lie in
tile l // 8, and lanes 0..7 the RoPE bytes 16 l .. 16 l + 15.

Writer (quantize): the lane's 16 bf16 values (two 16-byte loads) as FP32; the tile's amax over its 8 lanes (two
butterfly shuffles after the lane's own max); r = amax / 448 (IEEE division) clamped below at FP32(1e-4); the scale
2 ** ceil(log2 r) from r's bits (its exponent, plus one when the mantissa is not zero: the exact ceiling, which is
torch's log2().ceil() for every r this can give: r = amax / 448 of a bf16 amax is never within a few ulps above a
power of two unless it is one); values times 2 ** -ceil (exact) rounded to E4M3 (round to nearest even, at most 448
by the scale's choice); one 16-byte store of the lane's E4M3 bytes, the tile's scale by its first lane, the RoPE
bytes copied. The bytes are reference.kv_cache.quantize_kv_fp8's.
Reader (dequantize): the lane's 16 E4M3 bytes and its tile's scale; each value converted exactly to FP32, times the
scale and rounded to bf16 (ptx.e4m3x2_scaled_bf16x2: the bytes reference.kv_cache.dequantize_kv_fp8 gives); two
16-byte stores; the RoPE bytes copied.

Rows: bf16 kv rows of 576 values with row stride ld (elements, a multiple of 8), cache rows of 656 bytes with row
stride ld (bytes, a multiple of 16); 16-byte aligned bases; outputs contiguous.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.built import BuiltKernel
from dsagen.kernels.common.sm90.ptx import (bf16_to_f32, bits_f32, e4m3x2_scaled_bf16x2, f32_bits, f32x4_to_e4m3x4,
                                            l2_evict_first_policy, ld_global_nc_b64, ld_global_nc_f32, st_global_b32,
                                            st_global_v4_b32)

WARPS = 4
KV_DIM = 576
NOPE = 512
TILE = 128
ROPE_BYTE = NOPE + 4 * (NOPE // TILE)      # 528
ROW_BYTES = ROPE_BYTE + 2 * (KV_DIM - NOPE)  # 656
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4


def params(dequantize: bool) -> list[dict]:
    """The kernel's flat ABI, in order (a new list on every call)."""
    src, dst = ("uint8", "bfloat16") if dequantize else ("bfloat16", "uint8")
    return [
        {"name": "src", "kind": "ptr", "dtype": src, "align": 16},      # rows: bf16 kv [N, 576] / cache [N, 656]
        {"name": "dst", "kind": "ptr", "dtype": dst, "align": 16},      # contiguous: cache [N, 656] / kv [N, 576]
        {"name": "n_tok", "kind": "i32"},
        {"name": "ld", "kind": "i64"},                                  # src row stride (elements / bytes)
    ]


def launch() -> dict:
    """The launch declaration: one warp per token."""
    return {"grid": [f"ceil_div(n_tok, {WARPS})", 1, 1], "block": [32 * WARPS, 1, 1], "cluster": [1, 1, 1], "smem": 0}


@cute.jit
def _words(p: cute.Pointer):
    """16 bytes at p (8-byte aligned) as four 32-bit words, first bytes first."""
    x, y = ld_global_nc_b64(p), ld_global_nc_b64(p + 8)
    return [Int32(x), Int32(x >> 32), Int32(y), Int32(y >> 32)]


def _tree_max(xs: list):
    """The largest of xs (a pairwise tree of fmax)."""
    while len(xs) > 1:
        xs = [cute.arch.fmax(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


@cute.jit
def _copy_rope(src: cute.Pointer, dst: cute.Pointer, lane, policy) -> None:
    """Lanes 0..7: 16 bytes each of the 128 RoPE bytes from src to dst (byte pointers, 16-byte aligned)."""
    if lane < 8:
        w = _words(src + 16 * lane)
        st_global_v4_b32(dst + 16 * lane, w[0], w[1], w[2], w[3], policy)


def build(dequantize: bool) -> BuiltKernel:
    """A new codec kernel: the writer (dequantize=False) or the reader."""

    @cute.jit
    def quantize_token(p_src: cute.Pointer, p_dst: cute.Pointer, tok: Int32, ld: Int64, lane: Int32, policy):
        row = cute.recast_ptr(p_src + Int64(tok) * ld, dtype=cutlass.Int8)          # the bf16 row's first byte
        out = p_dst + Int64(tok) * ROW_BYTES
        w = _words(row + 32 * lane) + _words(row + 32 * lane + 16)                  # 16 bf16: 8 words
        v = [bf16_to_f32(w[i // 2], i % 2 == 1) for i in range(16)]
        a = [cute.arch.fmax(x, -x) for x in v]                                      # |v|
        amax = _tree_max([_tree_max(a[:8]), _tree_max(a[8:])])
        for sh in cutlass.range_constexpr(3):                                       # the tile's 8 lanes
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << sh))
        r = cute.arch.fmax(amax / Float32(E4M3_MAX), Float32(SCALE_FLOOR))
        bits = f32_bits(r)
        e = ((bits >> 23) & 0xFF) - 127
        if (bits & 0x7FFFFF) != 0:
            e = e + 1                                                               # ceil(log2 r), exactly
        scale = bits_f32((e + 127) << 23)
        inv = bits_f32((127 - e) << 23)
        q = [f32x4_to_e4m3x4(v[4 * j] * inv, v[4 * j + 1] * inv, v[4 * j + 2] * inv, v[4 * j + 3] * inv)
             for j in range(4)]
        st_global_v4_b32(out + 16 * lane, q[0], q[1], q[2], q[3], policy)
        if lane % 8 == 0:
            st_global_b32(out + (NOPE + 4 * (lane // 8)), f32_bits(scale))
        _copy_rope(row + 2 * NOPE, out + ROPE_BYTE, lane, policy)

    @cute.jit
    def dequantize_token(p_src: cute.Pointer, p_dst: cute.Pointer, tok: Int32, ld: Int64, lane: Int32, policy):
        row = p_src + Int64(tok) * ld                                               # the cache row's first byte
        out = cute.recast_ptr(p_dst + Int64(tok) * KV_DIM, dtype=cutlass.Int8)      # the bf16 row's first byte
        w = _words(row + 16 * lane)                                                 # 16 E4M3 bytes
        sc = ld_global_nc_f32(row + (NOPE + 4 * (lane // 8)))
        b = [e4m3x2_scaled_bf16x2(w[i // 2], i % 2 == 1, sc) for i in range(8)]   # 16 bf16: 8 words
        st_global_v4_b32(out + 32 * lane, b[0], b[1], b[2], b[3], policy)
        st_global_v4_b32(out + 32 * lane + 16, b[4], b[5], b[6], b[7], policy)
        _copy_rope(row + ROPE_BYTE, out + 2 * NOPE, lane, policy)

    @cute.kernel
    def kernel(p_src: cute.Pointer, p_dst: cute.Pointer, n_tok: Int32, ld: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        tok = bid * WARPS + warp
        policy = l2_evict_first_policy()
        if tok < n_tok:
            if cutlass.const_expr(dequantize):
                dequantize_token(p_src, p_dst, tok, ld, lane, policy)
            else:
                quantize_token(p_src, p_dst, tok, ld, lane, policy)

    @cute.jit
    def host(p_src: cute.Pointer, p_dst: cute.Pointer, n_tok: Int32, ld: Int64):
        kernel(p_src, p_dst, n_tok, ld).launch(grid=((n_tok + WARPS - 1) // WARPS, 1, 1), block=(32 * WARPS, 1, 1),
                                               smem=0)

    return BuiltKernel(params(dequantize), launch(), kernel, host)
