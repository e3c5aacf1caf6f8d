"""The Hopper (sm_90a) toolkit every kernel family builds from. Imports nothing; each module has one job:

    cta.py        the CTA's coordinates, the mbarrier initialisation, the persistent item loop's convention
    layout.py     SW128 shared layouts, accumulator views, the SW128 swizzle of a byte offset
    ptx.py        single PTX instructions the DSL lacks: L2 cache policy, cp.async / stores with it, bf16 pair
                  pack, 16-byte FP32 atomic adds and streaming stores, release / acquire / nanosleep
    ids.py        a gathered tile's ids: row slots, raw loads, range checks, one-tile-ahead prefetch, keep masks
    gather.py     the gathered-row producer: lanes, cp.async row gathers (zero-filled invalid ids), a ring stage's
                  fill and the consumers' wait, per-row operand loads, the ids hand-over to the consumers
    mma.py        one wgmma product's set-up (tiled MMA, fragments, accumulator views) and its issue over a K loop
    ring.py       the ready / free mbarrier ring: arrival lists, the producer's and the consumers' waits
    tma.py        the TMA tile producer: a tensormap's encode recipe, box loads on a transaction count
    reduce.py     balanced trees, quad and row-group sums, the warp scan
    softmax.py    online-softmax row steps and the merge of (max, sum) statistics
    epilogue.py   16-byte bf16 row stores, 16-byte FP32 atomic adds / streaming stores of row pairs
    grid_sync.py  the bounded grid barrier of persistent kernels

notes/design.md "Writing a new family" walks through them with a worked example.
"""
