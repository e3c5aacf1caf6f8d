#!/usr/bin/env bash
# (Ran at bfc4ff4 plus the uncommitted reg_keys top-k described in notes/kernels/indexer-topk.md, session 3: not reproducible as is.)
# Session 3, GPU call 3: the register-cached top-k kernel (IndexerTopkSpec.reg_keys=64, the host's choice when
# S <= 32768): indexer suite + memcheck + same-process timings against the session-2 top-k (--variant noregs);
# sparse attention: memcheck of schedule serial_lean and serial vs serial_lean timings.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" c3
run test_indexer 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=6 run bench_a 150 $B --variant default noregs --json $O/bench_a.json
TAILN=6 run bench_b 150 $B --variant noregs default --json $O/bench_b.json
TAILN=24 run bench_sweep 300 python3 bench/indexer.py --T 8192 32768 --topk 512 2048 --ratio 1 4 --reps 5 --ref-max-T 32768 --variant default noregs --json $O/bench_sweep.json
run memcheck_idx 300 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "(test_topk_kernel_exact and reg_keys and randn) or packed_documents or heads_and_dims or topk_edges or long_causal"
grep "ERROR SUMMARY" $O/memcheck_idx.log
run memcheck_attn 240 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_sparse_attention.py -k serial_lean
grep "ERROR SUMMARY" $O/memcheck_attn.log
TAILN=20 run bench_attn 240 python3 bench/sparse_attention.py --quick --no-torch --reps 10 --schedule serial_lean --json $O/bench_attn.json
