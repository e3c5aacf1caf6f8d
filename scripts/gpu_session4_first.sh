#!/usr/bin/env bash
# Session 4, first GPU call: every GPU suite at the tree left by session 3 (host-only review commits since the last
# GPU run, and the new 64/128-thread top-k kernels), memcheck on those top-k kernels, then the open indexer
# candidates against the default in one process (--reps 10).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4a
TAILN=6 run tests 290 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu tests/test_reference_indexer_cuda.py
run memcheck_topk 90 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact and (t64 or t128) and randn"
grep "ERROR SUMMARY" "$O/memcheck_topk.log" | sort | uniq -c
TAILN=30 run cand_a 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --profile \
  --variant default t64 t128 compact lean_free rows4096 --json "$O/cand_a.json"
