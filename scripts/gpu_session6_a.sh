#!/usr/bin/env bash
# Session 6, GPU call 1 (issue 5). Carry .dsagen-cache-s6a (tests/gpu/test_sparse_attention.py + preset) and the
# FlashMLA peer (.peer/flashmla, git-ignored, built here from the fetched source; not committed).
# 1. the sparse-attention suite on the rebuilt cache (covers session 5's last commits and the new split_halves
#    options vec_store / stream_hint / q_prefetch); memcheck of the new option tests;
# 2. the FlashMLA peer: correctness against dsagen's reference, then FlashMLA and dsagen's default timed on the same
#    inputs in one process (bench shapes + a top-k sweep);
# 3. each new option against the default in the same run (cases 0, 1, 2).
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6a
suite pytest 240 tests/gpu/test_sparse_attention.py
memcheck memcheck 150 tests/gpu/test_sparse_attention.py -k "halves_options"
TAILN=20 run peer 200 python3 .peer/flashmla/check_and_bench.py --with-dsagen --topk 1024,2048,4096,8192
B="python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --cases 0,1,2"
TAILN=4 run vec 60 $B --options vec_store --json $O/vec.json
TAILN=4 run vec_hint 60 $B --options vec_store,stream_hint --json $O/vec_hint.json
TAILN=4 run qpf 60 $B --options q_prefetch --json $O/qpf.json
TAILN=4 run all 60 $B --options vec_store,stream_hint,q_prefetch --json $O/all.json
