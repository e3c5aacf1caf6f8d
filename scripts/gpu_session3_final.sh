#!/usr/bin/env bash
# Session 3, last GPU call: the final tree (128 MiB slab, per-shape attention schedule, mma_head_sum non-default):
# every GPU suite, memcheck on the edge-case tests, the issue benchmarks (indexer sweep, sparse attention with
# serial next to the default), and the slab-cap decision repeated with more reps.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" f
run tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/test_reference_indexer_cuda.py
run memcheck 240 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu \
  -k "(foundation or heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal or adversarial) and not without_cutlass"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
TAILN=15 run bench_indexer 300 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --json $O/indexer.json
TAILN=8 run bench_slab 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --profile --variant default slab32 slab64 --json $O/slab.json
TAILN=12 run bench_attn 300 python3 bench/sparse_attention.py --reps 10 --schedule serial --json $O/sparse_attention.json
