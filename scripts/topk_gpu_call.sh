#!/usr/bin/env bash
# GPU call of the top-k kernel (notes/kernels/indexer-topk.md): exact top-k tests (256 / 512 / 1024 threads),
# the whole indexer suite, ablation smoke, memcheck, benches (auto-selected top-k vs fixed thread counts in
# one process). Carry the tree with .dsagen-cache-topk (built here first). Every step has its own timeout.
set -u
O=${OUT:-topk-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-topk DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
P="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py"
B="python3 bench/indexer.py --reps 3 --ref-max-T 0 --profile"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "== exact"; timeout 40 $P -k topk_kernel_exact > $O/exact.txt 2>&1; tail -1 $O/exact.txt
echo "== suite"; timeout 80 $P > $O/suite.txt 2>&1; tail -2 $O/suite.txt
echo "== memcheck"; timeout 40 compute-sanitizer --tool memcheck --report-api-errors no \
  $P -k "packed_documents or topk_edges or (topk_kernel_exact and t1024 and randn)" > $O/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.txt | tail -3
echo "== bench 32K"; timeout 45 $B --T 32768 --topk 2048 --ratio 1 4 --variant default t1024 --json $O/b32k.json > $O/b32k.txt 2>&1; tail -5 $O/b32k.txt
echo "== sweep"; timeout 90 $B --T 8192 65536 131072 --topk 512 2048 --ratio 1 --variant default t512 --json $O/sweep.json > $O/sweep.txt 2>&1; tail -13 $O/sweep.txt
