"""Limits of the radix top-k kernels (lightning_indexer/topk_sm90.py), shared by the specs of the lightning indexer's
slab top-k (lightning_indexer/spec.py) and of the standalone indexer_topk (indexer_topk/spec.py). A leaf module: it
imports nothing, so both spec modules can use it while `dsagen.spec` is still loading the families."""

#: Threads of the top-k kernel (each one in some entry of a plan). Registers are budgeted for 2 CTAs per SM at 512
#: threads (64 registers), for 1 CTA per SM at 1024 (64 registers; the plans use it when the rows fit one wave, and
#: for the longest rows) and for 8 CTAs per SM at 128 (64 registers: 8 rows in flight per SM; each thread then scans 2
#: bins of the block histogram).
INDEXER_TOPK_THREADS = (128, 512, 1024)
#: sample=True: (key, id) entries of shared memory per row, by threads. Sized so that the CTAs per SM of the register
#: budget still fit (2 x 115,712 B of 233,472 B at 512 threads, 1 at 1024): 8 B per entry next to the 1 KiB-per-warp
#: histograms.
TOPK_COMPACT_CAP = {512: 12288, 1024: 24576}
