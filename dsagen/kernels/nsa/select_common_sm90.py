"""What the NSA kernels over token items share (the selected branch's forward and dq, the compressed branch's forward
and importance): warp 1's scheduler, which turns the slots of a CTA's TOK tokens into the list of distinct blocks they
chose with the mask of the tokens that chose each (`make_schedule(TOK, NE, BN)`; the compressed branch's
`make_cmp_schedule` lists each token's complete blocks itself; both end in `make_merge`; the kernels' docstrings:
select_fwd_sm90), the mbarrier set-up, the TMA warp's loop over the listed blocks' K and V (`make_kv_producer`), the
consumer rows' token and packed row (`row_tokens`) and, for the compressed rows, their last key (`row_key_limits`),
and the register budgets. A kernel's Smem struct must have the fields these use (q_full, list_full, k_full, v_full,
kv_free, n_ent, tok_first, tok_pos, tok_blocks, start, rank, ent)."""
import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as xcuda
from cutlass import Int32, Int64

from dsagen.kernels.common.sm90.ring import ring_wait_free
from dsagen.kernels.common.sm90.sequences import token_range
from dsagen.kernels.common.sm90.tma import tma_load_tile
from dsagen.kernels.nsa.spec import MAX_TOK

REGS_PRODUCER = 40
# consumer registers by CTAs per SM: two CTAs of 256 threads have 128 x (40 + 216) = 32768 registers each; one CTA
# (shared memory for one only, e.g. blocks of 128) gives its consumer 256
REGS_CONSUMER = {2: 216, 1: 256}
SMEM_2_CTAS = 113 * 1024    # the most dynamic shared memory per CTA with two CTAs on an SM (228 KiB, 1 KiB each reserved)
BAR_QPAD = 1                # named barrier: the consumer zeroed its tiles' padding rows (128 threads)


# The scheduler's inputs in the item kernels' ABI (forward and dq): its pointers (after the kernel's tensormaps) and
# its scalars (after the kernel's own output pointers), in this order.
LIST_PTR_PARAMS = [
    {"name": "idx", "kind": "ptr", "dtype": "int32", "align": 4},        # [N, H, S] block ids, any strides
    {"name": "cnt", "kind": "ptr", "dtype": "int32", "align": 4},        # [N, H] slot counts (has_cnt)
    {"name": "cu", "kind": "ptr", "dtype": "int32", "align": 4},         # [n_docs + 1] packed offsets
]
LIST_SCALAR_PARAMS = [
    {"name": "n_tok", "kind": "i32"},                                    # N
    {"name": "seq_len", "kind": "i32"},                                  # tokens per sequence when n_docs = 0
    {"name": "n_docs", "kind": "i32"},                                   # 0: sequences of seq_len tokens
    {"name": "n_kv", "kind": "i32"},                                     # H
    {"name": "n_groups", "kind": "i32"},                                 # ceil(N / TOK)
    {"name": "n_slots", "kind": "i32"},                                  # S (<= max_slots)
    {"name": "has_cnt", "kind": "i32"},
    {"name": "cnt_all", "kind": "i32"},                                  # the count when has_cnt == 0
    {"name": "idx_st", "kind": "i64"},
    {"name": "idx_sh", "kind": "i64"},
    {"name": "idx_ss", "kind": "i64"},
    {"name": "cnt_st", "kind": "i64"},
    {"name": "cnt_sh", "kind": "i64"},
]


# The compressed branch's kernels (forward, importance): their scheduler's pointers and scalars, in this order.
CMP_PTR_PARAMS = [
    {"name": "ccu", "kind": "ptr", "dtype": "int32", "align": 4},        # [n_docs + 1] sequences' first compressed rows
    {"name": "cu", "kind": "ptr", "dtype": "int32", "align": 4},         # [n_docs + 1] packed offsets
]
CMP_SCALAR_PARAMS = [
    {"name": "n_tok", "kind": "i32"},                                    # N (the tokens of the items)
    {"name": "seq_len", "kind": "i32"},                                  # tokens per sequence when n_docs = 0
    {"name": "n_docs", "kind": "i32"},                                   # 0: sequences of seq_len tokens
    {"name": "n_kv", "kind": "i32"},                                     # H
    {"name": "n_groups", "kind": "i32"},                                 # items per KV head
    {"name": "n_slots", "kind": "i32"},                                  # most tiles of 64 compressed rows a token has
    {"name": "cmp_block", "kind": "i32"},                                # tokens per compressed row (NSA block_size)
    {"name": "n_keys", "kind": "i32"},                                   # compressed rows of k / v (their tensormaps)
]


def qkv_host_args(dtype: str, with_dout: bool) -> list:
    """The head of an NSA kernel's HOST_ARGS (its `host` builds the tensormaps from them): the q, k, v (and dO)
    pointers, the query head count, then each tensor's token and head strides in elements."""
    names = [("q", "q"), ("k", "k"), ("v", "v")] + ([("dout", "do")] if with_dout else [])
    ptrs = [{"name": n, "kind": "ptr", "dtype": dtype, "align": 16} for n, _ in names]
    strides = [{"name": f"{a}_{x}", "kind": "i64"} for _, a in names for x in ("st", "sh")]
    return ptrs + [{"name": "n_q_heads", "kind": "i32"}] + strides


@cute.jit
def rows_map(p: cute.Pointer, dtype: cutlass.Constexpr, dim: cutlass.Constexpr, heads, n_tok, s_tok, s_head,
             box_heads: cutlass.Constexpr, box_rows: cutlass.Constexpr):
    """The SW128 TMA descriptor of a [n_tok, heads, dim] tensor (strides s_tok, s_head in elements; the encoder takes
    16-byte units) with boxes of 64 columns x box_heads heads x box_rows tokens."""
    return xcuda.create_tensor_map_tiled(global_address=p.toint(), dtype=dtype, global_dims=[dim, heads, n_tok],
                                         global_strides=[s_head // 8, s_tok // 8],
                                         box_dims=[64, box_heads, box_rows], swizzle=xcuda.TensorMapSwizzle.s128b)


@cute.jit
def init_item_barriers(warp, st, stages: int) -> None:
    """The item kernels' mbarriers, by one elected thread of warp 0, then the init fence and a CTA barrier (every
    thread calls it): q_full (the Q tile's transaction count), list_full (the scheduler warp's 32 lanes), per ring
    stage k_full and v_full (transaction counts) and kv_free (one arrival per consumer warp: the K and V tiles are
    read by wgmma only)."""
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(st.q_full.data_ptr(), 1)
            cute.arch.mbarrier_init(st.list_full.data_ptr(), 32)
            for i in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(st.k_full.data_ptr() + i, 1)
                cute.arch.mbarrier_init(st.v_full.data_ptr() + i, 1)
                cute.arch.mbarrier_init(st.kv_free.data_ptr() + i, 4)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def make_kv_producer(BN: int, D: int, DV: int, ST: int, NE: int, with_v: bool = True):
    """The TMA warp's loop over an item's listed blocks: once the list is published, per entry the block's K and V
    tiles (BN rows of head h, D and DV columns) into ring stage e % ST (NE: the list's capacity); with_v=False loads
    K only (v_tma and sV are then not read)."""
    KBQ, KBV = D // 64, DV // 64

    @cute.jit
    def kv_producer(st, lane, h, k_tma, v_tma, sK, sV):
        k_full = st.k_full.data_ptr()
        v_full = st.v_full.data_ptr()
        kv_free = st.kv_free.data_ptr()
        s_ent = st.ent.get_tensor(cute.make_layout(2 * NE))
        n_ent = st.n_ent.get_tensor(cute.make_layout(4))
        cute.arch.mbarrier_wait(st.list_full.data_ptr(), 0)
        n = Int32(0)
        if lane == 0:
            n = n_ent[0]
        n = cute.arch.shuffle_sync(n, 0)
        for e in cutlass.range(n, unroll=1):
            stage = e % ST
            ring_wait_free(kv_free, e, ST)
            start = Int32(0)
            if lane == 0:
                start = s_ent[2 * e]
            start = cute.arch.shuffle_sync(start, 0)
            tma_load_tile(k_tma, ((sK[None, None, stage].iterator, BN * 64, KBQ, (h, start)),),
                          k_full + stage, BN * D * 2)
            if cutlass.const_expr(with_v):
                tma_load_tile(v_tma, ((sV[None, None, stage].iterator, BN * 64, KBV, (h, start)),),
                              v_full + stage, BN * DV * 2)

    return kv_producer


@cute.jit
def zero_padding_rows(ctid, tiles, rows: cutlass.Constexpr, m: cutlass.Constexpr) -> None:
    """The consumer warpgroup (ctid 0..127) zeroes rows rows..m - 1 of each (tile, columns) of `tiles` once (the TMA
    boxes fill only the first `rows`, so the padding rows multiply zeros), then fences them for the async proxy and
    syncs the warpgroup (BAR_QPAD)."""
    for tile, cols in tiles:
        for i in cutlass.range(ctid, (m - rows) * cols, 128, unroll=1):
            tile[rows + i // cols, i % cols] = tile.element_type(0.0)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=BAR_QPAD, number_of_threads=128)


@cute.jit
def row_tokens(st, cS, row_tok, row_pos, G: cutlass.Constexpr, ROWS: cutlass.Constexpr) -> None:
    """Per accumulator row r of the consumer thread (cS: the accumulator's coordinates): row_tok[r] its token within
    the item and row_pos[r] the token's packed row (-1 for padding rows and tokens past the last)."""
    tok_pos = st.tok_pos.get_tensor(cute.make_layout(MAX_TOK))
    for r in cutlass.range_constexpr(cute.size(row_tok)):
        row = cS[r, 0][0]
        tau = row // G
        row_tok[r] = tau
        row_pos[r] = Int32(-1)
        if row < ROWS:
            row_pos[r] = tok_pos[tau]


@cute.jit
def row_key_limits(st, row_tok, row_pos, row_lim) -> None:
    """The compressed kernels' per-row last key: row_lim[r] = the row's token's last compressed row (tok_first +
    tok_blocks - 1, below tok_first when it has none), for rows with a token (row_pos >= 0)."""
    tok_first = st.tok_first.get_tensor(cute.make_layout(MAX_TOK))
    tok_blocks = st.tok_blocks.get_tensor(cute.make_layout(MAX_TOK))
    for r in cutlass.range_constexpr(cute.size(row_lim)):
        row_lim[r] = Int32(-1)
        if row_pos[r] >= 0:
            row_lim[r] = tok_first[row_tok[r]] + tok_blocks[row_tok[r]] - 1


def make_merge(TOK: int, NE: int):
    """The scheduler's second half, shared by both schedulers: from the per (token, slot) first key rows in
    st.start (-1: empty), each slot's rank among its token's earlier slots naming the same row, then one entry per
    distinct (row, rank) with the mask of the tokens that have it, in order of first appearance; n_ent last. Every
    lane arrives on list_full."""

    @cute.jit
    def merge(st, lane, n_slots):
        s_start = st.start.get_tensor(cute.make_layout(NE))
        s_rank = st.rank.get_tensor(cute.make_layout(NE))
        s_ent = st.ent.get_tensor(cute.make_layout(2 * NE))
        n_ent = st.n_ent.get_tensor(cute.make_layout(4))
        n_e = TOK * n_slots
        for e in cutlass.range(lane, n_e, 32, unroll=1):
            start = s_start[e]
            tau = e // n_slots
            r = Int32(0)
            if start >= 0:
                for e2 in cutlass.range(tau * n_slots, e, unroll=1):
                    if s_start[e2] == start:
                        r += 1
            s_rank[e] = r
        cute.arch.sync_warp()
        base = Int32(0)
        lt_mask = cute.arch.lanemask_lt()
        for e0 in cutlass.range(0, n_e, 32, unroll=1):
            e = e0 + lane
            start = Int32(-1)
            r = Int32(0)
            if e < n_e:
                start = s_start[e]
                r = s_rank[e]
            is_first = Int32(0)
            mask = Int32(0)
            if start >= 0:
                is_first = Int32(1)
                for tau2 in cutlass.range(TOK, unroll=1):
                    for s2 in cutlass.range(n_slots, unroll=4):
                        e2 = tau2 * n_slots + s2
                        if s_start[e2] == start and s_rank[e2] == r:
                            mask = mask | (Int32(1) << tau2)
                            if e2 < e:
                                is_first = Int32(0)
            ballot = cute.arch.vote_ballot_sync(is_first != 0)
            if is_first != 0:
                at = base + Int32(cute.arch.popc(ballot & lt_mask))
                s_ent[2 * at] = start
                s_ent[2 * at + 1] = mask
            base += Int32(cute.arch.popc(ballot))
        if lane == 0:
            n_ent[0] = base
        cute.arch.mbarrier_arrive(st.list_full.data_ptr())

    return merge


@cute.jit
def token_info(st, lane, t0, n_tok, TOK: cutlass.Constexpr, keys, keys_args):
    """Warp 1's per-token table of an item of TOK tokens from t0: lane tau < TOK writes token t0 + tau's first key
    row, position and key count into st.tok_first / tok_pos / tok_blocks (keys(tok, *keys_args) -> (first, count);
    position -1 and no keys past n_tok), then the warp syncs. Returns the three tables."""
    tok_first = st.tok_first.get_tensor(cute.make_layout(MAX_TOK))
    tok_pos = st.tok_pos.get_tensor(cute.make_layout(MAX_TOK))
    tok_blocks = st.tok_blocks.get_tensor(cute.make_layout(MAX_TOK))
    if lane < TOK:
        tok = t0 + lane
        pos = Int32(-1)
        first = Int32(0)
        count = Int32(0)
        if tok < n_tok:
            first, count = keys(tok, *keys_args)
            pos = tok
        tok_first[lane] = first
        tok_pos[lane] = pos
        tok_blocks[lane] = count
    cute.arch.sync_warp()
    return tok_first, tok_pos, tok_blocks


@cute.jit
def block_keys(tok, p_cu, n_docs, seq_len, BN: cutlass.Constexpr):
    """The selected branch's keys of token tok: its sequence's first row and the sequence's blocks of BN keys."""
    first, length, _ = token_range(p_cu, n_docs, seq_len, tok)
    return first, (length + BN - 1) // BN


@cute.jit
def compressed_keys(tok, p_ccu, p_cu, n_docs, seq_len, cmp_block):
    """The compressed branch's keys of token tok: its sequence's first compressed row (i * ceil(seq_len /
    cmp_block) for sequence i when n_docs == 0, else ccu[i]) and the complete blocks before or at it."""
    first, _, seq = token_range(p_cu, n_docs, seq_len, tok)
    nk = (tok - first + 1) // cmp_block
    kfirst = Int32(0)
    if n_docs == 0:
        kfirst = seq * ((seq_len + cmp_block - 1) // cmp_block)
    else:
        kfirst = (p_ccu + seq).load()
    return kfirst, nk


def make_schedule(TOK: int, NE: int, BN: int):
    """The scheduler of items of TOK tokens, at most NE (token, slot) entries, blocks of BN keys."""
    merge = make_merge(TOK, NE)

    @cute.jit
    def schedule(st, lane, t0, h, p_idx, p_cnt, p_cu, n_tok, seq_len, n_docs, n_slots, has_cnt, cnt_all, idx_st,
                 idx_sh, idx_ss, cnt_st, cnt_sh):
        """Warp 1: the item's entry list. Token info first (lanes < TOK), then per (token, slot) its block's first
        key row (-1: empty slot, a block after the token, an id out of range or a slot past the count), then
        `merge`."""
        tok_first, tok_pos, tok_blocks = token_info(st, lane, t0, n_tok, TOK, block_keys, (p_cu, n_docs, seq_len, BN))
        s_start = st.start.get_tensor(cute.make_layout(NE))
        n_e = TOK * n_slots
        for e in cutlass.range(lane, n_e, 32, unroll=1):
            tau = e // n_slots
            s = e - tau * n_slots
            pos = tok_pos[tau]
            start = Int32(-1)
            if pos >= 0:
                cnt = cnt_all
                if has_cnt != 0:
                    cnt = (p_cnt + (Int64(pos) * cnt_st + Int64(h) * cnt_sh)).load()
                if s < cnt:
                    j = (p_idx + (Int64(pos) * idx_st + Int64(h) * idx_sh + Int64(s) * idx_ss)).load()
                    first = tok_first[tau]
                    if j >= 0 and j < tok_blocks[tau] and j * BN <= pos - first:
                        start = first + j * BN
            s_start[e] = start
        cute.arch.sync_warp()
        merge(st, lane, n_slots)

    return schedule


def make_cmp_schedule(TOK: int, NE: int, BN: int):
    """The compressed branch's scheduler (items of TOK tokens, at most NE entries, tiles of BN compressed rows):
    token tau's keys are the compressed rows [tok_first, tok_first + tok_blocks) (tok_blocks = (its position in its
    sequence + 1) // cmp_block, the complete blocks before or at it; tok_first = ccu[its sequence], the sequence's
    first compressed row), listed as slots of BN rows, then `merge`."""
    merge = make_merge(TOK, NE)

    @cute.jit
    def schedule(st, lane, t0, p_ccu, p_cu, n_tok, seq_len, n_docs, n_slots, cmp_block):
        """Warp 1: the item's entry list (see make_cmp_schedule). With n_docs == 0 sequence i's first compressed row
        is i * ceil(seq_len / cmp_block) and p_ccu is not read."""
        tok_first, tok_pos, tok_blocks = token_info(st, lane, t0, n_tok, TOK, compressed_keys,
                                                    (p_ccu, p_cu, n_docs, seq_len, cmp_block))
        s_start = st.start.get_tensor(cute.make_layout(NE))
        n_e = TOK * n_slots
        for e in cutlass.range(lane, n_e, 32, unroll=1):
            tau = e // n_slots
            s = e - tau * n_slots
            start = Int32(-1)
            if tok_pos[tau] >= 0 and s * BN < tok_blocks[tau]:
                start = tok_first[tau] + s * BN
            s_start[e] = start
        cute.arch.sync_warp()
        merge(st, lane, n_slots)

    return schedule
