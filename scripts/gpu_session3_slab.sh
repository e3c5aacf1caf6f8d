#!/usr/bin/env bash
# Session 3, GPU call 6: the score-slab cap (fused.SLAB_BYTES) as a speed knob, same process (bench variants slab*).
set -u
C=$1; O=${OUT:-c6-out}/c6; mkdir -p $O
export DSAGEN_CACHE_PATH=$(cd $C && pwd) DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
pack() { tar czf ${OUT:-c6-out}/c6.tgz -C $O .; }
run() { local name=$1 secs=$2; shift 2; timeout $secs "$@" > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -v Warn $O/$name.log | tail -n ${TAILN:-3}; pack; }
TAILN=8 run slab_32k 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 5 --ref-max-T 0 --profile --variant default slab8 slab16 slab64 slab128 --json $O/slab_32k.json
TAILN=8 run slab_32k_b 200 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 4 --reps 5 --ref-max-T 0 --profile --variant slab128 slab64 default --json $O/slab_32k_b.json
TAILN=6 run slab_128k 200 python3 bench/indexer.py --T 131072 --topk 2048 --ratio 1 --reps 2 --ref-max-T 0 --profile --variant default slab64 slab128 --json $O/slab_128k.json
