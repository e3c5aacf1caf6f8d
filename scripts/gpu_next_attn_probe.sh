#!/usr/bin/env bash
# Prepared in session 4 for serial_lean, retargeted in session 5 to the default split_halves (not run yet; session 5 ran the same probe on an intermediate split_halves, notes Session 5): what bounds the compute chain. ncu full set with SASS-level
# stall sampling on the headline case with the gather left out (no_gather) and in, one launch each; the per-warpgroup
# reading is offline (/work/tmp/sass_stalls.py style: split the source page by the warpgroup's code region: producer
# from USETMAXREG.DEALLOC, WG1 / WG2 from their USETMAXREG.TRY_ALLOC). Questions: tensor pipe active vs the shared
# (smem) pipe's busy %, and whether WG1's QK^T HGMMAs wait on the smem port or on issue.
# Build first (CPU): DSAGEN_CACHE_DIR=.dsagen-cache-next dsagen build --from-tests tests/gpu --preset deepseek-v3.2
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" attnprobe
NCU="ncu --clock-control none --set full --import-source no"
for ab in no_gather ""; do
  tag=${ab:-full}
  run ncu_$tag 280 $NCU -k regex:sparse_attention_fwd -o $O/$tag -f python3 bench/sparse_attention.py --ncu --cases 0 \
    --no-torch --schedule split_halves ${ab:+--ablate $ab}
  ncu -i $O/$tag.ncu-rep --page details > $O/$tag.details.txt 2>&1
  ncu -i $O/$tag.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $O/$tag.sass.csv.gz
  rm -f $O/$tag.ncu-rep; pack
done
