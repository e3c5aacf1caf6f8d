#!/usr/bin/env bash
# Session 4: the score kernel's work-item size (fused.CHUNK_ROWS, a run-time argument) against the default, one
# process, two orders, T=32768 ratio 1 and 4, with in-op kernel times.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4f
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 10 --ref-max-T 0 --trace"
TAILN=1 run chunk_a 120 $B --variant default chunk2048 chunk8192 chunk16384 --json "$O/chunk_a.json"
TAILN=1 run chunk_b 120 $B --variant chunk16384 chunk8192 chunk2048 default --json "$O/chunk_b.json"
grep -h "^ \+[0-9]\|variant" $O/chunk_a.log $O/chunk_b.log
