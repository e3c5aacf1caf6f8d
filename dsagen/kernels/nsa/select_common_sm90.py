"""The work-item scheduler the NSA selected-branch kernels share (forward and dq): warp 1 of a CTA turns the slots
of its TOK tokens into the list of distinct blocks they chose, with the mask of the tokens that chose each (the
kernels' docstrings: select_fwd_sm90). `make_schedule(TOK, NE, BN)` returns its @cute.jit function; a kernel's Smem
struct must have the fields it writes (list_full, n_ent, tok_first, tok_pos, tok_blocks, start, rank, ent)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dsagen.kernels.nsa.spec import MAX_TOK


def make_schedule(TOK: int, NE: int, BN: int):
    """The scheduler of items of TOK tokens, at most NE (token, slot) entries, blocks of BN keys."""

    @cute.jit
    def token_range(p_cu: cute.Pointer, n_docs: Int32, seq_len: Int32, tok: Int32):
        """(first row, length) of token tok's sequence: sequence tok // seq_len when n_docs == 0, else the packed
        sequence i with cu[i] <= tok < cu[i + 1] (binary search; empty sequences are skipped by it)."""
        first = Int32(0)
        length = Int32(0)
        if n_docs == 0:
            first = tok // seq_len * seq_len
            length = seq_len
        else:
            lo = Int32(0)
            hi = n_docs
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if (p_cu + mid).load() <= tok:
                    lo = mid
                else:
                    hi = mid
            first = (p_cu + lo).load()
            length = (p_cu + lo + 1).load() - first
        return first, length

    @cute.jit
    def schedule(st, lane, t0, h, p_idx, p_cnt, p_cu, n_tok, seq_len, n_docs, n_slots, has_cnt, cnt_all, idx_st,
                 idx_sh, idx_ss, cnt_st, cnt_sh):
        """Warp 1: the item's entry list. Token info first (lanes < TOK), then per (token, slot) its block's first
        key row (-1: empty slot, a block after the token, an id out of range or a slot past the count) and its rank
        among its token's earlier slots naming the same block, then one entry per distinct (row, rank) with the mask
        of the tokens that have it, in order of first appearance; n_ent last. Every lane arrives on list_full."""
        tok_first = st.tok_first.get_tensor(cute.make_layout(MAX_TOK))
        tok_pos = st.tok_pos.get_tensor(cute.make_layout(MAX_TOK))
        tok_blocks = st.tok_blocks.get_tensor(cute.make_layout(MAX_TOK))
        s_start = st.start.get_tensor(cute.make_layout(NE))
        s_rank = st.rank.get_tensor(cute.make_layout(NE))
        s_ent = st.ent.get_tensor(cute.make_layout(2 * NE))
        n_ent = st.n_ent.get_tensor(cute.make_layout(4))
        if lane < TOK:
            tok = t0 + lane
            pos = Int32(-1)
            first = Int32(0)
            nblk = Int32(0)
            if tok < n_tok:
                first, length = token_range(p_cu, n_docs, seq_len, tok)
                pos = tok
                nblk = (length + BN - 1) // BN
            tok_first[lane] = first
            tok_pos[lane] = pos
            tok_blocks[lane] = nblk
        cute.arch.sync_warp()
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

    return schedule
