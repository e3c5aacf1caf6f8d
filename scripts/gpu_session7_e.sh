#!/usr/bin/env bash
# Session 7, GPU call E (issue 5): split_halves option lazy_rescale (the softmax's reference max moves only by more
# than LAZY_TH = 8, so the O / P / row-sum rescales, ~416 FMULs per pair and consumer thread pair, are skipped on
# almost every pair): the whole sparse suite with its option and moving-max tests; memcheck of them; energy per
# call against the default; timing against the default and FlashMLA (rotated interleaved rounds).
# Prediction (call C: the serial softmax costs 0.25 J of 3.43 J per call): -1-3% energy, +1-3% TFLOP/s.
# Carry .dsagen-cache-s7b and .peer/flashmla.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7e
suite pytest 200 tests/gpu/test_sparse_attention.py
memcheck memcheck 100 tests/gpu/test_sparse_attention.py -k "lazy_rescale"
TAILN=6 run energy 80 python3 bench/energy.py --cases 0 --variants default,lazy_rescale --json $O/energy0.json
TAILN=8 run bench 170 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves \
  --flashmla .peer/flashmla --options lazy_rescale --cases 0,1,2,3,7,9 --json $O/bench.json
