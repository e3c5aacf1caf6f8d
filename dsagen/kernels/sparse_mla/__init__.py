"""The sparse MLA attention forward: fwd_sm90 (split_halves schedule) and its device helpers (attn_sm90)."""
