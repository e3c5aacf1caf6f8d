#!/usr/bin/env bash
# Session 3, GPU call 1: verify HEAD (tests), then ncu profiles of the indexer score / top-k kernels
# (T=32768 mid-sequence slab) and of the sparse-attention schedules (serial, serial_lean, no_gather),
# full set with SASS-level stall sampling. Everything lands in $OUT/probe.tgz.
set -u
C=$1; O=${OUT:-probe-out}/p; mkdir -p $O
export DSAGEN_CACHE_PATH=$(cd $C && pwd) DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
pack() { tar czf ${OUT:-probe-out}/probe.tgz -C $O .; }
GPU_CHECK_ARCHIVE= bash scripts/gpu_check.sh $C $O tests; pack
NCU="ncu --clock-control none --set full --import-source no"
rep() { ncu -i $1.ncu-rep --page details > $1.details.txt 2>&1
        ncu -i $1.ncu-rep --page source --csv --print-source sass > $1.sass.csv 2>&1; gzip -f $1.sass.csv; rm -f $1.ncu-rep; }
timeout 240 $NCU -k regex:lightning_indexer_ --launch-skip 128 --launch-count 2 -o $O/idx -f \
  python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 1 --ref-max-T 0 > $O/ncu_idx.log 2>&1; echo "ncu idx rc=$?"
rep $O/idx; pack
timeout 300 $NCU -k regex:sparse_attention_fwd -o $O/attn -f \
  python3 bench/sparse_attention.py --ncu --cases 0 --no-torch --schedule serial_lean --ablate no_gather > $O/ncu_attn.log 2>&1; echo "ncu attn rc=$?"
rep $O/attn; pack
ls -la $O; tail -3 $O/ncu_*.log
