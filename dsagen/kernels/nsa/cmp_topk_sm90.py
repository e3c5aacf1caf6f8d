"""NSA compressed-branch block selection (sm_90a): `build(...)` makes the kernel of one NsaCmpTopkSpec.

For token t in [tok_begin, n_tok) and KV head h, with own = (t's position in its sequence) // cmp_block, the
candidates are t's blocks c <= own: c < own scored by the importance imp[t - tok_begin, h, c] (cmp_importance_sm90),
own scored own_score (G: each of the G heads counts its own block as 1). The kernel writes

    sel[t, h, s] = the s-th candidate in the order (score descending, block id descending), s < n_select

and -1 past the candidates: the reference's selection (ties go to the larger block id; the own block, whose score no
sum of G probabilities exceeds, comes first). One warp per (t, h): n_select rounds, each a warp-wide arg max over the
candidates ordered below the previous pick (each lane scans its candidates c = lane, lane + 32, ...), so the picks
come out sorted; the keys (score, id) are distinct, so no candidate is taken twice.

Constraints: imp rows imp_ld floats apart holding at least own floats; sel [N, H, n_select]
int32 contiguous.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsagen.kernels.common.sm90.cta import cta_coords
from dsagen.kernels.common.sm90.sequences import token_range

WARPS = 4


def build():
    """The kernel of NsaCmpTopkSpec: returns (kernel, host, PARAMS, HOST_ARGS, LAUNCH)."""
    NTHREADS = 32 * WARPS

    PARAMS = [
        {"name": "imp", "kind": "ptr", "dtype": "float32", "align": 4},      # [n_tok - tok_begin, H, imp_ld]
        {"name": "cu", "kind": "ptr", "dtype": "int32", "align": 4},         # [n_docs + 1] packed offsets
        {"name": "sel", "kind": "ptr", "dtype": "int32", "align": 4},        # [N, H, n_select]
        {"name": "n_tok", "kind": "i32"},                                    # the launch's end token
        {"name": "tok_begin", "kind": "i32"},                                # its first token
        {"name": "seq_len", "kind": "i32"},                                  # tokens per sequence when n_docs = 0
        {"name": "n_docs", "kind": "i32"},
        {"name": "n_kv", "kind": "i32"},                                     # H
        {"name": "cmp_block", "kind": "i32"},                                # tokens per block
        {"name": "n_select", "kind": "i32"},                                 # blocks per row
        {"name": "imp_ld", "kind": "i32"},
        {"name": "own_score", "kind": "f32"},                                # the own block's score (G)
    ]
    HOST_ARGS = PARAMS
    LAUNCH = {"grid": [f"ceil_div((n_tok - tok_begin) * n_kv, {WARPS})", 1, 1], "block": [NTHREADS, 1, 1],
              "cluster": [1, 1, 1], "smem": 0}

    @cute.jit
    def before(v: Float32, c: Int32, pv: Float32, pc: Int32):
        """(v, c) orders below (pv, pc): a lower score, or the same score and a lower id."""
        below = Int32(0)
        if v < pv:
            below = Int32(1)
        elif v == pv and c < pc:
            below = Int32(1)
        return below

    @cute.kernel
    def kernel(p_imp: cute.Pointer, p_cu: cute.Pointer, p_sel: cute.Pointer, n_tok: Int32, tok_begin: Int32,
               seq_len: Int32, n_docs: Int32, n_kv: Int32, cmp_block: Int32, n_select: Int32, imp_ld: Int32,
               own_score: Float32):
        coords = cta_coords()
        bid, warp = coords.bidx, coords.warp
        lane = cute.arch.lane_idx()
        i = bid * WARPS + warp                           # (token - tok_begin) * H + h
        if i < (n_tok - tok_begin) * n_kv:
            tok = tok_begin + i // n_kv
            h = i - (tok - tok_begin) * n_kv
            first, _, _ = token_range(p_cu, n_docs, seq_len, tok)
            own = (tok - first) // cmp_block
            row = p_imp + Int64(i) * imp_ld
            out = p_sel + (Int64(tok) * n_kv + h) * n_select
            pv = Float32.inf
            pc = Int32(2**31 - 1)
            for s in cutlass.range(n_select, unroll=1):
                bv = -Float32.inf
                bc = Int32(-1)
                for c in cutlass.range(lane, own + 1, 32, unroll=1):
                    v = own_score
                    if c < own:
                        v = (row + c).load()
                    if before(v, c, pv, pc) != 0:
                        if before(bv, bc, v, c) != 0:
                            bv = v
                            bc = c
                for lvl in cutlass.range_constexpr(5):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=1 << lvl)
                    oc = cute.arch.shuffle_sync_bfly(bc, offset=1 << lvl)
                    if before(bv, bc, ov, oc) != 0:
                        bv = ov
                        bc = oc
                if lane == 0:
                    (out + s).store(bc)
                pv = bv
                pc = bc

    @cute.jit
    def host(p_imp: cute.Pointer, p_cu: cute.Pointer, p_sel: cute.Pointer, n_tok: Int32, tok_begin: Int32,
             seq_len: Int32, n_docs: Int32, n_kv: Int32, cmp_block: Int32, n_select: Int32, imp_ld: Int32,
             own_score: Float32):
        """The launch: one warp per (token, KV head) of [tok_begin, n_tok)."""
        rows = (n_tok - tok_begin) * n_kv
        kernel(p_imp, p_cu, p_sel, n_tok, tok_begin, seq_len, n_docs, n_kv, cmp_block, n_select, imp_ld,
               own_score).launch(grid=((rows + WARPS - 1) // WARPS, 1, 1), block=(NTHREADS, 1, 1))

    return kernel, host, PARAMS, HOST_ARGS, LAUNCH
