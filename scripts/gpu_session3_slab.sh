#!/usr/bin/env bash
# (Ran at commit d7d1742, slab cap 32 MiB; the slab8/slab128 variants were renamed since: slab16/slab32/slab64 now.)
# Session 3, GPU call 6: the score-slab cap (fused.SLAB_BYTES) as a speed knob, same process (bench variants slab*).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" c6
TAILN=8 run slab_32k 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 5 --ref-max-T 0 --profile --variant default slab8 slab16 slab64 slab128 --json $O/slab_32k.json
TAILN=8 run slab_32k_b 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 5 --ref-max-T 0 --profile --variant slab128 slab64 default --json $O/slab_32k_b.json
TAILN=6 run slab_128k 200 python3 bench/indexer.py --T 131072 --topk 2048 --ratio 1 --reps 2 --ref-max-T 0 --profile --variant default slab64 slab128 --json $O/slab_128k.json
