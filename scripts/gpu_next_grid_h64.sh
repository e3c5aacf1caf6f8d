#!/usr/bin/env bash
# Prepared in session 5, not run yet (issue 5): why split_halves with GRID=persistent is 0.89-0.91x one CTA per
# item at H64 / D576 (S_q 4096, KV 32768) while it is 1.02-1.05x at H128. Same kernel, only the grid differs, so
# ncu's memory sections of the two launches should show the difference (L2 hit rate, DRAM bytes, Q load timing).
# Build first (CPU): DSAGEN_CACHE_DIR=.dsagen-cache-next dsagen build --from-tests tests/gpu --preset deepseek-v3.2
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" gridh64
B="python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --grid persistent"
TAILN=6 run bench 120 $B --cases 9,2,0 --json $O/bench.json
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
# one launch per grid on the same inputs (H64 / D576, S_q 4096, KV 32768, topk 2048): items first, then persistent
run ncu 200 $NCU -k regex:sparse_attention_fwd -o $O/prof -f python3 -c "
import torch, dsagen, dsagen.fused.sparse_attention as f
g = torch.Generator().manual_seed(0)
q = torch.randn((4096, 64, 576), generator=g).bfloat16().cuda()
kv = torch.randn((32768, 576), generator=g).bfloat16().cuda()
ids = torch.stack([torch.randperm(32768, generator=g)[:2048] for _ in range(4096)]).int().cuda()
for grid in ('items', 'persistent'):
    f.GRID = grid
    dsagen.sparse_attention(q, kv, ids, d_v=512, impl='fused'); torch.cuda.synchronize()"
ncu -i $O/prof.ncu-rep --page details > $O/details.txt 2>&1; rm -f $O/prof.ncu-rep; pack
grep -E "sparse_attention_fwd|Duration|L2 Hit|DRAM Throughput|Memory Throughput|Grid Size" $O/details.txt | head -40
