#!/usr/bin/env bash
# Session 6, GPU call 3 (issue 5): the new defaults (split_halves with vec_store; the persistent grid at H64 too).
# Carry .dsagen-cache-s6a, .dsagen-cache-s6i and .peer/flashmla (FlashMLA built from its source here; not committed).
# 1. the sparse-attention suite; memcheck of every adversarial / odd-tile / empty-row / grid / option test;
# 2. the indexer and foundation suites (a cache built after the last helper-module change);
# 3. the bench table with the plain-PyTorch reference and FlashMLA on the same inputs, column: vec_store off
#    (interleaved); the H64 shapes with one CTA per item as the column; a top-k sweep with FlashMLA;
# 4. host overhead per call (bench/overhead.py, incl. a tiny sparse-attention call).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6c
add_cache "$2"
suite pytest 240 tests/gpu/test_sparse_attention.py
memcheck memcheck 240 tests/gpu/test_sparse_attention.py -k "adversarial or odd_tile or empty or grid"
suite foundation 100 tests/gpu/test_foundation.py
suite indexer 200 tests/gpu/test_lightning_indexer.py
B="python3 bench/sparse_attention.py --reps 10 --schedule split_halves --flashmla .peer/flashmla"
TAILN=12 run bench 330 $B --options vec_store=0 --json $O/bench.json
TAILN=4 run h64 90 $B --no-torch --grid items --cases 2,5,9 --json $O/h64.json
TAILN=6 run sweep 120 $B --no-torch --cases 0 --topk 1024,2048,4096,8192 --options vec_store=0 --json $O/sweep.json
TAILN=14 run overhead 120 python3 bench/overhead.py --calls 5000 --json $O/overhead.json
