"""dsagen: generated CuTe-DSL kernels for DeepSeek-style sparse attention.

The public ops are imported lazily: `import dsagen` imports neither CuTe-DSL nor the CUDA driver
bindings. Every op takes `impl="reference"` (plain PyTorch, CPU or CUDA) or `impl="fused"` (generated
kernels on CUDA). See README.md for the table of ops and the source each follows.

Every error dsagen raises on purpose (bad input to the command line, a cache, pack, spec or
environment problem) derives from `dsagen.DsagenError` (defined in dsagen.errors, which imports
nothing) as well as from the builtin a caller would expect (ValueError, LookupError, ...).
"""

from __future__ import annotations

import importlib
import sys as _sys

from ._version import __version__
from .errors import DsagenError
from .log import configure_from_env as _configure_logging

_configure_logging()  # DSAGEN_LOG_LEVEL, read once (dsagen.log)

# The fused ops' torch.library custom ops (torch.ops.dsagen.*, dsagen.ops._registry) are defined here when torch is
# already loaded (about 10 ms; no kernel is loaded), otherwise on the first use of an op: importing dsagen alone
# never imports torch.
if "torch" in _sys.modules:
    from . import ops as _ops  # noqa: F401

# public name -> module that defines it
_OPS = {
    "compactify": "dsagen.ops.indices",
    "local_to_global": "dsagen.ops.indices",
    "lightning_indexer": "dsagen.ops.lightning_indexer",
    "indexer_scores": "dsagen.ops.indexer",
    "indexer_topk": "dsagen.ops.indexer",
    "indexer_forward_topk": "dsagen.ops.indexer",
    "sparse_indexer_score_recompute": "dsagen.ops.indexer_training",
    "dense_indexer_score_recompute": "dsagen.ops.indexer_training",
    "indexer_backward": "dsagen.ops.indexer_training",
    "dense_indexer_backward": "dsagen.ops.indexer_training",
    "dense_indexer_kl_backward": "dsagen.ops.indexer_training",
    "sparse_attention": "dsagen.ops.sparse_attention",
    "sparse_attention_backward": "dsagen.ops.sparse_attention",
    "sparse_attn_score_recompute": "dsagen.ops.sparse_attention",
    "dense_attn_score_recompute": "dsagen.ops.sparse_attention",
    "qsa_indexed_forward": "dsagen.ops.qsa",
    "qsa_bitmap_forward": "dsagen.ops.qsa",
    "native_sparse_attention": "dsagen.ops.nsa",
    "quantize_kv_fp8": "dsagen.ops.kv_cache",
    "dequantize_kv_fp8": "dsagen.ops.kv_cache",
    "sparse_attention_decode": "dsagen.ops.kv_cache",
    "quantize_index_k_fp8": "dsagen.ops.kv_cache",
    "indexer_decode_topk": "dsagen.ops.kv_cache",
}

# public helpers of the ops that are not ops themselves (no impl argument): name -> module that defines it
_HELPERS = {
    "sparse_attention_backward_workspace": "dsagen.ops.sparse_attention",
    "preload": "dsagen.deploy",  # every kernel of a model found (and loaded) before serving
}

__all__ = ["DsagenError", *sorted(_OPS), *sorted(_HELPERS)]


def __getattr__(name: str):
    mod = _OPS.get(name) or _HELPERS.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsagen' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(mod), name)  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_OPS) | set(_HELPERS))
