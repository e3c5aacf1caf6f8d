#!/usr/bin/env bash
# Session 4: the sampled top-k's pass-0 skip. Exact tests of every top-k kernel (new pattern one_octave) + memcheck
# of the sampled ones, the plan test, then top-k alone by row length (sampled vs compact) and the op.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4i
TAILN=2 run exact 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact or plan_per_slab"
run memcheck 90 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact and sample and (one_octave or narrow or randn)"
grep "ERROR SUMMARY" "$O/memcheck.log" | sort | uniq -c
TAILN=11 run topk_len 60 python3 bench/indexer_topk.py --variant t128 c512 s512 s1024 --json "$O/topk_len.json"
TAILN=2 run op 90 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --queued --trace --json "$O/op.json"
grep -h "^ \+[0-9]" $O/op.log
