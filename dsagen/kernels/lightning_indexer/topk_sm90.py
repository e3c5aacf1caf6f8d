"""Radix top-k over fp32 rows (sm_90a): `build(threads, sample, compact_cap)` makes the kernel of one IndexerTopkSpec
(the lightning indexer's score slab), `build(..., rows=True)` that of one IndexerTopkRowsSpec (the standalone
`indexer_topk` over a matrix with per-row lengths), `build(..., forward=True)` that of the slab kernel of
indexer_forward_topk. All run the same per-row selection (`select`).

For slab row r (query token (b, t) of the slab's token blocks) with n = hi - lo valid candidates, the kernel writes
the ids of its `topk` largest scores to out[b, t, :] in ascending order (ties at the threshold resolved toward lower
ids), or 0..n-1 followed by -1 when n <= topk. The rows kernel does the same for row r of the matrix over its first
n = clamp(lens[r // rows_per_len], 0, n_cols) columns, into out[r, :], and writes each selected id's score beside it
(values[r, :], -inf past the valid count). The forward kernel (`build(..., forward=True)`, indexer_forward_topk's
IndexerTopkSpec(forward_topk=True)) is the slab kernel with the dense indexer's causal limit (per-segment causal
offsets) that also writes the values; its softmax form (IndexerTopkSpec.softmax) then finishes the row in the same
CTA, as topk_softmax_sm90's kernel would (LSE, softmax over the selected slots, global ids), from the row's 8 * topk
bytes it has just written (L2).

One CTA of `threads` threads per row; warp w owns one contiguous segment of the row (a multiple of 128 keys, read
with 128-bit loads, 4 loads in flight per thread). Scores become order-preserving uint32 keys (negative floats: all
bits flipped; others: sign bit set). Up to four 8-bit radix passes find the k-th largest key: each warp histograms
the current digit of its segment's keys that match the digits found so far into its OWN 256-bin histogram; the
block sums them and a descending scan finds the crossing digit. From its own histogram each warp then knows how many
of its keys lie above the crossing bin (added to its "greater" count) and how many in it (its candidates for the
next pass; a warp without any skips the pass). The passes stop early when the crossing bin is taken whole. So after
the last pass every warp knows #(key > thr) and #(key == thr) of its segment, where thr is the key prefix found so
far: one exclusive scan over the warps gives each warp its output offsets, and the warps emit their segments in
order without block barriers (ballots + popc within a warp). The ties at thr take the lowest ids, since the
#(== thr) counts are prefix-summed in id order. The result depends on nothing but the scores (deterministic).

sample: rows of n >= 4 * topk first find a 16-bit key prefix tau from THREADS evenly spaced keys, then read the row
once, storing every key >= tau as (key, id) in its warp's own CAP / warps entries; when those hold >= topk keys and no
warp overflowed, every radix pass and the emit run on the entries. Other rows are compacted: at the first pass
p >= 1 where the row's keys that can still be selected (those >= the prefix found so far: the topk - k_rem above it
plus the crossing bin's) fit CAP entries, the global pass also stores them as (key, id) into shared memory, in id
order and warp by warp (ballot ranks within a 128-key step; warp offsets from one scan of the per-warp counts). Later
passes histogram those entries and the emit walks them instead of the row. Rows whose candidates never fit run from
global memory throughout.

The slab words of a row past its n candidates up to the next 16-byte boundary (never written by the score kernel,
read by the row's last vector load) are zeroed by the thread that loads them, so no load reads unwritten memory. The
rows kernel never writes its input: the host gives it rows whose stride covers n rounded up to 4 words of readable
memory (masked keys).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from dsagen.kernels.common.sm90.reduce import warp_inclusive_scan
from dsagen.kernels.lightning_indexer.common_sm90 import row_bounds
from dsagen.kernels.lightning_indexer.topk_softmax_sm90 import finish_row

NBINS = 256
VEC = 4                                # keys per 128-bit load
STEP = 32 * VEC                        # keys one warp-wide load covers
UNROLL = 4                             # 128-bit loads in flight per thread

PARAMS = [
    {"name": "slab", "kind": "ptr", "dtype": "float32", "align": 16},   # (nrows, ld_slab) fp32 scores
    {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},       # [B, T, topk] int32
    {"name": "cu_q", "kind": "ptr", "dtype": "int32", "align": 4},
    {"name": "cu_k", "kind": "ptr", "dtype": "int32", "align": 4},
    {"name": "n_docs", "kind": "i32"},
    {"name": "T", "kind": "i32"},
    {"name": "S", "kind": "i32"},
    {"name": "n_tblk", "kind": "i32"},                                  # token blocks per batch element
    {"name": "blk0", "kind": "i32"},                                    # first token block of the slab
    {"name": "qc", "kind": "i32"},                                      # tokens per token block
    {"name": "nrows", "kind": "i32"},                                   # slab rows (= blocks * qc)
    {"name": "topk", "kind": "i32"},
    {"name": "causal", "kind": "i32"},
    {"name": "ratio", "kind": "i32"},
    {"name": "ld_slab", "kind": "i64"},                                 # a multiple of 4 (16-byte rows)
]


@cute.jit
def f32_key(bits: Uint32) -> Uint32:
    # Int32 >> 31 is arithmetic (0 or -1). Keep Uint32 operands on Uint32 ops: a Python int turns them signed.
    return bits ^ ((Int32(bits) >> 31).to(Uint32) | Uint32(0x80000000))


@cute.jit
def f32_bits(key: Uint32) -> Uint32:
    """The fp32 bits of an order-preserving key (the inverse of f32_key)."""
    return key ^ Uint32(0x80000000) if (key >> Uint32(31)) != Uint32(0) else ~key


@cute.jit
def emit_slot(mOut, pos, idx, mVal, has_vals, src, at, from_key: cutlass.Constexpr = False):
    """mOut[pos] = idx, and mVal[pos] = the selected score's fp32 bits when the values are wanted (mVal not None at
    trace time, the run-time has_vals not 0), read from src[at] only then: score bits, or with from_key an
    order-preserving key (f32_key's) that f32_bits converts back."""
    mOut[pos] = idx
    if cutlass.const_expr(mVal is not None):
        if has_vals != 0:
            mVal[pos] = f32_bits(src[at]) if from_key else src[at]


@cute.jit
def ballot_ranks(frag, u: int, ok, i0, n, shift: int, threshold, lt_mask):
    """The warp's ballot over the VEC keys of vector u of `frag` whose top bits (key >> shift) are >= threshold
    (keys at ids >= n, or of a vector past the segment (ok False), never count): (m_before, m_tot) = how many of
    them the lanes below this one hold, and the warp's total. The ballots come first, with no branch between them."""
    m_before = Int32(0)
    m_tot = Int32(0)
    for j in cutlass.range_constexpr(VEC):
        bm = cute.arch.vote_ballot_sync(ok and i0 + j < n and (f32_key(frag[j, u]) >> Uint32(shift)) >= threshold)
        m_before += cute.arch.popc(bm & lt_mask)
        m_tot += cute.arch.popc(bm)
    return m_before, m_tot


@cute.jit
def load_group(frag, mV, s0, nsteps, w0, lane, n):
    """Loads UNROLL 128-bit vectors of this warp's segment, steps s0 .. s0 + UNROLL - 1, into frag (VEC, UNROLL).
    Vectors past the segment are not loaded (the callers mask their keys)."""
    for u in cutlass.range_constexpr(UNROLL):
        if s0 + u < nsteps:
            if w0 + (s0 + u) * STEP + lane * VEC < n:
                cute.autovec_copy(mV[None, (w0 + (s0 + u) * STEP) // VEC + lane], frag[None, u])


@cute.jit
def global_pass(p: cutlass.Constexpr, frag, mV, cand, nsteps, w0, lane, n, sWh, hbase, prefix):
    """Radix pass p over this warp's segment in global memory: histogram digit p of the keys matching prefix into
    the warp's bins at hbase (a warp without candidates skips the loads)."""
    if cand != 0:
        for s0 in cutlass.range(0, nsteps, UNROLL, unroll=1):
            load_group(frag, mV, s0, nsteps, w0, lane, n)
            for u in cutlass.range_constexpr(UNROLL):
                for j in cutlass.range_constexpr(VEC):
                    i = w0 + (s0 + u) * STEP + lane * VEC + j
                    key = f32_key(frag[j, u])
                    if s0 + u < nsteps and i < n:
                        if cutlass.const_expr(p == 0):
                            cute.arch.atomic_add((sWh.iterator + (hbase + Int32(key >> Uint32(24)))).llvm_ptr,
                                                 Int32(1))
                        else:
                            if (key >> Uint32(32 - 8 * p)) == prefix:
                                cute.arch.atomic_add(
                                    (sWh.iterator + (hbase + Int32((key >> Uint32(24 - 8 * p)) & Uint32(0xFF)))).llvm_ptr,
                                    Int32(1))


@cute.jit
def global_emit(frag, mV, mOut, nsteps, w0, lane, n, shift, prefix, k_eq, below, gt_run, gt_end, eq_run, eq_end,
                mVal=None, has_vals=None):
    """The ordered emit from this warp's segment in global memory: selected = key > thr, or key == thr among the
    first k_eq of the row (by id); gt_run / eq_run: the row's selected-greater / tied keys before this warp. mVal
    (None: no values): the selected scores' bits, slot by slot beside mOut, written when has_vals is not 0."""
    s0 = Int32(0)
    while s0 < nsteps and (gt_run < gt_end or eq_run < eq_end):   # warp-uniform
        load_group(frag, mV, s0, nsteps, w0, lane, n)
        for u in cutlass.range_constexpr(UNROLL):
            i0 = w0 + (s0 + u) * STEP + lane * VEC
            ok = s0 + u < nsteps
            g_before = Int32(0)
            e_before = Int32(0)
            g_tot = Int32(0)
            e_tot = Int32(0)
            for j in cutlass.range_constexpr(VEC):
                kk = f32_key(frag[j, u]) >> shift
                bg = cute.arch.vote_ballot_sync(ok and i0 + j < n and kk > prefix)
                be = cute.arch.vote_ballot_sync(ok and i0 + j < n and kk == prefix)
                g_before += cute.arch.popc(bg & below)
                e_before += cute.arch.popc(be & below)
                g_tot += cute.arch.popc(bg)
                e_tot += cute.arch.popc(be)
            g_pos = gt_run + g_before
            e_pos = eq_run + e_before
            for j in cutlass.range_constexpr(VEC):
                kk = f32_key(frag[j, u]) >> shift
                if ok and i0 + j < n:
                    if kk > prefix:
                        emit_slot(mOut, g_pos + cutlass.min(e_pos, k_eq), i0 + j, mVal, has_vals, frag, (j, u))
                        g_pos += 1
                    if kk == prefix:
                        if e_pos < k_eq:
                            emit_slot(mOut, g_pos + e_pos, i0 + j, mVal, has_vals, frag, (j, u))
                        e_pos += 1
            gt_run += g_tot
            eq_run += e_tot
        s0 += UNROLL


PARAMS_ROWS = [
    {"name": "x", "kind": "ptr", "dtype": "float32", "align": 16},      # (n_rows, ld_x) fp32 scores
    {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},       # (n_rows, topk) int32
    {"name": "values", "kind": "ptr", "dtype": "float32", "align": 4},  # (n_rows, topk) fp32 scores (has_values)
    {"name": "lens", "kind": "ptr", "dtype": "int32", "align": 4},      # (n_rows / rows_per_len,) int32
    {"name": "n_rows", "kind": "i32"},
    {"name": "n_cols", "kind": "i32"},
    {"name": "rows_per_len", "kind": "i32"},                            # rows sharing one length (>= 1)
    {"name": "topk", "kind": "i32"},
    {"name": "ld_x", "kind": "i64"},                                    # a multiple of 4 (16-byte rows)
    {"name": "has_values", "kind": "i32"},                              # 0: values is not written
]


#: The indexer_forward_topk form (IndexerTopkSpec.forward_topk): the slab kernel with the dense indexer's causal limit
#: (per-segment q_causal_offsets, always causal) that also writes each selected id's score.
PARAMS_FORWARD = [
    {"name": "slab", "kind": "ptr", "dtype": "float32", "align": 16},   # (nrows, ld_slab) fp32 scores
    {"name": "out", "kind": "ptr", "dtype": "int32", "align": 4},       # [B, T, topk] int32 (local ids)
    {"name": "values", "kind": "ptr", "dtype": "float32", "align": 4},  # [B, T, topk] fp32 (the selected scores)
    {"name": "cu_q", "kind": "ptr", "dtype": "int32", "align": 4},
    {"name": "cu_k", "kind": "ptr", "dtype": "int32", "align": 4},
    {"name": "q_off", "kind": "ptr", "dtype": "int32", "align": 4},     # [segments] causal offsets (has_off)
    {"name": "n_docs", "kind": "i32"},
    {"name": "T", "kind": "i32"},
    {"name": "S", "kind": "i32"},
    {"name": "n_tblk", "kind": "i32"},                                  # token blocks per batch element
    {"name": "blk0", "kind": "i32"},                                    # first token block of the slab
    {"name": "qc", "kind": "i32"},                                      # tokens per token block
    {"name": "nrows", "kind": "i32"},                                   # slab rows (= blocks * qc)
    {"name": "topk", "kind": "i32"},
    {"name": "ratio", "kind": "i32"},
    {"name": "has_off", "kind": "i32"},
    {"name": "ld_slab", "kind": "i64"},                                 # a multiple of 4 (16-byte rows)
]


#: The forward form that also finishes its rows (IndexerTopkSpec.softmax): PARAMS_FORWARD, then the finishing
#: kernel's outputs and flags (topk_softmax_sm90.PARAMS: softmax, lse, want_soft, want_lse, global_ids).
PARAMS_FORWARD_SOFTMAX = PARAMS_FORWARD + [
    {"name": "softmax", "kind": "ptr", "dtype": "float32", "align": 4},  # [B, T, topk] fp32 (want_soft)
    {"name": "lse", "kind": "ptr", "dtype": "float32", "align": 4},      # [B, T] fp32 (want_lse)
    {"name": "want_soft", "kind": "i32"},
    {"name": "want_lse", "kind": "i32"},
    {"name": "global_ids", "kind": "i32"},                              # add the row's key base to its ids
]


def params(forward: bool, softmax: bool = False) -> list[dict]:
    """The ABI of the slab kernel: PARAMS_FORWARD for indexer_forward_topk's form (PARAMS_FORWARD_SOFTMAX when it
    finishes the rows), else PARAMS."""
    if softmax:
        return list(PARAMS_FORWARD_SOFTMAX)
    return list(PARAMS_FORWARD if forward else PARAMS)


def build(threads: int, sample: bool, compact_cap: int, rows: bool = False, forward: bool = False,
          softmax: bool = False):
    """The top-k kernel of IndexerTopkSpec(threads, sample) (rows=False: over the slab rows, ABI PARAMS) or of
    IndexerTopkRowsSpec(threads, sample) (rows=True: row r of an (n_rows, ld_x) fp32 matrix over its first
    clamp(lens[r // rows_per_len], 0, n_cols) columns into out[r] and its scores into values[r], ABI PARAMS_ROWS)
    or of IndexerTopkSpec(threads, sample, forward_topk=True) (forward=True: the slab rows of indexer_forward_topk,
    whose causal limit takes the per-segment offsets q_off (row_bounds with p_off, always causal), their ids into
    out and the selected scores into values, -inf past the valid count; ABI PARAMS_FORWARD; with softmax=True also
    each row's finish, ABI PARAMS_FORWARD_SOFTMAX: the LSE, the softmax over the selected slots and the global ids
    of topk_softmax_sm90, so indexer_forward_topk needs no finishing kernel): returns (kernel, host, LAUNCH).

    threads: 128, 512 or 1024 (CTA size; one CTA per row).  sample: the sampled threshold and the compacted
    candidates in shared memory.  compact_cap: (key, id) entries of shared memory per row (sample only).
    Each call makes new kernel and host functions (every rendered module names its own kernel)."""
    THREADS = threads
    NWARPS = THREADS // 32
    MIN_CTAS = 1 if threads == 1024 else 2 if threads >= 256 else 1024 // threads  # CTAs per SM of the register budget
    OWNERS = min(THREADS, NBINS)           # threads that own bins in the block scan
    BPT = NBINS // OWNERS                  # bins per owner (1 from 256 threads up)
    SAMPLE = sample
    CAP = compact_cap                      # (key, id) smem entries per row (IndexerTopkSpec.sample)
    REG = CAP // NWARPS                    # sampled rows: each warp's own entries (IndexerTopkSpec.sample)

    @cute.struct
    class Smem:
        whist: cute.struct.Align[cute.struct.MemRange[Int32, NWARPS * NBINS], 16]   # warp w: bins [256 w, 256 w + 256)
        wsum: cute.struct.MemRange[Int32, NBINS // 32]     # per-warp totals of the bin scan
        cnt: cute.struct.MemRange[Int32, 2 * NWARPS]       # per-warp #(key > thr), #(key == thr)
        sel: cute.struct.MemRange[Int32, 3]                # after a pass: prefix bits, k_rem, crossing-bin count
        if SAMPLE:
            ckey: cute.struct.Align[cute.struct.MemRange[Uint32, CAP], 16]   # compacted keys, warp by warp in id order
            cid: cute.struct.Align[cute.struct.MemRange[Int32, CAP], 16]     # their ids (row-relative)

    SMEM_BYTES = Smem.size_in_bytes()
    LAUNCH = {"grid": ["n_rows" if rows else "nrows", 1, 1], "block": [THREADS, 1, 1], "cluster": [1, 1, 1],
              "smem": SMEM_BYTES}

    @cute.jit
    def bin_scan(k, pre, sWh, sWsum, sSel, tidx, warp, lane):
        """After every warp histogrammed into its own bins: the block sum of the histograms and a descending scan
        find the bin where the running count crosses k; sSel = ((pre << 8) | bin, k - keys before it, its count),
        pre = the prefix found so far. Ends with a block barrier after sSel is written."""
        cute.arch.sync_threads()
        # block histogram, descending inclusive scan over the bins: owner i (tidx < OWNERS) owns the BPT bins at
        # descending positions i * BPT .. i * BPT + BPT - 1 (bin 255 - position); the other threads add 0
        cb = cute.make_rmem_tensor(cute.make_layout(BPT), Int32)
        ct = Int32(0)
        for j in cutlass.range_constexpr(BPT):
            cb[j] = Int32(0)
            if tidx < OWNERS:
                for w in cutlass.range_constexpr(NWARPS):
                    cb[j] = cb[j] + sWh[w * NBINS + NBINS - 1 - (tidx * BPT + j)]
            ct += cb[j]
        incl = warp_inclusive_scan(ct, lane)
        if lane == 31:
            if warp < OWNERS // 32:
                sWsum[warp] = incl
        cute.arch.sync_threads()
        run = incl - ct                                 # bins before this thread's (descending)
        for w in cutlass.range_constexpr(OWNERS // 32):
            if w < warp:
                run += sWsum[w]
        for j in cutlass.range_constexpr(BPT):
            if tidx < OWNERS:
                if run < k and run + cb[j] >= k:    # exactly one bin crosses k
                    sSel[0] = Int32((pre << Uint32(8)) | Uint32(NBINS - 1 - (tidx * BPT + j)))
                    sSel[1] = k - run
                    sSel[2] = cb[j]
            run += cb[j]
        cute.arch.sync_threads()

    @cute.jit
    def smem_views():
        """The CTA's shared tensors of `select`: (warp histograms, bin-scan totals, per-warp counts, the pass
        result, compacted keys, their ids); the last two are None without sample."""
        st = cutlass.memory.SmemAllocator().allocate(Smem)
        sKey = None
        sId = None
        if cutlass.const_expr(SAMPLE):
            sKey = st.ckey.get_tensor(cute.make_layout(CAP))
            sId = st.cid.get_tensor(cute.make_layout(CAP))
        return (st.whist.get_tensor(cute.make_layout(NWARPS * NBINS)), st.wsum.get_tensor(cute.make_layout(NBINS // 32)),
                st.cnt.get_tensor(cute.make_layout(2 * NWARPS)), st.sel.get_tensor(cute.make_layout(3)), sKey, sId)

    @cute.jit
    def select(sh, p_row_f32: cute.Pointer, n: Int32, mOut: cute.Tensor, topk: Int32, tidx, warp, lane,
               zero_tail: cutlass.Constexpr, mVal=None, has_vals=None):
        """The top-k of one row of n fp32 scores at p_row_f32 (16-byte aligned; one CTA): mOut[0, topk) = the ids
        of its topk largest in ascending order, or 0..n-1 and -1 when n <= topk (module docstring). zero_tail: the
        row's words [n, n rounded up to 4) are unwritten scratch that the loading thread zeroes first (the slab);
        else they are readable memory (masked, never written). sh: smem_views(). mVal (None: no values): a Uint32
        tensor beside mOut that receives the selected scores' bits (-inf past the row's valid count) when the
        run-time has_vals is not 0."""
        sWh, sWsum, sCnt, sSel, sKey, sId = sh
        if n <= topk:
            for i in cutlass.range(tidx, topk, THREADS, unroll=1):
                v = Int32(-1)
                if i < n:
                    v = i
                mOut[i] = v
                if cutlass.const_expr(mVal is not None):
                    if has_vals != 0:
                        bits = Uint32(0xFF800000)               # -inf
                        if i < n:
                            bits = Uint32((cute.recast_ptr(p_row_f32, dtype=Uint32) + i).load())
                        mVal[i] = bits
        else:
            # the row as (VEC, n / VEC) 16-byte vectors: p_row_f32 is 16-byte aligned
            p_row = cute.make_ptr(Uint32, p_row_f32.toint(), cute.AddressSpace.gmem, assumed_align=16)
            mV = cute.make_tensor(p_row, cute.make_layout((VEC, (n + VEC - 1) // VEC)))
            frag = cute.make_rmem_tensor(cute.make_layout((VEC, UNROLL)), Uint32)
            for u in cutlass.range_constexpr(UNROLL):
                for j in cutlass.range_constexpr(VEC):
                    frag[j, u] = Uint32(0)
            # warp w owns keys [w0, w0 + seg) (clipped to n): nsteps warp-wide 128-key steps
            seg = (n + NWARPS * STEP - 1) // (NWARPS * STEP) * STEP
            w0 = warp * seg
            nsteps = (cutlass.max(cutlass.min(w0 + seg, n) - w0, Int32(0)) + STEP - 1) // STEP
            # the row's last 16-byte vector [a, a + 4) reaches past n when n % 4 != 0: the score kernel never
            # writes those slab words (the keys are masked, i < n, but a load of unwritten memory is still a read
            # of it). The one thread that loads that vector in every pass (warp a // seg, lane a % STEP / VEC:
            # seg and w0 are multiples of STEP) zeroes them first; its own later loads see its stores (program
            # order), and no other thread reads them. Once per row, outside the passes.
            tail = n % VEC
            if cutlass.const_expr(zero_tail) and tail != 0:
                a = n - tail
                if a // seg == warp and (a % STEP) // VEC == lane:
                    mTail = cute.make_tensor(p_row, cute.make_layout(n + VEC))
                    for j in cutlass.range_constexpr(VEC - 1):
                        if tail + j < VEC:
                            mTail[n + j] = Uint32(0)
            hbase = warp * NBINS                            # this warp's histogram
            prefix = Uint32(0)                              # key bits above `shift` found so far
            k_rem = topk                                    # keys still to take among those matching prefix
            shift = Uint32(32)                              # prefix = key >> shift (32: nothing found yet)
            n_gt = Int32(0)                                 # this warp's keys above the prefix (warp-uniform)
            cand = nsteps                                   # this warp's keys matching the prefix (0: skip)
            active = Int32(1)                               # CTA-uniform: another pass is needed
            if cutlass.const_expr(SAMPLE):
                cmode = Int32(0)                            # CTA-uniform: 1 once the candidates are in smem
                coff = Int32(0)                             # this warp's first entry in sKey / sId
                ccnt = Int32(0)                             # this warp's entries
                c_cross = Int32(0)                          # keys of the row matching prefix (crossing bin)
                # ---- sampled threshold: the 16-bit prefix tau of the srank-th largest of THREADS evenly spaced
                # keys; then ONE read of the row stores every key with key >> 16 >= tau in its warp's REG
                # entries. With >= topk of them and no warp past REG, the row's topk largest keys (and every key
                # tied with the k-th) are among them: all radix passes and the emit then run on the entries
                # (cmode from pass 0).
                skip0 = Int32(0)                            # CTA-uniform: pass 0's result is known (entries)
                m = (topk * THREADS + n - 1) // n           # sample keys expected among the row's top-k
                srank = 2 * m + 16                          # entries expected: srank * n / THREADS (~2 topk + margin)
                if n >= 4 * topk and Int64(srank) * Int64(n) * Int64(5) <= Int64(3 * CAP * THREADS):   # CTA-uniform
                    mS = cute.make_tensor(p_row, cute.make_layout(n))
                    skey = f32_key(mS[(tidx * n) // THREADS])
                    sp = Uint32(0)
                    for j in cutlass.range_constexpr(NBINS // 32):
                        sWh[hbase + lane * (NBINS // 32) + j] = 0
                    cute.arch.sync_warp()
                    cute.arch.atomic_add((sWh.iterator + (hbase + Int32(skey >> Uint32(24)))).llvm_ptr, Int32(1))
                    bin_scan(srank, sp, sWh, sWsum, sSel, tidx, warp, lane)
                    sp = Uint32(sSel[0])                        # the sample's crossing top byte
                    srem = sSel[1]
                    for j in cutlass.range_constexpr(NBINS // 32):
                        sWh[hbase + lane * (NBINS // 32) + j] = 0
                    cute.arch.sync_warp()
                    if (skey >> Uint32(24)) == sp:
                        cute.arch.atomic_add(
                            (sWh.iterator + (hbase + Int32((skey >> Uint32(16)) & Uint32(0xFF)))).llvm_ptr, Int32(1))
                    bin_scan(srem, sp, sWh, sWsum, sSel, tidx, warp, lane)
                    tau = Uint32(sSel[0])                       # 16-bit key prefix
                    coff = warp * REG
                    lt_mask = cute.arch.lanemask_lt()
                    ktop = Int32(0)                             # largest top byte (key >> 24) this thread stored
                    for s0 in cutlass.range(0, nsteps, UNROLL, unroll=1):
                        load_group(frag, mV, s0, nsteps, w0, lane, n)
                        for u in cutlass.range_constexpr(UNROLL):
                            i0 = w0 + (s0 + u) * STEP + lane * VEC
                            ok = s0 + u < nsteps
                            m_before, m_tot = ballot_ranks(frag, u, ok, i0, n, 16, tau, lt_mask)
                            e = coff + ccnt + m_before                  # lane-major = id order
                            for j in cutlass.range_constexpr(VEC):
                                key = f32_key(frag[j, u])
                                if ok and i0 + j < n and (key >> Uint32(16)) >= tau:
                                    if e < coff + REG:
                                        sKey[e] = key
                                        sId[e] = i0 + j
                                        ktop = cutlass.max(ktop, Int32(key >> Uint32(24)))
                                    e += 1
                            ccnt += m_tot
                    ktop = cute.arch.warp_reduction_max(ktop)
                    if lane == 0:
                        sCnt[warp] = ccnt
                        sCnt[NWARPS + warp] = ktop
                    cute.arch.sync_threads()
                    cw = Int32(0)
                    tw = Int32(0)
                    if lane < NWARPS:
                        cw = sCnt[lane]
                        tw = sCnt[NWARPS + lane]
                    total = cute.arch.warp_reduction_sum(cw)
                    most = cute.arch.warp_reduction_max(cw)
                    rtop = cute.arch.warp_reduction_max(tw)
                    if total >= topk and most <= REG:           # CTA-uniform: the entries hold the top-k
                        cmode = Int32(1)
                        cand = ccnt
                        if rtop == Int32(tau >> Uint32(8)):
                            # every entry has key >> 16 >= tau and key >> 24 <= rtop = tau >> 8: they all share
                            # the top byte, so pass 0's result is known (crossing bin rtop, nothing above it)
                            skip0 = Int32(1)
                            prefix = Uint32(rtop)
                            shift = Uint32(24)
                    else:
                        ccnt = Int32(0)
            for p in cutlass.range_constexpr(4):
                if cutlass.const_expr(SAMPLE):
                    run_pass = active != 0 and (p != 0 or skip0 == 0)
                else:
                    run_pass = active != 0
                if run_pass:
                    for j in cutlass.range_constexpr(NBINS // 32):
                        sWh[hbase + lane * (NBINS // 32) + j] = 0
                    cute.arch.sync_warp()
                    if cutlass.const_expr(not SAMPLE):
                        global_pass(p, frag, mV, cand, nsteps, w0, lane, n, sWh, hbase, prefix)
                    elif cutlass.const_expr(p == 0):
                        if cmode != 0:
                            # ---- pass 0 over this warp's sampled entries (every key with key >> 16 >= tau)
                            if cand != 0:
                                for e in cutlass.range(coff + lane, coff + ccnt, 32, unroll=2):
                                    cute.arch.atomic_add(
                                        (sWh.iterator + (hbase + Int32(sKey[e] >> Uint32(24)))).llvm_ptr, Int32(1))
                        else:
                            global_pass(p, frag, mV, cand, nsteps, w0, lane, n, sWh, hbase, prefix)
                    else:
                        if cmode != 0:
                            # ---- radix pass over this warp's smem entries (its keys >= the prefix of the compaction)
                            if cand != 0:
                                for e in cutlass.range(coff + lane, coff + ccnt, 32, unroll=2):
                                    key = sKey[e]
                                    if (key >> Uint32(32 - 8 * p)) == prefix:
                                        cute.arch.atomic_add(
                                            (sWh.iterator + (hbase + Int32((key >> Uint32(24 - 8 * p)) & Uint32(0xFF)))).llvm_ptr,
                                            Int32(1))
                        elif (topk - k_rem) + c_cross <= CAP:
                            # ---- compaction pass: the row's keys >= prefix (all that can still be selected:
                            # topk - k_rem above it, c_cross in it) fit CAP. Read the segment as a global pass
                            # does and also store them as (key, id) in id order; warp w's entries start after
                            # those of the warps before it. Later passes and the emit read these entries.
                            ccnt = n_gt + cand
                            if lane == 0:
                                sCnt[warp] = ccnt
                            cute.arch.sync_threads()
                            cw = Int32(0)
                            if lane < warp:
                                cw = sCnt[lane]
                            coff = cute.arch.warp_reduction_sum(cw)
                            lt_mask = cute.arch.lanemask_lt()
                            if ccnt != 0:
                                pos = coff                              # next free entry (warp-uniform)
                                for s0 in cutlass.range(0, nsteps, UNROLL, unroll=1):
                                    load_group(frag, mV, s0, nsteps, w0, lane, n)
                                    for u in cutlass.range_constexpr(UNROLL):
                                        i0 = w0 + (s0 + u) * STEP + lane * VEC
                                        ok = s0 + u < nsteps
                                        m_before, m_tot = ballot_ranks(frag, u, ok, i0, n, 32 - 8 * p, prefix, lt_mask)
                                        e = pos + m_before                  # lane-major = id order
                                        for j in cutlass.range_constexpr(VEC):
                                            key = f32_key(frag[j, u])
                                            hi8 = key >> Uint32(32 - 8 * p)
                                            if ok and i0 + j < n and hi8 >= prefix:
                                                sKey[e] = key
                                                sId[e] = i0 + j
                                                e += 1
                                                if hi8 == prefix:
                                                    cute.arch.atomic_add(
                                                        (sWh.iterator + (hbase + Int32((key >> Uint32(24 - 8 * p)) & Uint32(0xFF)))).llvm_ptr,
                                                        Int32(1))
                                        pos += m_tot
                            cmode = Int32(1)
                        else:
                            global_pass(p, frag, mV, cand, nsteps, w0, lane, n, sWh, hbase, prefix)
                    bin_scan(k_rem, prefix, sWh, sWsum, sSel, tidx, warp, lane)
                    prefix = Uint32(sSel[0])
                    k_rem = sSel[1]
                    shift = Uint32(24 - 8 * p)
                    if cutlass.const_expr(SAMPLE):
                        c_cross = sSel[2]
                    if k_rem == sSel[2]:                       # the crossing bin is taken whole: done
                        active = Int32(0)
                    # this warp: keys above the crossing digit join n_gt; the crossing bin's are the candidates
                    digit = Int32(prefix & Uint32(0xFF))
                    above = Int32(0)
                    for j in cutlass.range_constexpr(NBINS // 32):
                        if lane * (NBINS // 32) + j > digit:
                            above += sWh[hbase + lane * (NBINS // 32) + j]
                    n_gt += cute.arch.warp_reduction_sum(above)
                    cand = sWh[hbase + digit]
                    cute.arch.sync_warp()
            # ---- ordered emit: selected = key > thr, or key == thr among the first k_eq of the row (by id),
            # thr = the prefix at `shift`. Warp w's slots start after all selected keys of warps < w.
            k_eq = k_rem
            if lane == 0:
                sCnt[warp] = n_gt
                sCnt[NWARPS + warp] = cand
            cute.arch.sync_threads()
            gt_run = Int32(0)                               # selected-greater keys before this point (row)
            eq_run = Int32(0)                               # keys == thr before this point (row)
            if lane < warp:
                gt_run = sCnt[lane]
                eq_run = sCnt[NWARPS + lane]
            gt_run = cute.arch.warp_reduction_sum(gt_run)
            eq_run = cute.arch.warp_reduction_sum(eq_run)
            gt_end = gt_run + n_gt
            eq_end = cutlass.min(eq_run + cand, k_eq)
            below = cute.arch.lanemask_lt()
            if cutlass.const_expr(not SAMPLE):
                global_emit(frag, mV, mOut, nsteps, w0, lane, n, shift, prefix, k_eq, below, gt_run, gt_end,
                            eq_run, eq_end, mVal, has_vals)
            elif cmode != 0:
                # from this warp's smem entries, 32 per step in id order (they hold every selected key)
                e0 = coff
                cend = coff + ccnt
                while e0 < cend and (gt_run < gt_end or eq_run < eq_end):   # warp-uniform
                    e = e0 + lane
                    kk = Uint32(0)
                    idx = Int32(0)
                    if e < cend:
                        kk = sKey[e] >> shift
                        idx = sId[e]
                    g = e < cend and kk > prefix
                    q = e < cend and kk == prefix
                    bg = cute.arch.vote_ballot_sync(g)
                    be = cute.arch.vote_ballot_sync(q)
                    g_pos = gt_run + cute.arch.popc(bg & below)
                    e_pos = eq_run + cute.arch.popc(be & below)
                    if g:
                        emit_slot(mOut, g_pos + cutlass.min(e_pos, k_eq), idx, mVal, has_vals, sKey, e, True)
                    if q:
                        if e_pos < k_eq:
                            emit_slot(mOut, g_pos + e_pos, idx, mVal, has_vals, sKey, e, True)
                    gt_run += cute.arch.popc(bg)
                    eq_run += cute.arch.popc(be)
                    e0 += 32
            else:
                global_emit(frag, mV, mOut, nsteps, w0, lane, n, shift, prefix, k_eq, below, gt_run, gt_end,
                            eq_run, eq_end, mVal, has_vals)

    if rows:
        @cute.kernel
        def rows_kernel(p_x: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_len: cute.Pointer,
                        n_rows: Int32, n_cols: Int32, rows_per_len: Int32, topk: Int32, ld_x: Int64,
                        has_values: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            sh = smem_views()
            n = cutlass.min(cutlass.max((p_len + row // rows_per_len).load(), Int32(0)), n_cols)
            mOut = cute.make_tensor(p_out + Int64(row) * Int64(topk), cute.make_layout(topk))
            mVal = cute.make_tensor(cute.recast_ptr(p_val, dtype=Uint32) + Int64(row) * Int64(topk),
                                    cute.make_layout(topk))
            select(sh, p_x + Int64(row) * ld_x, n, mOut, topk, tidx, warp, lane, False, mVal, has_values)

        @cute.jit
        def rows_host(p_x: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_len: cute.Pointer,
                      n_rows: Int32, n_cols: Int32, rows_per_len: Int32, topk: Int32, ld_x: Int64,
                      has_values: Int32):
            rows_kernel(p_x, p_out, p_val, p_len, n_rows, n_cols, rows_per_len, topk, ld_x, has_values).launch(
                grid=(n_rows, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=MIN_CTAS,
                preferred_smem_carveout=-1)

        return rows_kernel, rows_host, LAUNCH

    if forward:
        @cute.jit
        def fwd_row(p_slab, p_out, p_val, p_cu_q, p_cu_k, p_off, n_docs, T, S, n_tblk, blk0, qc, topk, ratio, has_off,
                    ld_slab, p_soft=None, p_lse=None, want_soft=None, want_lse=None, global_ids=None):
            """Slab row block_idx.x: its selection (ids, values) and, with p_soft given at trace time (the softmax
            form), its finish (topk_softmax_sm90.finish_row: LSE, softmax, global ids) once the whole CTA's
            writes of the row are visible (a block barrier); the warp histograms, free after `select`, hold the
            finish's statistics."""
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            blk = blk0 + row // qc
            b = blk // n_tblk
            t = (blk - b * n_tblk) * qc + (row - (row // qc) * qc)
            if t < T:                                      # CTA-uniform: padding rows of a last block exit
                sh = smem_views()
                lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t, T, S, Int32(1), ratio, p_off, has_off, b)
                at = (Int64(b) * Int64(T) + Int64(t)) * Int64(topk)
                mOut = cute.make_tensor(p_out + at, cute.make_layout(topk))
                mVal = cute.make_tensor(cute.recast_ptr(p_val, dtype=Uint32) + at, cute.make_layout(topk))
                select(sh, p_slab + Int64(row) * ld_slab, hi - lo, mOut, topk, tidx, warp, lane, True, mVal,
                       Int32(1))
                if cutlass.const_expr(p_soft is not None):
                    cute.arch.sync_threads()              # every slot of the row written, select's smem free
                    # the row's bounds again rather than kept live across select (the 128-thread form's budget)
                    row2, _, _ = cute.arch.block_idx()
                    blk2 = blk0 + row2 // qc
                    b2 = blk2 // n_tblk
                    t2 = (blk2 - b2 * n_tblk) * qc + (row2 - (row2 // qc) * qc)
                    lo2, hi2 = row_bounds(p_cu_q, p_cu_k, n_docs, t2, T, S, Int32(1), ratio, p_off, has_off, b2)
                    r2 = Int64(b2) * Int64(T) + Int64(t2)
                    p_stats = cute.recast_ptr(sh[0].iterator, dtype=Float32)
                    sM = cute.make_tensor(p_stats, cute.make_layout(NWARPS))
                    sS = cute.make_tensor(p_stats + NWARPS, cute.make_layout(NWARPS))
                    sL = cute.make_tensor(p_stats + 2 * NWARPS, cute.make_layout(2))
                    n = cutlass.min(cutlass.max(hi2 - lo2, Int32(0)), topk)
                    finish_row(p_val + r2 * Int64(topk), p_out + r2 * Int64(topk), p_soft + r2 * Int64(topk),
                               p_lse + r2, n, topk, lo2 + b2 * S, want_soft, want_lse, global_ids, tidx, warp, lane,
                               sM, sS, sL, THREADS)

        if softmax:
            @cute.kernel
            def fwd_kernel(p_slab: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_cu_q: cute.Pointer,
                           p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32,
                           n_tblk: Int32, blk0: Int32, qc: Int32, nrows: Int32, topk: Int32, ratio: Int32,
                           has_off: Int32, ld_slab: Int64, p_soft: cute.Pointer, p_lse: cute.Pointer,
                           want_soft: Int32, want_lse: Int32, global_ids: Int32):
                fwd_row(p_slab, p_out, p_val, p_cu_q, p_cu_k, p_off, n_docs, T, S, n_tblk, blk0, qc, topk, ratio,
                        has_off, ld_slab, p_soft, p_lse, want_soft, want_lse, global_ids)

            @cute.jit
            def fwd_host(p_slab: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_cu_q: cute.Pointer,
                         p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32,
                         n_tblk: Int32, blk0: Int32, qc: Int32, nrows: Int32, topk: Int32, ratio: Int32,
                         has_off: Int32, ld_slab: Int64, p_soft: cute.Pointer, p_lse: cute.Pointer,
                         want_soft: Int32, want_lse: Int32, global_ids: Int32):
                fwd_kernel(p_slab, p_out, p_val, p_cu_q, p_cu_k, p_off, n_docs, T, S, n_tblk, blk0, qc, nrows, topk,
                           ratio, has_off, ld_slab, p_soft, p_lse, want_soft, want_lse, global_ids).launch(
                    grid=(nrows, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=MIN_CTAS,
                    preferred_smem_carveout=-1)

            return fwd_kernel, fwd_host, LAUNCH

        @cute.kernel
        def fwd_kernel(p_slab: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_cu_q: cute.Pointer,
                       p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32,
                       blk0: Int32, qc: Int32, nrows: Int32, topk: Int32, ratio: Int32, has_off: Int32,
                       ld_slab: Int64):
            fwd_row(p_slab, p_out, p_val, p_cu_q, p_cu_k, p_off, n_docs, T, S, n_tblk, blk0, qc, topk, ratio,
                    has_off, ld_slab)

        @cute.jit
        def fwd_host(p_slab: cute.Pointer, p_out: cute.Pointer, p_val: cute.Pointer, p_cu_q: cute.Pointer,
                     p_cu_k: cute.Pointer, p_off: cute.Pointer, n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32,
                     blk0: Int32, qc: Int32, nrows: Int32, topk: Int32, ratio: Int32, has_off: Int32,
                     ld_slab: Int64):
            fwd_kernel(p_slab, p_out, p_val, p_cu_q, p_cu_k, p_off, n_docs, T, S, n_tblk, blk0, qc, nrows, topk,
                       ratio, has_off, ld_slab).launch(grid=(nrows, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES,
                                                       min_blocks_per_mp=MIN_CTAS, preferred_smem_carveout=-1)

        return fwd_kernel, fwd_host, LAUNCH

    @cute.kernel
    def kernel(p_slab: cute.Pointer, p_out: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
               n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, qc: Int32, nrows: Int32,
               topk: Int32, causal: Int32, ratio: Int32, ld_slab: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        blk = blk0 + row // qc
        b = blk // n_tblk
        t = (blk - b * n_tblk) * qc + (row - (row // qc) * qc)
        if t < T:                                          # CTA-uniform: padding rows of a last block exit
            sh = smem_views()
            lo, hi = row_bounds(p_cu_q, p_cu_k, n_docs, t, T, S, causal, ratio)
            n = hi - lo
            mOut = cute.make_tensor(p_out + (Int64(b) * Int64(T) + Int64(t)) * Int64(topk), cute.make_layout(topk))
            select(sh, p_slab + Int64(row) * ld_slab, n, mOut, topk, tidx, warp, lane, True)

    @cute.jit
    def host(p_slab: cute.Pointer, p_out: cute.Pointer, p_cu_q: cute.Pointer, p_cu_k: cute.Pointer,
             n_docs: Int32, T: Int32, S: Int32, n_tblk: Int32, blk0: Int32, qc: Int32, nrows: Int32,
             topk: Int32, causal: Int32, ratio: Int32, ld_slab: Int64):
        kernel(p_slab, p_out, p_cu_q, p_cu_k, n_docs, T, S, n_tblk, blk0, qc, nrows, topk, causal, ratio,
               ld_slab).launch(grid=(nrows, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=MIN_CTAS,
                               preferred_smem_carveout=-1)   # -1: no carveout preference (and no device query)

    return kernel, host, LAUNCH
