#!/usr/bin/env bash
# Session 6, GPU call 4 (issue 5). Carry .dsagen-cache-s6a, .dsagen-cache-s6i and .peer/flashmla.
# 1. the sparse-attention suite after the host-path change (eager calls launch directly; no autograd Function
#    without a gradient; a cached launch plan) and with the trace ablation's smoke test;
# 2. the trace of the default kernel on the headline case and at top-k 1024 / 8192: where an item's time goes;
# 3. host overhead per call; the decode cases against FlashMLA.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6d
add_cache "$2"
suite pytest 240 tests/gpu/test_sparse_attention.py
TAILN=30 run trace 120 python3 bench/sparse_attention.py --trace --cases 0 --json $O/trace.json
TAILN=30 run trace_k 120 python3 bench/sparse_attention.py --trace --cases 0 --topk 1024,8192 --json $O/trace_k.json
TAILN=14 run overhead 120 python3 bench/overhead.py --calls 5000 --json $O/overhead.json
TAILN=4 run decode 90 python3 bench/sparse_attention.py --no-torch --reps 10 --cases 6,7 --flashmla .peer/flashmla --json $O/decode.json
