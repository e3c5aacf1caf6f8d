#!/usr/bin/env bash
# Session 2: first GPU run of SparseAttnFwdSpec(schedule="serial_lean") -- smoke, its tests, bench vs serial.
set -u
O=${OUT:-attn-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-a2 DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
timeout 30 python3 -c "
import torch, dsagen.fused.sparse_attention as f, test_sparse_attention as t
f.SCHEDULE = 'serial_lean'
t.check_against_reference(*t.make_inputs(3, 128, 576, 200, 500, seed=1, length=True, adversarial=True))
q, kv, ids, s, _ = t.make_inputs(8, 64, 512, 320, 900, seed=2, adversarial=True)
t.check_against_reference(q, kv, ids, s, torch.tensor([0, 1, 64, 65, 129, 192, 257, 500], dtype=torch.int32, device='cuda'))
print('SMOKE OK')" > $O/smoke.log 2>&1; r=$?; tail -3 $O/smoke.log; [ $r = 0 ] || exit 1
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k serial_lean > $O/pytest.log 2>&1; tail -3 $O/pytest.log
timeout 50 python3 bench/sparse_attention.py --quick --cases 0,2 --no-torch --reps 10 --schedule serial_lean --ablate no_gather --json $O/bench.json > $O/bench.log 2>&1; grep -v Warn $O/bench.log | tail -14
