#!/usr/bin/env bash
# Session 5, GPU call 5 (issue 5): split_halves with the item loop. Whole sparse-attention suite (incl. the grid test:
# persistent / 7 / 1 CTAs, bitwise against one CTA per item), memcheck of the grid + adversarial tests, then
# GRID=persistent next to GRID=items on the bench shapes, and the topk sweep of the persistent grid.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5e
run smoke 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "grid_adversarial and 128-576"
grep -q " passed" $O/smoke.log && ! grep -q "failed" $O/smoke.log || { grep -E "^FAILED|Error|assert" $O/smoke.log | head -20; exit 1; }
run pytest 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || { grep -E "^FAILED|Error" $O/pytest.log | head; exit 1; }
TAILN=10 run bench 200 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --grid persistent \
  --cases 0,1,2,3,6,7,8,9 --json $O/bench.json
TAILN=6 run sweep 120 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --grid persistent \
  --cases 0 --topk 1024,2048,4096,8192 --json $O/sweep.json
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "grid_adversarial or (split_halves and (adversarial or odd_tile or empty))"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
