#!/usr/bin/env bash
# GPU call of IndexerTopkSpec(compact=True) (notes/kernels/indexer-topk.md, "compact"): in ONE pytest process with
# DSAGEN_TEST_TOPK_OPTIONS='{"compact": true}' the exact top-k tests of the compact kernels (512 and 1024 threads)
# and every fused-path test that runs the host's top-k options (those setting SPEC_OPTIONS themselves and the
# exact tests of the other specs are left out); the bench at the target shape (default vs compact, same process);
# memcheck of the compact kernels; the bench at T=131072 (the host's 1024-thread kernel). Carry the tree with
# .dsagen-cache-topk2 (built here). Every step has its own timeout; logs under $OUT.
set -u
O=${OUT:-topk2-out}; mkdir -p $O
# DSAGEN_CACHE_PATH may be preset (a merged tree: .dsagen-cache-topk2:<the score cache>)
export DSAGEN_CACHE_PATH=${DSAGEN_CACHE_PATH:-.dsagen-cache-topk2} DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
P="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py"
echo "== tests"; DSAGEN_TEST_TOPK_OPTIONS='{"compact": true}' timeout 75 $P \
  -k "(topk_kernel_exact and compact1) or not (topk_kernel_exact or score_schedules or speed_variants or ablation)" \
  > $O/tests.txt 2>&1; grep -E "^FAILED|passed|failed" $O/tests.txt | tail -6
echo "== bench 32K"; timeout 40 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 5 --ref-max-T 0 \
  --profile --variant default compact --json $O/b32k.json > $O/b32k.txt 2>&1; grep -E "^(default|compact) " $O/b32k.txt
echo "== memcheck"; timeout 30 compute-sanitizer --tool memcheck --report-api-errors no \
  $P -k "topk_kernel_exact and compact1 and 2048 and (equal or narrow or randn)" > $O/memcheck.txt 2>&1
grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.txt | tail -2
echo "== bench 131K"; timeout 40 python3 bench/indexer.py --T 131072 --topk 2048 --ratio 1 --reps 2 --ref-max-T 0 \
  --profile --variant default compact --json $O/b131k.json > $O/b131k.txt 2>&1; grep -E "^(default|compact) " $O/b131k.txt
