#!/usr/bin/env bash
# Session 4: the two-slab pipeline (fused.SLAB_BUFFERS = 2: each slab's top-k on a side stream while the score
# kernel fills the other slab). Correctness (whole indexer suite incl. the new buffers tests, memcheck on them),
# then the pipe variants against the default in one process, two orders, with each kernel's in-op device time;
# then top-k thread counts at shorter pools (the S-based top-k width policy).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4b
TAILN=4 run tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
run memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "buffers"
grep "ERROR SUMMARY" "$O/memcheck.log" | sort | uniq -c
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --trace"
TAILN=14 run pipe_a 150 $B --variant default pipe128 pipe64 pipe32 pipe16 --json "$O/pipe_a.json"
TAILN=14 run pipe_b 150 $B --variant pipe16 pipe32 pipe64 pipe128 default --json "$O/pipe_b.json"
