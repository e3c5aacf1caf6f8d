"""Packed sequences on the device: which sequence a token of the packed token axis belongs to.

A kernel over packed tokens gets `cu` (int32 [n_docs + 1] offsets: 0, then each sequence's end) or, with n_docs = 0,
sequences of `seq_len` tokens each (one sequence when seq_len is the token count).
"""

import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def token_range(p_cu: cute.Pointer, n_docs: Int32, seq_len: Int32, tok: Int32):
    """(first row, length, index) of token tok's sequence: sequence tok // seq_len when n_docs == 0, else the packed
    sequence i with cu[i] <= tok < cu[i + 1] (binary search; empty sequences are skipped by it)."""
    first = Int32(0)
    length = Int32(0)
    seq = Int32(0)
    if n_docs == 0:
        seq = tok // seq_len
        first = seq * seq_len
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
        seq = lo
        first = (p_cu + lo).load()
        length = (p_cu + lo + 1).load() - first
    return first, length, seq
