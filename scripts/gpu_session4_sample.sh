#!/usr/bin/env bash
# Session 4: the sampled-threshold top-k (IndexerTopkSpec.sample). Exact tests of every top-k kernel (new pattern
# front_heavy), memcheck on the sampled kernels, the whole indexer suite, then the top-k alone by row length.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4d
TAILN=4 run exact 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact"
run memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact and sample and (randn or front_heavy or equal)"
grep "ERROR SUMMARY" "$O/memcheck.log" | sort | uniq -c
TAILN=12 run topk_len 90 python3 bench/indexer_topk.py --variant t128 c512 s512 c1024 s1024 --json "$O/topk_len.json"
TAILN=4 run tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "not test_topk_kernel_exact"
