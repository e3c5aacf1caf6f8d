#!/usr/bin/env bash
# (Runs at commit 2a76e5e: the balanced schedule and slab_plan were pruned right after it.)
# Session 3, GPU call 2: the balanced score schedule and the causal slab plan (slab_plan): indexer suite,
# memcheck of the new paths, then same-process timings (two passes in opposite orders against the noise).
set -u
C=$1; O=${OUT:-c2-out}/c2; mkdir -p $O
export DSAGEN_CACHE_PATH=$(cd $C && pwd) DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
pack() { tar czf ${OUT:-c2-out}/c2.tgz -C $O .; }
run() { local name=$1 secs=$2; shift 2; timeout $secs "$@" > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -v Warn $O/$name.log | tail -n ${TAILN:-3}; pack; }
run test_indexer 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
B="python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 10 --ref-max-T 0 --profile"
TAILN=12 run bench_a 200 $B --variant default balanced uniform balanced_uniform --json $O/bench_a.json
TAILN=12 run bench_b 200 $B --variant balanced_uniform uniform balanced default --json $O/bench_b.json
TAILN=12 run bench_c 200 python3 bench/indexer.py --T 8192 32768 --topk 2048 --ratio 1 4 --reps 5 --ref-max-T 0 --variant default balanced --json $O/bench_c.json
run memcheck 300 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_lightning_indexer.py -k "(test_score_schedules and balanced) or causal_slab_plan or packed_documents or heads_and_dims"
grep "ERROR SUMMARY" $O/memcheck.log
