"""The sparse MLA attention backward: bwd_sm90 (dq, the dkv accumulator and delta in one kernel) and its host code."""
