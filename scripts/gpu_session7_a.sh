#!/usr/bin/env bash
# Session 7, GPU call A (issue 5): the whole sparse-attention suite at the session-6 review commits (host path,
# row_inv macro, _l2_policy, option-test parametrisation; none GPU-run yet), including epi_overlap v2's option tests;
# memcheck of the epi_overlap tests; epi_overlap v2 timed against the default with FlashMLA (rotated interleaved
# rounds); its trace. Prediction (session-6 trace): +1-2% at topk 2048. Carry .dsagen-cache-next and .peer/flashmla.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7a
suite pytest 220 tests/gpu/test_sparse_attention.py
memcheck memcheck 120 tests/gpu/test_sparse_attention.py -k "halves_options and epi_overlap"
TAILN=8 run bench 170 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves \
  --flashmla .peer/flashmla --options epi_overlap --cases 0,1,2,3,9 --json $O/bench.json
TAILN=26 run trace 50 python3 bench/sparse_attention.py --trace --cases 0 --options epi_overlap --json $O/trace.json
