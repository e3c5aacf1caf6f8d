#!/usr/bin/env bash
# Session 4: the plan with the sampled top-k (TOPK_BY_ROW_LENGTH: t128 / s512 / s1024). Whole indexer suite,
# memcheck on the plan test, then the op against the plan without sampling (plan_s4a) and session 3's top-k
# (topk_s3) in one process, two orders, with in-op kernel times; then the issue sweep.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4e
TAILN=4 run tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
run memcheck 100 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "plan_per_slab or topk_edges or long_causal"
grep "ERROR SUMMARY" "$O/memcheck.log" | sort | uniq -c
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --trace"
TAILN=2 run plan_a 90 $B --variant default plan_s4a topk_s3 --json "$O/plan_a.json"
TAILN=2 run plan_b 90 $B --variant topk_s3 plan_s4a default --json "$O/plan_b.json"
TAILN=2 run sweep 140 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --ref-max-T 0 \
  --variant default plan_s4a --json "$O/sweep.json"
grep -h "^ \+[0-9]\|variant" $O/plan_a.log $O/plan_b.log $O/sweep.log
