#!/usr/bin/env bash
# Session 5, GPU call 4 (issue 5): the producers' constant-offset smem addressing (every schedule). The whole
# sparse-attention GPU suite, memcheck of the adversarial / odd-tile tests, then split_halves next to the per-shape
# default on every bench shape (incl. H128/D512, H64/D576) with the no_gather chain.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5d
run pytest 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || exit 1
TAILN=32 run bench 240 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --cases 0,1,2,3,6,7,8,9 \
  --ablate no_gather --json $O/bench.json
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "adversarial or odd_tile or empty"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
