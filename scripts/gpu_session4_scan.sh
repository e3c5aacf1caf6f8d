#!/usr/bin/env bash
# Session 4: the merged block scan of the top-k kernels (one body for every thread count): exact tests of every
# top-k kernel, then the top-k alone by row length and the op at the target shape (regression check).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4g
TAILN=2 run exact 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact or plan_per_slab or graph"
TAILN=12 run topk_len 90 python3 bench/indexer_topk.py --variant t64 t128 t512 t1024 c512 s512 s1024 --json "$O/topk_len.json"
TAILN=2 run op 90 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --trace --variant default default --json "$O/op.json"
grep -h "^ \+[0-9]" $O/op.log
