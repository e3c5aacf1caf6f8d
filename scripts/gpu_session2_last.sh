#!/usr/bin/env bash
# Session 2, last GPU call: the non-default candidates IndexerTopkSpec(compact=True) and
# IndexerScoreSpec(lean_epilogue / free_issue) -- their tests, memcheck of the compact top-k, and one bench with
# the default in the same process. Cache: .dsagen-cache-s3 (built here from tests/gpu/test_lightning_indexer.py).
set -u
O=${OUT:-last-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-s3 DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
P="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py"
echo "== compact tests"; DSAGEN_TEST_TOPK_OPTIONS='{"compact": true}' timeout 75 $P \
  -k "(topk_kernel_exact and compact1) or not (topk_kernel_exact or score_schedules or speed_variants or ablation)" \
  > $O/t_compact.txt 2>&1; grep -E "^FAILED|passed|failed" $O/t_compact.txt | tail -4
echo "== lean tests"; timeout 50 $P -k "test_score_schedules and lean" > $O/t_lean.txt 2>&1
grep -E "^FAILED|passed|failed" $O/t_lean.txt | tail -4
echo "== bench"; timeout 60 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 5 --ref-max-T 0 --profile \
  --variant default compact lean lean_free lean_compact lean_free_compact --json $O/bench.json > $O/bench.txt 2>&1
grep -A9 "per-kernel" $O/bench.txt
echo "== memcheck compact"; timeout 30 compute-sanitizer --tool memcheck --report-api-errors no \
  $P -k "topk_kernel_exact and compact1 and 2048 and (equal or narrow or randn)" > $O/memcheck.txt 2>&1
grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.txt | tail -2
