#!/usr/bin/env bash
# Session 6, final GPU call (issue 5): the final defaults (split_halves with vec_store + stream_hint, the persistent
# grid at H64 and H128, the sink in registers, the host path). Carry .dsagen-cache-s6a, .dsagen-cache-s6i and
# .peer/flashmla (FlashMLA built from its source here; not committed).
# 1. the sparse-attention suite; memcheck of every adversarial / odd-tile / empty-row / grid / option test;
#    the foundation and indexer suites;
# 2. the bench table with the plain-PyTorch reference and FlashMLA on the same inputs (rotated interleaved rounds),
#    column: the session-5 kernel options (vec_store and stream_hint off); a top-k sweep with FlashMLA;
# 3. the trace of the default at the headline shape; host overhead per call.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6g
add_cache "$2"
suite pytest 200 tests/gpu/test_sparse_attention.py
memcheck memcheck 200 tests/gpu/test_sparse_attention.py -k "adversarial or odd_tile or empty or grid"
suite foundation 60 tests/gpu/test_foundation.py
suite indexer 120 tests/gpu/test_lightning_indexer.py
B="python3 bench/sparse_attention.py --reps 10 --schedule split_halves --flashmla .peer/flashmla"
TAILN=12 run bench 300 $B --options vec_store=0,stream_hint=0 --json $O/bench.json
TAILN=6 run sweep 120 $B --no-torch --cases 0 --topk 1024,2048,4096,8192 --options vec_store=0,stream_hint=0 --json $O/sweep.json
TAILN=26 run trace 60 python3 bench/sparse_attention.py --trace --cases 0 --json $O/trace.json
TAILN=14 run overhead 100 python3 bench/overhead.py --calls 5000 --json $O/overhead.json
