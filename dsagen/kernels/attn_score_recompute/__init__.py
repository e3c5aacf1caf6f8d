"""The sparse attention score recompute (cuDNN frontend DSA §7): recompute_sm90 and its host code."""
