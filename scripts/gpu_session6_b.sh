#!/usr/bin/env bash
# Session 6, GPU call 2 (issue 5). Carry .dsagen-cache-s6a, .dsagen-cache-s6i (indexer + foundation tests) and
# .peer/flashmla (FlashMLA built from its source here; not committed).
# 1. the indexer and foundation suites (the device_sm_count host change of session 5 ran on CPU only);
# 2. the split_halves options against the default, interleaved round by round (bench common.paired_time_ms), with
#    FlashMLA timed in the same rounds: vec_store + stream_hint on every bench case; + q_prefetch on the H128 cases;
#    vec_store alone on cases 0-2; the H64 shapes under the persistent grid with vec_store + stream_hint.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6b
add_cache "$2"
suite foundation 120 tests/gpu/test_foundation.py
suite indexer 300 tests/gpu/test_lightning_indexer.py
B="python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --flashmla .peer/flashmla"
TAILN=11 run vh 200 $B --options vec_store,stream_hint --json $O/vh.json
TAILN=5 run vhq 100 $B --options vec_store,stream_hint,q_prefetch --cases 0,1,3 --json $O/vhq.json
TAILN=4 run v 60 $B --options vec_store --cases 0,1,2 --json $O/v.json
TAILN=3 run h64p 60 $B --options vec_store,stream_hint --grid persistent --cases 2,9 --json $O/h64p.json
