#!/usr/bin/env bash
# Session 4: the per-slab top-k plan (TOPK_BY_ROW_LENGTH). The whole indexer suite (the plan is now the default
# path of every fused test) + memcheck on the plan test and the edge cases; then default (plan) against session
# 3's top-k in one process, two orders, with in-op kernel times; then the issue sweep.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4c
TAILN=4 run tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
run memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "plan_per_slab or packed_documents or no_candidates or topk_edges"
grep "ERROR SUMMARY" "$O/memcheck.log" | sort | uniq -c
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --trace"
TAILN=14 run plan_a 100 $B --variant default topk_s3 default topk_s3 --json "$O/plan_a.json"
TAILN=30 run sweep 150 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --ref-max-T 0 \
  --variant default topk_s3 --json "$O/sweep.json"
