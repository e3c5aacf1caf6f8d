#!/usr/bin/env bash
# Session-2 diagnostic GPU call: the ablation probes + ncu of notes/kernels/{indexer,sparse_attention}.md.
# Carry .dsagen-cache-idx and .dsagen-cache-abl (built here first). Every step has its own timeout.
# History: ran at commit 9396431 (n256, the lock-step probes and `--schedule split` were pruned later in
# session 2): check that commit out to run it again.
set -u
O=${OUT:-probe-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-idx:.dsagen-cache-abl DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
echo "== idx smoke"; timeout 45 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py -k "ablation_launch_smoke or model_shape" 2>&1 | tail -3
echo "== idx ablations"; timeout 80 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 3 --ref-max-T 0 --profile \
  --variant ablations --json $O/idx_ablations.json > $O/idx_ablations.txt 2>&1; tail -22 $O/idx_ablations.txt
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
for K in score topk; do timeout 55 ncu --clock-control none -k regex:lightning_indexer_$K --launch-skip 100 --launch-count 1 $S \
  -o $O/ncu_idx_$K python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 1 --ref-max-T 0 > /dev/null 2>&1
  timeout 10 ncu --import $O/ncu_idx_$K.ncu-rep --page details > $O/ncu_idx_$K.txt 2>&1; echo "== ncu $K"
  grep -E "SM Frequency|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Shared|Waves Per SM|Registers" $O/ncu_idx_$K.txt | head -20; done
echo "== sa smoke"; timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "ablated or sq4_h128_d576" 2>&1 | tail -3
echo "== sa ablations"; timeout 60 python3 bench/sparse_attention.py --cases 0,1 --no-torch --reps 10 --schedule split --ablate --json $O/sa_ablate.json 2>&1 | grep -v Warn | tail -30
timeout 120 ncu --clock-control none -k regex:sparse_attention_fwd -c 6 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -o $O/ncu_sa python3 bench/sparse_attention.py --ncu --schedule split --ablate no_gather,no_math > $O/ncu_sa.log 2>&1; echo "ncu sa rc=$?"
timeout 20 ncu --import $O/ncu_sa.ncu-rep --page details > $O/ncu_sa.txt 2>&1; grep -E "sparse_attention_fwd|Duration|SM Frequency|Compute \(SM\)|Memory Throughput|L2 Hit|Issue Slots|No Eligible" $O/ncu_sa.txt | head -60
