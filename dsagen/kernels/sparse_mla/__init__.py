"""The sparse MLA attention forward: fwd_sm90 (split_halves schedule), built from the Hopper toolkit (common/sm90)."""
