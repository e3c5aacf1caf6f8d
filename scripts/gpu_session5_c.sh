#!/usr/bin/env bash
# Session 5, GPU call 3 (issue 5): split_halves with the producer-built validity bytes (no id loads in the
# consumers). Correctness (every split_halves test + ablations), memcheck of its adversarial / odd-tile tests, then
# same-process timings next to the per-shape default incl. decode and the no_gather chain.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5c
run pytest 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "split_halves or ablated"
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || exit 1
TAILN=26 run bench 200 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --cases 0,1,2,3,6,7 \
  --ablate no_gather --json $O/bench.json
TAILN=8 run sweep 120 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --cases 0 \
  --topk 1024,2048,4096,8192 --json $O/sweep.json
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "split_halves and (adversarial or odd_tile or empty)"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
