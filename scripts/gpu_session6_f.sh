#!/usr/bin/env bash
# Session 6, GPU call 6 (issue 5). Carry .dsagen-cache-s6a and .peer/flashmla.
# The kernel runs at the power cap (nvidia-smi in call 5: SW power cap, 1.3-1.9 GHz at ~690 W), so bytes moved are
# time: what do the L2 cache policies do to the DRAM traffic, and to the time in rotated interleaved rounds?
# 1. the option tests (incl. l2_hint + stream_hint) and their memcheck;
# 2. ncu: DRAM bytes, L2 hit rate, duration and SM clock of one launch each of the default, stream_hint, l2_hint and
#    both, on the headline case;
# 3. the same variants timed against the default (rounds rotate), with FlashMLA.
set -u
. "$(dirname "$0")/gpu_lib.sh"; gpu_setup "$1" s6f
suite pytest 120 tests/gpu/test_sparse_attention.py -k "halves_options or l2_hint"
memcheck memcheck 120 tests/gpu/test_sparse_attention.py -k "halves_options"
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
TAILN=2 run ncu 150 ncu --clock-control none --metrics $M -k regex:sparse_attention_fwd --csv python3 -c "
import sys; sys.path.insert(0, 'bench')
import torch, dsagen, dsagen.fused.sparse_attention as f
from sparse_attention import distinct_ids
g = torch.Generator().manual_seed(0)
q = torch.randn((4096, 128, 576), generator=g).bfloat16().cuda()
kv = torch.randn((32768, 576), generator=g).bfloat16().cuda()
ids = distinct_ids(4096, 2048, 32768, g).cuda(); sink = torch.randn(128, generator=g).cuda()
for opts in ({}, {'stream_hint': True}, {'l2_hint': True}, {'l2_hint': True, 'stream_hint': True}):
    f.OPTIONS = opts
    dsagen.sparse_attention(q, kv, ids, attn_sink=sink, impl='fused'); torch.cuda.synchronize()"
grep -E "dram__bytes|hit_rate|duration|per_second" $O/ncu.log | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | head -24
B="python3 bench/sparse_attention.py --no-torch --reps 10 --schedule split_halves --flashmla .peer/flashmla --cases 0,1,3"
TAILN=4 run sh 120 $B --options stream_hint --json $O/sh.json
TAILN=4 run l2sh 120 $B --options l2_hint,stream_hint --json $O/l2sh.json
