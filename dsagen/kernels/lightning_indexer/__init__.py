"""The lightning indexer: the score kernel (score_sm90) and the radix top-k kernels (topk_sm90) of its plan."""
