#!/usr/bin/env bash
# Session 6, GPU call 5 (issue 5). Carry .dsagen-cache-s6a and .peer/flashmla.
# 1. the sparse-attention suite (the sink now loaded into registers once per CTA; the epi_overlap option);
#    memcheck of the option tests;
# 2. epi_overlap (each consumer issues the next item's first QK^T half before its epilogue) against the default,
#    interleaved, with FlashMLA in the same rounds; nvidia-smi clocks / power sampled during it;
# 3. the trace of the default and of epi_overlap on the headline case.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6e
suite pytest 240 tests/gpu/test_sparse_attention.py
memcheck memcheck 150 tests/gpu/test_sparse_attention.py -k "halves_options or grid"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > $O/smi.csv 2>&1 &
SMI=$!
TAILN=7 run ov 200 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --flashmla .peer/flashmla \
  --options epi_overlap --cases 0,1,2,3,9 --json $O/ov.json
kill $SMI; awk -F, 'NR>1 {print $2, $4, $6, $7}' $O/smi.csv | sort | uniq -c | sort -rn | head -8
TAILN=26 run trace 60 python3 bench/sparse_attention.py --trace --cases 0 --json $O/trace.json
TAILN=26 run trace_ov 60 python3 bench/sparse_attention.py --trace --cases 0 --options epi_overlap --json $O/trace_ov.json
