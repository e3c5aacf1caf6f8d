"""The standalone indexer top-k (cuDNN frontend DSA §5): the lightning indexer's radix top-k over matrix rows."""
