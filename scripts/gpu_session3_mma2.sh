#!/usr/bin/env bash
# Session 3, GPU call 5: mma_head_sum with the head-sum wgmma deferred into the next turn (ahead of the next
# tile's scores): indexer suite, memcheck, same-process timings against the CUDA-core head sum (nomma).
set -u
C=$1; O=${OUT:-c5-out}/c5; mkdir -p $O
export DSAGEN_CACHE_PATH=$(cd $C && pwd) DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
pack() { tar czf ${OUT:-c5-out}/c5.tgz -C $O .; }
run() { local name=$1 secs=$2; shift 2; timeout $secs "$@" > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -v Warn $O/$name.log | tail -n ${TAILN:-3}; pack; }
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=5 run bench_a 120 $B --variant default nomma --json $O/bench_a.json
TAILN=6 run test_indexer 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
TAILN=5 run bench_b 120 $B --variant nomma default --json $O/bench_b.json
run memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "heads_and_dims or packed_documents or no_candidates or topk_edges or long_causal"
grep "ERROR SUMMARY" $O/memcheck.log
TAILN=16 run bench_sweep 300 python3 bench/indexer.py --T 8192 32768 131072 --topk 512 2048 --ratio 1 4 --reps 3 --json $O/indexer.json
