#!/usr/bin/env bash
# (Ran at commit b25a73c, where mma_head_sum was the bfloat16 default: "default" below meant mma_head_sum=True.)
# Session 3, GPU call 5: mma_head_sum with the head-sum wgmma deferred into the next turn (ahead of the next
# tile's scores): indexer suite, memcheck, same-process timings against the CUDA-core head sum (nomma).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" c5
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=5 run bench_a 120 $B --variant default nomma --json $O/bench_a.json
TAILN=6 run test_indexer 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
TAILN=5 run bench_b 120 $B --variant nomma default --json $O/bench_b.json
run memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal"
grep "ERROR SUMMARY" $O/memcheck.log
TAILN=16 run bench_sweep 300 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --json $O/indexer.json
