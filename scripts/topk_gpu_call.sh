#!/usr/bin/env bash
# GPU call of the top-k "segments" kernel (notes/kernels/indexer-topk.md): exact top-k tests, the whole indexer
# suite with the new top-k, ablation smoke, old-vs-new bench in one process, memcheck, T sweep.
# Carry the tree with .dsagen-cache-topk (built here first). Every step has its own timeout.
set -u
O=${OUT:-topk-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-topk DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
SEG='{"algo": "segments", "threads": 512}'
P="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "== exact"; timeout 60 $P -k topk_kernel_exact > $O/exact.txt 2>&1; tail -3 $O/exact.txt
echo "== suite with seg top-k"; DSAGEN_TEST_TOPK_OPTIONS="$SEG" timeout 80 $P -k "not ablation_launch_smoke" > $O/suite_seg.txt 2>&1; tail -3 $O/suite_seg.txt
echo "== seg ablation smoke"; timeout 20 $P -k "ablation_launch_smoke and seg-" > $O/smoke.txt 2>&1; tail -1 $O/smoke.txt
echo "== bench 32K"; timeout 60 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 3 --ref-max-T 0 --profile \
  --variant default seg seg256 ablate-seg-read1 ablate-seg-hist1 ablate-seg-no_emit --json $O/b32k.json > $O/b32k.txt 2>&1; tail -8 $O/b32k.txt
echo "== memcheck seg"; DSAGEN_TEST_TOPK_OPTIONS="$SEG" timeout 45 compute-sanitizer --tool memcheck --report-api-errors no \
  $P -k "packed_documents or (topk_kernel_exact and algosegments and randn)" > $O/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.txt | tail -3
echo "== sweep"; timeout 75 python3 bench/indexer.py --T 8192 131072 --topk 512 2048 --ratio 1 --reps 3 --ref-max-T 0 --profile \
  --variant default seg --json $O/sweep.json > $O/sweep.txt 2>&1; tail -10 $O/sweep.txt
