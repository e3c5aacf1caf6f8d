"""The sparse indexer score recompute (cuDNN frontend DSA §6): recompute_sm90 and its host code."""
