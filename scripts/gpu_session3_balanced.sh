#!/usr/bin/env bash
# (Runs at commit 2a76e5e: the balanced schedule and slab_plan were pruned right after it.)
# Session 3, GPU call 2: the balanced score schedule and the causal slab plan (slab_plan): indexer suite,
# memcheck of the new paths, then same-process timings (two passes in opposite orders against the noise).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" c2
run test_indexer 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=12 run bench_a 200 $B --variant default balanced uniform balanced_uniform --json $O/bench_a.json
TAILN=12 run bench_b 200 $B --variant balanced_uniform uniform balanced default --json $O/bench_b.json
TAILN=12 run bench_c 200 python3 bench/indexer.py --T 8192 32768 --topk 2048 --ratio 1 4 --reps 5 --ref-max-T 0 --variant default balanced --json $O/bench_c.json
run memcheck 300 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "(test_score_schedules and balanced) or causal_slab_plan or packed_documents or heads_and_dims"
grep "ERROR SUMMARY" $O/memcheck.log
