"""Generated-kernel implementations of the public ops (`impl="fused"`).

FUSED maps an op name to "module:function" of its fused implementation. An op without an entry has no
fused kernel yet: `fused_impl` raises NotImplementedError naming the op and the arch, never falling back
to the reference silently.

Ops that run under `torch.compile` (the sparse MLA forward and backward, the autograd backward that calls the
latter, the score recomputes, the indexer backwards, the dense warm-up loss path, the standalone top-k,
indexer_scores and indexer_forward_topk, the NSA forward) may be resolved for the first time while Dynamo traces:
`importlib.import_module` cannot be traced, so their host modules are also listed in `_TRACEABLE_IMPORTS`, whose
loaders are plain `from ... import` statements that Dynamo executes. A `torch.compile(fullgraph=True)` program therefore needs no eager warm-up call to find them.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

FUSED: dict[str, str] = {
    "compactify": "dsagen.kernels.indices.host:compactify",
    "local_to_global": "dsagen.kernels.indices.host:local_to_global",
    "lightning_indexer": "dsagen.kernels.lightning_indexer.host:lightning_indexer",
    "sparse_attention": "dsagen.kernels.sparse_mla.host:sparse_attention",
    "sparse_attention_backward": "dsagen.kernels.sparse_mla_bwd.host:sparse_attention_backward",
    "sparse_attn_score_recompute": "dsagen.kernels.attn_score_recompute.host:sparse_attn_score_recompute",
    "sparse_indexer_score_recompute": "dsagen.kernels.indexer_score_recompute.host:sparse_indexer_score_recompute",
    "indexer_backward": "dsagen.kernels.indexer_bwd.host:indexer_backward",
    "indexer_topk": "dsagen.kernels.indexer_topk.host:indexer_topk",
    "indexer_scores": "dsagen.kernels.lightning_indexer.scores_host:indexer_scores",
    "indexer_forward_topk": "dsagen.kernels.lightning_indexer.forward_topk_host:indexer_forward_topk",
    "dense_indexer_score_recompute": "dsagen.kernels.lightning_indexer.scores_host:dense_indexer_score_recompute",
    "dense_attn_score_recompute": "dsagen.kernels.attn_score_recompute.dense_host:dense_attn_score_recompute",
    "dense_indexer_backward": "dsagen.kernels.indexer_bwd.dense_host:dense_indexer_backward",
    "dense_indexer_kl_backward": "dsagen.kernels.indexer_bwd.kl_host:dense_indexer_kl_backward",
    "native_sparse_attention": "dsagen.kernels.nsa.host:native_sparse_attention",
    "sparse_attention_decode": "dsagen.kernels.sparse_mla.decode_host:sparse_attention_decode",
    "qsa_indexed_forward": "dsagen.kernels.qsa.host:qsa_indexed_forward",
    "qsa_bitmap_forward": "dsagen.kernels.qsa.host:qsa_bitmap_forward",
    "indexer_decode_topk": "dsagen.kernels.lightning_indexer.decode_host:indexer_decode_topk",
    "quantize_kv_fp8": "dsagen.kernels.kv_fp8.host:quantize_kv_fp8",
    "dequantize_kv_fp8": "dsagen.kernels.kv_fp8.host:dequantize_kv_fp8",
    # the scratch size of sparse_attention_backward's workspace (FP32 elements)
    "sparse_attention_backward_workspace_numel": "dsagen.kernels.sparse_mla_bwd.host:workspace_numel",
}


def _nsa_host():
    from ..kernels.nsa import host
    return host


def _qsa_host():
    from ..kernels.qsa import host
    return host


def _sparse_mla_host():
    from ..kernels.sparse_mla import host
    return host


def _sparse_mla_bwd_host():
    from ..kernels.sparse_mla_bwd import host
    return host


def _attn_score_recompute_host():
    from ..kernels.attn_score_recompute import host
    return host


def _indexer_score_recompute_host():
    from ..kernels.indexer_score_recompute import host
    return host


def _indexer_bwd_host():
    from ..kernels.indexer_bwd import host
    return host


def _dense_attn_score_recompute_host():
    from ..kernels.attn_score_recompute import dense_host
    return dense_host


def _dense_indexer_bwd_host():
    from ..kernels.indexer_bwd import dense_host
    return dense_host


def _dense_indexer_kl_host():
    from ..kernels.indexer_bwd import kl_host
    return kl_host


def _indexer_topk_host():
    from ..kernels.indexer_topk import host
    return host


def _indexer_scores_host():
    from ..kernels.lightning_indexer import scores_host
    return scores_host


def _indexer_forward_topk_host():
    from ..kernels.lightning_indexer import forward_topk_host
    return forward_topk_host


def _indexer_decode_host():
    from ..kernels.lightning_indexer import decode_host
    return decode_host


def _kv_fp8_host():
    from ..kernels.kv_fp8 import host
    return host


# host module -> a loader Dynamo can trace (static imports), for the ops reachable from a compiled program
_TRACEABLE_IMPORTS: dict[str, Callable] = {
    "dsagen.kernels.sparse_mla.host": _sparse_mla_host,
    "dsagen.kernels.sparse_mla_bwd.host": _sparse_mla_bwd_host,
    "dsagen.kernels.attn_score_recompute.host": _attn_score_recompute_host,
    "dsagen.kernels.indexer_score_recompute.host": _indexer_score_recompute_host,
    "dsagen.kernels.indexer_bwd.host": _indexer_bwd_host,
    "dsagen.kernels.attn_score_recompute.dense_host": _dense_attn_score_recompute_host,
    "dsagen.kernels.indexer_bwd.dense_host": _dense_indexer_bwd_host,
    "dsagen.kernels.indexer_bwd.kl_host": _dense_indexer_kl_host,
    "dsagen.kernels.indexer_topk.host": _indexer_topk_host,
    "dsagen.kernels.lightning_indexer.scores_host": _indexer_scores_host,
    "dsagen.kernels.lightning_indexer.forward_topk_host": _indexer_forward_topk_host,
    "dsagen.kernels.lightning_indexer.decode_host": _indexer_decode_host,
    "dsagen.kernels.kv_fp8.host": _kv_fp8_host,
    "dsagen.kernels.nsa.host": _nsa_host,
    "dsagen.kernels.qsa.host": _qsa_host,
}


def fused_impl(op: str, device: torch.device) -> Callable:
    """The fused implementation of `op` for tensors on `device`.

    Raises NotImplementedError when no generated kernel exists for the op, ValueError when `device`
    is not a CUDA device.
    """
    if device.type != "cuda":
        raise ValueError(f"{op}: impl='fused' runs generated CUDA kernels; inputs are on {device}. "
                         f"Use impl='reference' on the CPU.")
    fn = _resolved.get(op)
    if fn is not None:
        return fn
    target = FUSED.get(op)
    if target is None:
        from ..runtime.device import device_arch

        raise NotImplementedError(f"{op}: no fused kernel exists yet for {device_arch(device)}; "
                                  f"use impl='reference'")
    mod, name = target.split(":")
    if torch.compiler.is_compiling():
        loader = _TRACEABLE_IMPORTS.get(mod)
        if loader is None:
            raise NotImplementedError(f"{op}: its fused implementation cannot be loaded while torch.compile "
                                      f"traces; call the op once eagerly first")
        module = loader()
    else:
        module = importlib.import_module(mod)
    fn = _resolved[op] = getattr(module, name)
    return fn


_resolved: dict[str, Callable] = {}
