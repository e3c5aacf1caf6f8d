#!/usr/bin/env bash
# Prepared in session 6, NOT run yet (issue 5): split_halves option epi_overlap, second version (built and
# ptxas-checked on CPU: no C7514 / C7515 serialisation, no spills). Each consumer packs its O words, issues the first
# QK^T half of the CTA's next item (a dummy when there is none with pairs), then stores O under it.
# Prediction (session-6 trace): the item boundary (~1.9 us of 56 us, mostly the O stores) shrinks by ~0.6-1.2 us per
# item: +1-2% at topk 2048, less at larger topk.
# Build first (CPU): DSAGEN_CACHE_DIR=.dsagen-cache-next dsagen build --from-tests tests/gpu/test_sparse_attention.py --preset deepseek-v3.2
# Carry .dsagen-cache-next and (for the FlashMLA column) .peer/flashmla (rebuild it with its build.sh if absent).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" epiov
run pytest 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "halves_options or grid"
grep -E "^FAILED" $O/pytest.log | head
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest \
  -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "halves_options and epi_overlap"
grep "ERROR SUMMARY" $O/memcheck.log | sort | uniq -c
F=""; [ -d .peer/flashmla ] && F="--flashmla .peer/flashmla"
TAILN=7 run bench 200 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves $F --options epi_overlap \
  --cases 0,1,2,3,9 --json $O/bench.json
TAILN=26 run trace 60 python3 bench/sparse_attention.py --trace --cases 0 --options epi_overlap --json $O/trace.json
