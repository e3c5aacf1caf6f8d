#!/usr/bin/env bash
# Session 7, GPU call D: the sparse-attention suite after epi_overlap's removal and with the kv_pin_mb option's
# tests; memcheck of the option / adversarial tests; energy and time of kv_pin_mb 16 / 24 / 32 against the default
# (call C: a KV pool that stays in L2 saves 0.14 J of 2.82 J per call; can pinning part of a 37.7 MB pool get some
# of it?). Prediction: 0-2.5% if the KV DRAM misses halve. Carry .dsagen-cache-s7 and .peer/flashmla.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7d
suite pytest 200 tests/gpu/test_sparse_attention.py
memcheck memcheck 120 tests/gpu/test_sparse_attention.py -k "kv_pin or halves_options"
TAILN=9 run energy 110 python3 bench/energy.py --cases 0 --variants default,kv_pin_mb=16,kv_pin_mb=24,kv_pin_mb=32 \
  --json $O/energy0.json
TAILN=7 run energy3 80 python3 bench/energy.py --cases 3 --variants default,kv_pin_mb=24,kv_pin_mb=32 --json $O/energy3.json
TAILN=5 run bench 80 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves \
  --flashmla .peer/flashmla --options kv_pin_mb=24 --cases 0,1 --json $O/bench.json
