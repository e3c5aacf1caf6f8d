#!/usr/bin/env bash
# Session 7, GPU call B: energy per call (bench/energy.py, NVML counter) of the default kernel, its no_gather
# ablation, the session-5 options and FlashMLA: how much of a call's energy is the gather (decides whether the 2-CTA
# cluster gather is worth building under the power cap); the foundation and indexer suites on a rebuilt cache.
# Carry .dsagen-cache-next (sparse + indexer + foundation kernels) and .peer/flashmla.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7b
TAILN=20 run energy 150 python3 bench/energy.py --cases 0 --variants default,no_gather,session5 \
  --flashmla .peer/flashmla --json $O/energy0.json
TAILN=12 run energy1 100 python3 bench/energy.py --cases 1 --variants default,session5 --flashmla .peer/flashmla \
  --json $O/energy1.json
run foundation 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_foundation.py
run indexer 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
grep -E "^FAILED" $O/indexer.log | head
