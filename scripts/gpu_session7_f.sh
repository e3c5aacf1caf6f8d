#!/usr/bin/env bash
# Session 7, final GPU call (issue 5): the final tree (split_halves without epi_overlap; every REQUIRED_SPEC renders
# byte-identical to the session-6 templates) built from scratch into one cache.
# 1. the sparse-attention suite; memcheck of every adversarial / odd-tile / empty-row / grid / option test;
#    the foundation and indexer suites;
# 2. the bench table with the plain-PyTorch reference and FlashMLA on the same inputs (rotated interleaved rounds);
# 3. energy per call (NVML) of the default, its no_gather ablation, the session-5 options and FlashMLA at the
#    headline shape, H64 / D512 and KV 131072, and of the default / no_gather on a 4096-row pool.
# Carry .dsagen-cache-final and .peer/flashmla. `gpu_session7_f.sh CACHE tests` runs part 1, `... bench` 2 and 3.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7f-$2
if [ "$2" = tests ]; then
suite pytest 150 tests/gpu/test_sparse_attention.py
memcheck memcheck 150 tests/gpu/test_sparse_attention.py -k "adversarial or odd_tile or empty or grid"
suite foundation 40 tests/gpu/test_foundation.py
suite indexer 90 tests/gpu/test_lightning_indexer.py
else
TAILN=13 run bench 200 python3 bench/sparse_attention.py --reps 10 --flashmla .peer/flashmla --json $O/bench.json
TAILN=7 run energy0 70 python3 bench/energy.py --cases 0 --variants default,no_gather,session5 --flashmla .peer/flashmla \
  --json $O/energy0.json
TAILN=5 run energy1 40 python3 bench/energy.py --cases 1 --variants default --flashmla .peer/flashmla --json $O/energy1.json
TAILN=5 run energy2 40 python3 bench/energy.py --cases 2 --variants default,no_gather --json $O/energy2.json
TAILN=5 run energy3 40 python3 bench/energy.py --cases 3 --variants default --flashmla .peer/flashmla --json $O/energy3.json
fi
