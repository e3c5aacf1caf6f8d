# Shared setup of a GPU script such as scripts/sanitize.sh (source it): gpu_setup CACHE NAME exports the shipped-cache
# environment (DSAGEN_CACHE_PATH=CACHE, JIT off, repo + tests/gpu on PYTHONPATH) and sets O=${OUT:-NAME-out}/NAME;
# `run NAME SECONDS COMMAND...` runs one step under its timeout into $O/NAME.log, prints its rc and last ${TAILN:-3}
# lines (warnings filtered) and archives $O into ${OUT:-NAME-out}/NAME.tgz (one file that comes back even when
# later steps are cut off: the device tool returns at most 8 files).
gpu_setup() {
  GPU_CACHE=$(cd "$1" && pwd); GPU_NAME=$2
  O=${OUT:-$GPU_NAME-out}/$GPU_NAME; mkdir -p "$O"
  export DSAGEN_CACHE_PATH=$GPU_CACHE DSAGEN_DISABLE_JIT=1 DSAGEN_CACHE_DIR=/tmp/dsagen-w PYTHONPATH=.:tests/gpu \
    PYTHONUNBUFFERED=1
}
pack() { tar czf "${OUT:-$GPU_NAME-out}/$GPU_NAME.tgz" -C "$O" .; }
run() {
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$O/$name.log" 2>&1; echo "== $name rc=$?"
  grep -v Warn "$O/$name.log" | tail -n "${TAILN:-3}"; pack
}
# `suite NAME SECONDS TESTFILE [PYTEST ARGS...]`: one GPU test file under `run`, then its FAILED / E lines.
suite() {
  local name=$1 secs=$2; shift 2
  run "$name" "$secs" python3 -m pytest -q -m gpu -p no:cacheprovider "$@"
  grep -E "^FAILED|^E  " "$O/$name.log" | head -20
}
# `memcheck NAME SECONDS TESTFILE [PYTEST ARGS...]`: the same under compute-sanitizer memcheck (no caching
# allocator, so every buffer is its own allocation), then the distinct ERROR SUMMARY lines.
memcheck() {
  local name=$1 secs=$2; shift 2
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "$name" "$secs" compute-sanitizer --tool memcheck --report-api-errors no \
    python3 -m pytest -q -m gpu -p no:cacheprovider "$@"
  grep "ERROR SUMMARY" "$O/$name.log" | sort | uniq -c
}
# `add_cache DIR`: one more read-only kernel cache on DSAGEN_CACHE_PATH (after gpu_setup's).
add_cache() { export DSAGEN_CACHE_PATH=$DSAGEN_CACHE_PATH:$(cd "$1" && pwd); }
# `sanitize TOOL SECONDS TESTFILE [PYTEST ARGS...]`: the GPU tests under compute-sanitizer TOOL (memcheck, racecheck,
# synccheck or initcheck; no caching allocator, so every buffer is its own allocation and initcheck sees torch's
# fresh allocations as unwritten) into $O/TOOL.log (rc 99: the tool reported errors), then its summary lines.
# Racecheck lists every hazard (all severities, no backtraces) and tests/gpu/sanitizer_probes.py check-racecheck
# classifies them into $O/racecheck_verdict.log: rc 0 only when each one is the explained split_halves pair-max
# pattern (or its probe); ${SANITIZE_PRINT_LIMIT:-100000} errors are printed.
sanitize() {
  local tool=$1 secs=$2; shift 2
  local opts=(--tool "$tool" --print-limit "${SANITIZE_PRINT_LIMIT:-100000}" --report-api-errors no --error-exitcode 99)
  [ "$tool" = racecheck ] && opts+=(--racecheck-report hazard --racecheck-detect-level info --show-backtrace no)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "$tool" "$secs" compute-sanitizer "${opts[@]}" \
    python3 -m pytest -q -m gpu -p no:cacheprovider "$@"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$O/$tool.log" | sort | uniq -c
  if [ "$tool" = racecheck ]; then
    python3 tests/gpu/sanitizer_probes.py check-racecheck "$O/racecheck.log" > "$O/racecheck_verdict.log" 2>&1
    echo "== racecheck verdict rc=$?"; cat "$O/racecheck_verdict.log"; pack
  fi
}
