#!/usr/bin/env bash
# Session 4: the spread of the target shape on one machine: three separate processes, --reps 20 each, with the SM
# clock / power / temperature sampled every 100 ms alongside.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s4h
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $O/smi.csv 2>&1 &
SMI=$!
for i in 1 2 3; do
  TAILN=1 run op$i 80 python3 bench/indexer.py --T 32768 --topk 2048 --ratio 1 --reps 20 --ref-max-T 0 --json "$O/op$i.json"
done
kill $SMI
python3 - "$O/smi.csv" <<'PY'
import csv, sys, statistics
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0][:2] == "20"]
clk = [float(r[1].split()[0]) for r in rows]
pw = [float(r[2].split()[0]) for r in rows]
busy = [(c, p, r[3], r[4]) for c, p, r in zip(clk, pw, rows) if p > 300]
print(f"samples {len(rows)}, under load {len(busy)}: SM clock median {statistics.median([b[0] for b in busy]):.0f} MHz "
      f"(min {min(b[0] for b in busy):.0f}), power median {statistics.median([b[1] for b in busy]):.0f} W (max {max(b[1] for b in busy):.0f}), "
      f"temp {busy[-1][2]}, throttle reasons seen {sorted(set(b[3] for b in busy))}")
PY
