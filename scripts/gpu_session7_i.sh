#!/usr/bin/env bash
# Session 7, GPU call I: the host path reads each stride tuple once (was 9 stride() calls per call); a new test of
# strided / misaligned inputs (read in place or copied first). The sparse suite, memcheck of the new test, and the
# host-time breakdown again (call H: _launch 38.3 us). Carry .dsagen-cache-final. Run twice: the first run found
# that a contiguous but misaligned q / kv reached the launcher (contiguous() returns it as is); the op now clones it.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s7i
suite pytest 150 tests/gpu/test_sparse_attention.py
memcheck memcheck 60 tests/gpu/test_sparse_attention.py -k "strided"
TAILN=8 run overhead 60 python3 bench/overhead.py --calls 5000 --sparse-breakdown --json $O/breakdown.json
