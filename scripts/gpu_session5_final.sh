#!/usr/bin/env bash
# Session 5, final GPU call (issue 5): the final kernels. Sparse-attention suite, memcheck of every adversarial /
# odd-tile / empty-row / grid test, the full bench table with the plain-PyTorch reference (default column: split_halves
# with DEFAULT_GRID; second column: split_halves with one CTA per item), and the topk sweep of the default.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5g
run pytest 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || { grep -E "^FAILED|Error" $O/pytest.log | head; exit 1; }
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "adversarial or odd_tile or empty or grid"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
TAILN=14 run bench 300 python3 bench/sparse_attention.py --reps 10 --schedule split_halves --grid items --json $O/bench.json
TAILN=7 run sweep 100 python3 bench/sparse_attention.py --no-torch --reps 10 --cases 0 --topk 1024,2048,4096,8192 --json $O/sweep.json
