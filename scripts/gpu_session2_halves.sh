#!/usr/bin/env bash
# Session-2 GPU call for schedule="split_halves" (notes/kernels/sparse_attention.md, "Session 2: split_halves").
# Carry .dev-<name> with .dsagen-cache-attn inside (built by `dsagen.cli build --from-tests
# tests/gpu/test_sparse_attention.py`). Order: speed first (serial default vs split_halves, then vs split_halves +
# l2_hint, each in the same run as the default), then the whole test file with split_halves + l2_hint as the module
# defaults (so the non-parametrized tests - batched, gradients, graphs, torch.compile - run it too), then memcheck.
set -u
O=${OUT:-halves-out}; mkdir -p $O
export DSAGEN_CACHE_PATH=.dsagen-cache-attn DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w
export PYTHONPATH=.:tests/gpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
echo "== bench split_halves"; timeout 30 python3 bench/sparse_attention.py --quick --no-torch --reps 5 \
  --schedule split_halves --json $O/bench_halves.json 2>&1 | grep -v Warn | tail -6
echo "== bench split_halves + l2_hint"; timeout 30 python3 bench/sparse_attention.py --quick --no-torch --reps 5 \
  --schedule split_halves --l2-hint --json $O/bench_halves_l2.json 2>&1 | grep -v Warn | tail -6
DEF="import sys, pytest, dsagen.fused.sparse_attention as f; f.SCHEDULE = 'split_halves'; f.L2_HINT = True"
echo "== pytest (module defaults split_halves + l2_hint)"; timeout 60 python3 -c "$DEF
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/gpu/test_sparse_attention.py']))" > $O/pytest.log 2>&1
echo "rc=$?"; grep -E "passed|failed|FAILED|Error" $O/pytest.log | tail -12
echo "== memcheck"; PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 30 compute-sanitizer --tool memcheck --report-api-errors no \
  python3 -c "$DEF
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/gpu/test_sparse_attention.py', '-k', 'adversarial and (split_halves or l2_hint)']))" > $O/memcheck.log 2>&1
echo "rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $O/memcheck.log | tail -4
