#!/usr/bin/env bash
# Session-2 GPU call for schedule="split_halves" (notes/kernels/sparse_attention.md, "Session 2: split_halves").
# Carry .dsagen-cache-attn (built by `dsagen.cli build --from-tests tests/gpu/test_sparse_attention.py`).
# Order: hang smoke, speed (same run as the default), the whole test file with split_halves as the module default
# (so the non-parametrized tests - batched, gradients, graphs, torch.compile - run it too), memcheck.
set -u
O=${OUT:-halves-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-attn DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
echo "== smoke"; timeout 30 python3 -c "
import torch, dsagen.fused.sparse_attention as f, test_sparse_attention as t
f.SCHEDULE = 'split_halves'
t.check_against_reference(*t.make_inputs(3, 128, 576, 200, 500, seed=1, length=True, adversarial=True))
q, kv, ids, s, _ = t.make_inputs(8, 64, 512, 320, 900, seed=2, adversarial=True)
t.check_against_reference(q, kv, ids, s, torch.tensor([0, 1, 64, 65, 129, 192, 257, 500], dtype=torch.int32, device='cuda'))
print('SMOKE OK')" 2>&1 | grep -v Warn | tail -4
echo "== bench"; timeout 50 python3 bench/sparse_attention.py --quick --no-torch --reps 5 --schedule split_halves \
  --json $O/bench.json 2>&1 | grep -v Warn | tail -8
echo "== pytest (module default split_halves)"; timeout 120 python3 -c "
import sys, pytest, dsagen.fused.sparse_attention as f
f.SCHEDULE = 'split_halves'
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/gpu/test_sparse_attention.py']))" > $O/pytest.log 2>&1
echo "rc=$?"; grep -E "passed|failed|FAILED|Error" $O/pytest.log | tail -12
echo "== memcheck"; PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --report-api-errors no \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py -k "adversarial and split_halves" > $O/memcheck.log 2>&1
echo "rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.log | tail -4
