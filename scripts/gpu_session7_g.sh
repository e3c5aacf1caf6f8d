#!/usr/bin/env bash
# Session 7, GPU call G (issue 5, the grid tail): the default kernel on 128 CTAs (8192 items = 64 full waves, no tail;
# 4 SMs idle, which under the power cap may buy clock) against the persistent grid of 132 CTAs (62 waves + a tail of 8
# items), interleaved rotated rounds. Control: S_q 32768 (65536 items: 512 waves on 128 vs 496.5 on 132, no tail to
# gain). Carry .dsagen-cache-final.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7g
TAILN=5 run grid128 150 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --grid 128 \
  --cases 0,1,3 --json $O/grid128.json
