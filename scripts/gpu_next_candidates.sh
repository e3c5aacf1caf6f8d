#!/usr/bin/env bash
# Prepared at the end of session 3, not run yet: the first GPU call of the next session. Checks the compile-only
# 64/128-thread top-k kernels exactly, then times every indexer candidate left open against the default in one
# process (two orders, --reps 10), and the sparse-attention schedules at the default's shapes.
# Build first (CPU): DSAGEN_CACHE_DIR=.dsagen-cache-next dsagen build --from-tests tests/gpu --preset deepseek-v3.2
# Run: scripts/gpu_next_candidates.sh .dsagen-cache-next  (carry .dsagen-cache-next)
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" next
TAILN=4 run topk_exact 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py \
  -k "test_topk_kernel_exact and (t64 or t128)"
run memcheck_topk 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "test_topk_kernel_exact and (t64 or t128) and randn"
grep "ERROR SUMMARY" "$O/memcheck_topk.log" | sort | uniq -c
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --profile"
TAILN=20 run cand_a 300 $B --variant default t64 t128 compact lean_free rows4096 --json "$O/cand_a.json"
TAILN=20 run cand_b 300 $B --variant rows4096 lean_free compact t128 t64 default --json "$O/cand_b.json"
TAILN=8 run t131k 300 python3 bench/indexer.py --T 131072 --topk 2048 --ratio 1 --reps 2 --ref-max-T 0 --profile \
  --variant default t64 t128 --json "$O/t131k.json"
