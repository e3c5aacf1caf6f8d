#!/usr/bin/env bash
# Session 4, last call: the final top-k kernels (block-scan merge, pass-0 skip) through the whole indexer suite and
# memcheck on its edge-case tests (the other suites ran on unchanged kernels in gpu_session4_final.sh).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4j
TAILN=2 run tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
run memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal or plan_per_slab"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
