#!/usr/bin/env bash
# Session 5, GPU call 6 (issue 5): split_halves with B's early V1R release. Sparse-attention suite, then the default
# (split_halves, one CTA per item) against serial_lean in one process (the ratio to compare with call 4's 1.07x),
# and GRID=persistent against GRID=items in the opposite case order.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5f
run pytest 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || { grep -E "^FAILED|Error" $O/pytest.log | head; exit 1; }
TAILN=8 run bench_lean 150 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule serial_lean --cases 0,1,3 \
  --ablate no_gather --json $O/bench_lean.json
TAILN=10 run bench_grid 200 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --grid persistent \
  --cases 9,8,7,6,3,2,1,0 --json $O/bench_grid.json
