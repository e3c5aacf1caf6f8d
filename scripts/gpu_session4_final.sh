#!/usr/bin/env bash
# Session 4, last GPU call: the final tree. Every GPU suite, memcheck on the edge-case tests (the session-3 set plus
# the top-k plan test), then the issue's indexer benchmark against the plain-PyTorch reference (T <= 32768).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" fin
TAILN=3 run tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/test_reference_indexer_cuda.py
run memcheck 230 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu \
  -k "(foundation or heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal or adversarial or plan_per_slab) and not without_cutlass"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
TAILN=14 run bench_indexer 150 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 5 --json $O/indexer.json
