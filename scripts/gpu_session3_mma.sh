#!/usr/bin/env bash
# (Ran at commit eedb85f, where mma_head_sum was the bfloat16 default: "default" below meant mma_head_sum=True.)
# Session 3, GPU call 4: the indexer head sum on the tensor cores (IndexerScoreSpec.mma_head_sum, default for
# bfloat16) and the per-shape sparse-attention schedule (serial_lean at H128/D576): both GPU suites, memcheck,
# same-process timings against the CUDA-core head sum (--variant nomma), the full indexer sweep.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" c4
TAILN=6 run test_indexer 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
run test_attention 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py tests/gpu/test_foundation.py
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=5 run bench_a 150 $B --variant default nomma --json $O/bench_a.json
TAILN=5 run bench_b 150 $B --variant nomma default --json $O/bench_b.json
TAILN=16 run bench_sweep 400 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --json $O/indexer.json
run memcheck 300 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu \
  -k "heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal or adversarial"
grep "ERROR SUMMARY" $O/memcheck.log
TAILN=12 run bench_attn 300 python3 bench/sparse_attention.py --reps 10 --schedule serial --json $O/sparse_attention.json
