#!/usr/bin/env bash
# compute-sanitizer's four tools on small shapes of every fused kernel (tests/gpu/test_sanitize.py: the sparse
# forward and backward at H128 / D576 and H64 / D512 with a sink, the lightning indexer's score kernel and every top-k kernel of
# its plan, invalid packed offsets, compactify, local_to_global, and the probe kernels of tests/gpu/sanitizer_probes.py).
# memcheck, synccheck and initcheck must report 0 errors; racecheck's hazards must all be the one explained pattern
# (its verdict, rc 0); what each tool reported before the fixes is in notes/kernels/sparse_attention.md ("Sanitizers").
#
# Build the kernels and the probes first, on a machine with CuTe-DSL (no GPU needed):
#   DSAGEN_CACHE_DIR=.dsagen-cache-san dsagen build --spec-file tests/gpu/required_specs.json
#   python tests/gpu/sanitizer_probes.py .dsagen-cache-san/probes
# then on the GPU machine (no CuTe-DSL needed; the probes are read from CACHE/probes):
#   scripts/sanitize.sh .dsagen-cache-san [tools...]        (default: memcheck racecheck synccheck initcheck)
# Logs go to ${OUT:-sanitize-out}/sanitize/TOOL.log, archived after every step into ${OUT:-sanitize-out}/sanitize.tgz.
# Extra pytest arguments (words without spaces, e.g. -x): SANITIZE_PYTEST_ARGS; a -k expression (spaces allowed, e.g.
# "qsa or kv_fp8"): SANITIZE_K.
set -u
. "$(dirname "$0")/gpu_lib.sh"
gpu_setup "$1" sanitize; shift
export SANITIZER_PROBES=${SANITIZER_PROBES:-$GPU_CACHE/probes}
TAILN=${TAILN:-2}
for tool in ${*:-memcheck racecheck synccheck initcheck}; do
  # shellcheck disable=SC2086
  sanitize "$tool" "${SANITIZE_SECONDS:-300}" tests/gpu/test_sanitize.py ${SANITIZE_K:+-k "$SANITIZE_K"} \
    ${SANITIZE_PYTEST_ARGS:-}
done
