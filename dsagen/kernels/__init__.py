"""The kernel families, one folder each: its spec (`spec.py`: the frozen spec, its config and `config_for`),
its kernels (jinja2 CuTe-DSL modules `*_<arch family>.py.j2` and hand-written device helpers) and its host
launch code (`host.py`). `_kernel_module.py.j2` is the base every kernel module extends.

    common/sm90/        the Hopper toolkit every sm_90a family builds from (layouts, gathers, rings, TMA, ids,
                        reductions, softmax steps, epilogue stores, the grid barrier)
    indices/            compactify, local_to_global
    lightning_indexer/  the indexer score kernel and its top-k plan
    sparse_mla/         the sparse MLA attention forward (and its lse_prefix variant)
    sparse_mla_bwd/     the sparse MLA attention backward (dq, dkv, delta)
    attn_score_recompute/  the sparse attention score recompute (the indexer's training target)
    indexer_score_recompute/  the sparse indexer score recompute (the indexer's distribution over its top-k)
    indexer_bwd/        the sparse indexer backward (d_index_q, d_weights, d_index_k of the indexer KL loss)
    indexer_topk/       the standalone indexer top-k (the lightning indexer's radix top-k over matrix rows)
    nsa/                native sparse attention: the selected branch's forward
    testing/            runtime probe kernels (the runtime's own GPU tests)

Importing this package imports nothing: dsagen.spec imports each family's `spec` module (registering its
specs); host code is imported by the public ops when a fused kernel runs. A rendered kernel imports its
device helpers as `dsagen.kernels.<family>.<module>`, and their source hashes are part of its cache key.
"""
