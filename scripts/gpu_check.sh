#!/usr/bin/env bash
# One GPU session: every GPU test suite, compute-sanitizer memcheck on the edge-case tests, the four sanitizer tools on
# small shapes of every fused kernel (scripts/sanitize.sh), and the benchmarks,
# each step under its own timeout so that a hang costs one step, not the session.
#
# Build the kernels first, on a machine with CuTe-DSL (no GPU needed):
#   DSAGEN_CACHE_DIR=.dsagen-cache-gpu dsagen build --spec-file tests/gpu/required_specs.json --preset deepseek-v3.2
#   python tests/gpu/sanitizer_probes.py .dsagen-cache-gpu/probes
# then on the GPU machine (no CuTe-DSL needed):
#   scripts/gpu_check.sh .dsagen-cache-gpu OUTDIR [steps...]
# steps: tests memcheck sanitize bench (default: all); bench_kernels = the indexer and sparse-attention benchmarks only;
# sanitize = scripts/sanitize.sh (memcheck, racecheck, synccheck, initcheck; logs in OUTDIR/sanitize).
# With GPU_CHECK_ARCHIVE=FILE.tgz, OUTDIR is archived into FILE after every step (one file to copy back,
# complete up to the last finished step even if the whole run is cut off).
set -u
cache=$(cd "$1" && pwd); out=${2:-gpu-out}; shift 2 || true
steps=${*:-tests memcheck sanitize bench}
mkdir -p "$out"
export DSAGEN_CACHE_PATH=$cache DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=${TMPDIR:-/tmp}/dsagen-w PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.log, print its last lines
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "== $name (rc=$rc$([ $rc = 124 ] && echo ', TIMED OUT'))"; tail -n 4 "$out/$name.log"
  if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then tar czf "$GPU_CHECK_ARCHIVE" -C "$out" .; fi
}
for s in $steps; do case $s in
  tests)
    step test_foundation 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_foundation.py
    step test_indexer 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_lightning_indexer.py
    step test_sparse_attention 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sparse_attention.py
    step test_sparse_attention_backward 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_sparse_attention_backward.py tests/gpu/test_sparse_attention_backward_public.py
    step test_attn_score_recompute 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_attn_score_recompute.py
    step test_indexer_score_recompute 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_indexer_score_recompute.py
    step test_indexer_backward 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_indexer_backward.py
    step test_indexer_topk 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_indexer_topk.py
    step test_reference_cuda 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_reference_indexer_cuda.py ;;
  memcheck)
    step memcheck 300 compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu \
      -p no:cacheprovider tests/gpu -k "(foundation or heads_and_dims or packed_documents or no_candidates or topk_edges or adversarial) and not without_cutlass"
    grep "ERROR SUMMARY" "$out/memcheck.log" ;;
  sanitize)
    step sanitize 900 env OUT="$out" bash scripts/sanitize.sh "$cache" ;;
  bench)
    step bench_overhead 120 python3 bench/overhead.py --calls 10000 --json "$out/overhead.json"
    step bench_first_launch 60 bash -c 'for i in 1 2 3; do python3 bench/first_launch.py; done'
    step bench_indexer 300 python3 bench/indexer.py --reps 3 --json "$out/indexer.json"
    step bench_sparse_attention 300 python3 bench/sparse_attention.py --json "$out/sparse_attention.json"
    step bench_sparse_attention_backward 300 python3 bench/sparse_attention_backward.py
    step bench_attn_score_recompute 200 python3 bench/attn_score_recompute.py
    step bench_indexer_score_recompute 200 python3 bench/indexer_score_recompute.py
    step bench_indexer_backward 200 python3 bench/indexer_backward.py
    step bench_indexer_topk_rows 200 python3 bench/indexer_topk_rows.py
    step bench_dsa_training_step 300 python3 bench/dsa_training_step.py ;;
  bench_kernels)
    step bench_indexer 300 python3 bench/indexer.py --reps 3 --json "$out/indexer.json"
    step bench_sparse_attention 300 python3 bench/sparse_attention.py --json "$out/sparse_attention.json" ;;
  *) echo "unknown step $s" >&2; exit 2 ;;
esac; done
