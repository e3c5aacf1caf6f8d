#!/usr/bin/env bash
# Session 5, GPU call 1 (issue 5): split_halves with the lean softmax (FMNMX trees, P packed once, stmatrix P
# stores, validity as booleans). Correctness smoke + every split_halves GPU test, then same-process timings of
# split_halves next to the default (serial_lean at H128/D576) incl. the no_gather chains, two passes.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s5a
run smoke 60 python3 -c "
import torch, dsagen.fused.sparse_attention as f, test_sparse_attention as t
f.SCHEDULE = 'split_halves'
t.check_against_reference(*t.make_inputs(3, 128, 576, 200, 500, seed=1, length=True, adversarial=True))
q, kv, ids, s, _ = t.make_inputs(8, 64, 512, 320, 900, seed=2, adversarial=True)
t.check_against_reference(q, kv, ids, s, torch.tensor([0, 1, 64, 65, 129, 192, 257, 500], dtype=torch.int32, device='cuda'))
print('SMOKE OK')"
grep -q "SMOKE OK" $O/smoke.log || exit 1
run pytest 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k split_halves
B="python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves"
TAILN=30 run bench_a 150 $B --cases 0,1,2,3 --ablate no_gather --json $O/bench_a.json
TAILN=12 run bench_b 100 $B --cases 3,2,1,0 --json $O/bench_b.json
TAILN=6 run bench_c 100 $B --l2-hint --cases 0,1 --json $O/bench_c.json
