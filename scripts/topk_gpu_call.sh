#!/usr/bin/env bash
# GPU call of the top-k kernel (notes/kernels/indexer-topk.md): exact top-k tests (256 / 512 / 1024 threads),
# the whole indexer suite, memcheck of the 1024-thread kernel, and the bench where the host picks the
# 1024-thread top-k (T=131072) against the 512-thread one in one process. Carry the tree with
# .dsagen-cache-topk (built here first). Every step has its own timeout.
set -u
O=${OUT:-topk-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-topk DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
P="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py"
echo "== exact"; timeout 30 $P -k topk_kernel_exact > $O/exact.txt 2>&1; tail -1 $O/exact.txt
echo "== suite"; timeout 60 $P -k "not topk_kernel_exact" > $O/suite.txt 2>&1; tail -2 $O/suite.txt
echo "== memcheck"; timeout 25 compute-sanitizer --tool memcheck --report-api-errors no \
  $P -k "topk_kernel_exact and t1024 and (randn or few_values)" > $O/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.txt | tail -2
echo "== bench"; timeout 40 python3 bench/indexer.py --reps 3 --ref-max-T 0 --profile --T 131072 --topk 2048 --ratio 1 \
  --variant default t512 --json $O/b131k.json > $O/b131k.txt 2>&1; tail -3 $O/b131k.txt
