"""The sparse indexer backward (cuDNN frontend DSA §9): bwd_sm90 and its host code."""
