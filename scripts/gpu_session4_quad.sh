#!/usr/bin/env bash
# Session 4: schedule "quad" of the sparse MLA forward (4 warpgroups: scores-only WG1, two P V warpgroups). Its
# correctness tests (the schedule-parametrized suite), then the headline cases against the default in one run.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4k
TAILN=3 run tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_sparse_attention.py -k "quad"
grep -m5 "Error\|assert" $O/tests.log
TAILN=8 run bench 100 python3 bench/sparse_attention.py --schedule quad --cases 0,1,3 --reps 10 --json $O/attn.json
