#!/usr/bin/env bash
# Session 5, GPU call 2 (issue 5): lean split_halves with consumer B's ids a pair ahead. Correctness, then timings
# with the no_gather / no_ready_fence ablations (what the chain and the consumer-side proxy fences cost), then ncu
# full set + SASS source view (stall samples per instruction) of serial_lean and split_halves, real + no_gather.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5b
run pytest 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "split_halves or ablated"
grep -q " passed" $O/pytest.log && ! grep -q "failed" $O/pytest.log || exit 1
TAILN=24 run bench 150 python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --cases 0,1,3 \
  --ablate no_gather,no_ready_fence --json $O/bench.json
NCU="ncu --clock-control none --set full --import-source no"
run ncu 300 $NCU -k regex:sparse_attention_fwd -o $O/prof -f python3 bench/sparse_attention.py --ncu --schedule split_halves --ablate no_gather
ncu -i $O/prof.ncu-rep --page details > $O/details.txt 2>&1
ncu -i $O/prof.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $O/sass.csv.gz
rm -f $O/prof.ncu-rep; pack
grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A" $O/details.txt | head -40
