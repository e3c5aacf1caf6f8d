#!/usr/bin/env bash
# Session 7, GPU call C: where a call's energy goes (bench/energy.py): the default and its no_gather ablation, the
# l2_hint option, the serial schedule and its ablations (no_softmax, no_pv, no_math, no_gather: the energy of each
# stage), serial_lean; then the same default / no_gather / l2_hint on a 4096-row KV pool (no KV DRAM traffic).
# Carry .dsagen-cache-next.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7c
TAILN=16 run energy 200 python3 bench/energy.py --cases 0 --json $O/energy0.json \
  --variants default,no_gather,l2_hint,serial,serial/no_softmax,serial/no_pv,serial/no_math,serial/no_gather,serial_lean
TAILN=8 run energy2 100 python3 bench/energy.py --cases 2 --variants default,no_gather,l2_hint --json $O/energy2.json
