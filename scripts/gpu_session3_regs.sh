#!/usr/bin/env bash
# Session 3, GPU call 3: the register-cached top-k kernel (IndexerTopkSpec.reg_keys=64, the host's choice when
# S <= 32768): indexer suite + memcheck + same-process timings against the session-2 top-k (--variant noregs);
# sparse attention: memcheck of schedule serial_lean and serial vs serial_lean timings.
set -u
C=$1; O=${OUT:-c3-out}/c3; mkdir -p $O
export DSAGEN_CACHE_PATH=$(cd $C && pwd) DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
pack() { tar czf ${OUT:-c3-out}/c3.tgz -C $O .; }
run() { local name=$1 secs=$2; shift 2; timeout $secs "$@" > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -v Warn $O/$name.log | tail -n ${TAILN:-3}; pack; }
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
