"""The fused public ops as `torch.library` custom ops, registered when this module is imported.

Every op in OPS is defined twice in the `dsagen` namespace:

* `torch.ops.dsagen.<name>`: functional; its real implementation is the public op with impl="fused" (the
  kernel loads on the first real call, never at registration), its fake implementation gives the output
  shapes and dtypes, so `torch.compile` and `torch.export` trace it on meta or fake tensors without a GPU.
* `torch.ops.dsagen.<name>_out`: the same arguments followed by one caller-owned tensor per output
  (`out_<output>`, mutated, returns nothing), for CUDA-graph capture with preallocated outputs.

A custom op cannot return None: an output the public op returns as None (lse_indexer without indexer_topk,
d_sink without attn_sink, indexer_topk's values without return_values, indexer_scores' lse without
return_lse, indexer_forward_topk's softmax / lse without return_softmax / return_lse) is an empty `(0,)` tensor here, and its `out_` tensor is an empty `(0,)` tensor too.

Registering imports nothing but torch and dsagen.reference's dtype rule; the public ops' modules are imported
inside the real implementations.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import torch

NAMESPACE = "dsagen"
_ALIASES = "abcdefgh"


class OpDef(NamedTuple):
    """One fused public op: `args` is the schema's argument list, `outputs` names the returned tensors,
    `run(*args)` returns them as a tuple (real tensors), `fake(*args)` the same on fake tensors, `run_out`
    (optional) writes them into the out tensors itself (otherwise they are copied from `run`)."""

    name: str
    args: str
    outputs: tuple[str, ...]
    run: Callable
    fake: Callable
    run_out: Callable | None = None


def _public(module: str, name: str) -> Callable:
    """The public op `name` of dsagen.ops.<module>, imported on first use."""
    return getattr(importlib.import_module(f"dsagen.ops.{module}"), name)


def _none_as_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`t`, or an empty `(0,)` FP32 tensor on like's device where the public op returned None."""
    return _empty(like) if t is None else t


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """FP64 when any input is FP64, else FP32 (the ops' statistics and scores dtype)."""
    from ..reference.indexer import accumulate_dtype

    return accumulate_dtype(*tensors)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """An empty `(0,)` FP32 tensor on like's device: an output the public op returns as None."""
    return like.new_empty((0,), dtype=torch.float32)


# --- compactify / local_to_global -----------------------------------------------------------------------------

def _compactify_run(topk_idxs, topk_length):
    return tuple(_public("indices", "compactify")(topk_idxs, topk_length, impl="fused"))


def _compactify_fake(topk_idxs, topk_length):
    """(compact_idxs int32 `(rows, K)`, lengths int32 `(rows,)`), rows = numel // K of `(rows, K)` / `(B, S_q, K)`."""
    k = topk_idxs.shape[-1]
    rows = topk_idxs.shape[0] if topk_idxs.dim() == 2 else topk_idxs.shape[0] * topk_idxs.shape[1]
    return (topk_idxs.new_empty((rows, k), dtype=torch.int32), topk_idxs.new_empty((rows,), dtype=torch.int32))


def _local_to_global_run(topk_idxs, seqlen_k):
    return (_public("indices", "local_to_global")(topk_idxs, seqlen_k, impl="fused"),)


def _local_to_global_fake(topk_idxs, seqlen_k):
    """int32 `(B, S_q, K)`, contiguous."""
    return (topk_idxs.new_empty(topk_idxs.shape, dtype=torch.int32),)


# --- indexer ----------------------------------------------------------------------------------------------------

def _lightning_indexer_run(q, k, weights, topk, causal, compress_ratio, cu_seqlens, cu_seqlens_k, check_offsets):
    return (_public("lightning_indexer", "lightning_indexer")(
        q, k, weights, topk, causal=causal, compress_ratio=compress_ratio, cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k, check_offsets=check_offsets, impl="fused"),)


def _lightning_indexer_fake(q, k, weights, topk, causal, compress_ratio, cu_seqlens, cu_seqlens_k, check_offsets):
    """int32 `[B, T, topk]` from q `[B, T, H, D]`."""
    return (q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32),)


def _indexer_scores_kwargs(ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, precision, q_scale,
                           k_scale) -> dict:
    return dict(ratio=ratio, q_causal_offsets=q_causal_offsets, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                precision=precision, q_scale=q_scale, k_scale=k_scale)


def _indexer_scores_run(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                        return_lse, precision, q_scale, k_scale):
    res = _public("indexer", "indexer_scores")(
        q_indexer, k_indexer, weights, return_lse=return_lse, impl="fused",
        **_indexer_scores_kwargs(ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, precision, q_scale, k_scale))
    return tuple(res) if return_lse else (res, _empty(q_indexer))


def _indexer_scores_run_out(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                            return_lse, precision, q_scale, k_scale, out_scores, out_lse):
    """The kernel writes straight into the caller's tensors (indexer_scores' own out= / lse_out=)."""
    _public("indexer", "indexer_scores")(
        q_indexer, k_indexer, weights, return_lse=return_lse, out=out_scores,
        lse_out=out_lse if return_lse else None, impl="fused",
        **_indexer_scores_kwargs(ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k, precision, q_scale, k_scale))


def _indexer_scores_fake(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                         return_lse, precision, q_scale, k_scale):
    """BSHD: scores `[B, S_q, S_k]`, lse `[B, S_q]`; THD: `[total_q, max_seqlen_k]` (a data-dependent width),
    `[total_q]`. FP32 (FP64 for FP64 inputs); lse is `(0,)` without return_lse."""
    acc = torch.float32 if precision == "fp8" else _acc_dtype(q_indexer, k_indexer, weights)
    if cu_seqlens_q is not None:
        rows = (q_indexer.shape[0],)
        shape = rows + (torch.library.get_ctx().new_dynamic_size(),)
    else:
        rows = tuple(q_indexer.shape[:2])
        shape = rows + (k_indexer.shape[1],)
    lse = q_indexer.new_empty(rows, dtype=acc) if return_lse else _empty(q_indexer)
    return q_indexer.new_empty(shape, dtype=acc), lse


def _dense_indexer_score_recompute_run(q_indexer, k_indexer, weights, ratio, q_causal_offsets, sm_scale, cu_seqlens_q,
                                       cu_seqlens_k):
    return tuple(_public("indexer_training", "dense_indexer_score_recompute")(
        q_indexer, k_indexer, weights, ratio=ratio, q_causal_offsets=q_causal_offsets, sm_scale=sm_scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, impl="fused"))


def _dense_indexer_score_recompute_fake(q_indexer, k_indexer, weights, ratio, q_causal_offsets, sm_scale,
                                        cu_seqlens_q, cu_seqlens_k):
    """out and denom: indexer_scores' scores and lse (always returned)."""
    return _indexer_scores_fake(q_indexer, k_indexer, weights, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                                True, "default", None, None)


def _dense_indexer_backward_run(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                grad_loss, sm_scale, loss_coeff, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                                deterministic):
    return tuple(_public("indexer_training", "dense_indexer_backward")(
        index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss=grad_loss,
        sm_scale=sm_scale, loss_coeff=loss_coeff, ratio=ratio, q_causal_offsets=q_causal_offsets,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic, impl="fused"))


def _dense_indexer_backward_fake(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                 grad_loss, sm_scale, loss_coeff, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k,
                                 deterministic):
    """(d_index_q, d_weights, d_index_k), each shaped and typed as the tensor it is the gradient of."""
    return torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)


def _dense_indexer_kl_backward_run(q, k, lse, index_q, weights, index_k, softmax_scale, sm_scale, loss_coeff,
                                   grad_loss, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    return tuple(_public("indexer_training", "dense_indexer_kl_backward")(
        q, k, lse, index_q, weights, index_k, softmax_scale=softmax_scale, sm_scale=sm_scale, loss_coeff=loss_coeff,
        grad_loss=grad_loss, ratio=ratio, q_causal_offsets=q_causal_offsets, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, impl="fused"))


def _dense_indexer_kl_backward_fake(q, k, lse, index_q, weights, index_k, softmax_scale, sm_scale, loss_coeff,
                                    grad_loss, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    """loss 0-d FP32 (FP64 for FP64 inputs), then the gradients shaped and typed as index_q, weights, index_k."""
    loss = q.new_empty((), dtype=_acc_dtype(q, lse, index_q, weights, index_k))
    return loss, torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)


def _indexer_forward_topk_run(q_indexer, k_indexer, weights, top_k, ratio, q_causal_offsets, return_softmax,
                              return_lse, topk_indices_global, cu_seqlens_q, cu_seqlens_k, deterministic, precision,
                              q_scale, k_scale):
    res = _public("indexer", "indexer_forward_topk")(
        q_indexer, k_indexer, weights, top_k, ratio=ratio, q_causal_offsets=q_causal_offsets,
        return_softmax=return_softmax, return_lse=return_lse, topk_indices_global=topk_indices_global,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic, impl="fused",
        precision=precision, q_scale=q_scale, k_scale=k_scale)
    return (res.indices, res.logits, _none_as_empty(res.softmax, q_indexer), _none_as_empty(res.lse, q_indexer))


def _indexer_forward_topk_fake(q_indexer, k_indexer, weights, top_k, ratio, q_causal_offsets, return_softmax,
                               return_lse, topk_indices_global, cu_seqlens_q, cu_seqlens_k, deterministic, precision,
                               q_scale, k_scale):
    """indices int32 and logits / softmax `[B, S_q, top_k]` (THD `[total_q, top_k]`), lse `[B, S_q]` (THD
    `[total_q]`); FP32 (FP64 for FP64 inputs); softmax / lse `(0,)` when not asked for."""
    acc = torch.float32 if precision == "fp8" else _acc_dtype(q_indexer, k_indexer, weights)
    rows = (q_indexer.shape[0],) if cu_seqlens_q is not None else tuple(q_indexer.shape[:2])
    slots = rows + (top_k,)
    return (q_indexer.new_empty(slots, dtype=torch.int32), q_indexer.new_empty(slots, dtype=acc),
            q_indexer.new_empty(slots, dtype=acc) if return_softmax else _empty(q_indexer),
            q_indexer.new_empty(rows, dtype=acc) if return_lse else _empty(q_indexer))


def _indexer_topk_run(input_values, seq_lens, top_k, return_values, next_n):
    res = _public("indexer", "indexer_topk")(input_values, seq_lens, top_k, return_values=return_values,
                                             next_n=next_n, impl="fused")
    return res.indices, _none_as_empty(res.values, input_values)


def _indexer_topk_fake(input_values, seq_lens, top_k, return_values, next_n):
    """indices int32 `[n_rows, top_k]`, values `[n_rows, top_k]` in the input dtype (`(0,)` without return_values)."""
    shape = (input_values.shape[0], top_k)
    values = input_values.new_empty(shape) if return_values else _empty(input_values)
    return input_values.new_empty(shape, dtype=torch.int32), values


def _sparse_indexer_score_recompute_run(q_indexer, k_indexer, weights, topk_indices, topk_length,
                                        topk_indices_global, sm_scale):
    return (_public("indexer_training", "sparse_indexer_score_recompute")(
        q_indexer, k_indexer, weights, topk_indices, topk_length=topk_length,
        topk_indices_global=topk_indices_global, sm_scale=sm_scale, impl="fused"),)


def _sparse_indexer_score_recompute_fake(q_indexer, k_indexer, weights, topk_indices, topk_length,
                                         topk_indices_global, sm_scale):
    """predict `[B, S_q, topk]` FP32 (FP64 for FP64 inputs)."""
    return (q_indexer.new_empty(topk_indices.shape, dtype=_acc_dtype(q_indexer, k_indexer, weights)),)


def _indexer_backward_run(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale,
                          loss_coeff, topk_indices_global, deterministic):
    return tuple(_public("indexer_training", "indexer_backward")(
        index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss=grad_loss, sm_scale=sm_scale,
        loss_coeff=loss_coeff, topk_indices_global=topk_indices_global, deterministic=deterministic, impl="fused"))


def _indexer_backward_fake(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale,
                           loss_coeff, topk_indices_global, deterministic):
    """(d_index_q, d_weights, d_index_k), each shaped and typed as the tensor it is the gradient of."""
    return torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)


# --- sparse attention -------------------------------------------------------------------------------------------

def _d_v(q: torch.Tensor, d_v: int | None) -> int:
    from ..reference.sparse_attention import default_d_v

    return default_d_v(q.shape[-1]) if d_v is None else d_v


def _sparse_attention_run(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, indexer_topk):
    res = _public("sparse_attention", "sparse_attention")(
        q, kv, topk_idxs, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale, d_v=d_v,
        indexer_topk=indexer_topk, impl="fused")
    lse_indexer = res[3] if len(res) == 4 else None
    return res[0], res[1], res[2], _none_as_empty(lse_indexer, q)


def _sparse_attention_fake(q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, d_v, indexer_topk):
    """out `(..., H, d_v)` in q.dtype; lse, max_logits, lse_indexer `(..., H)` FP32 (FP64 for FP64 q);
    lse_indexer is `(0,)` unless indexer_topk > 0. `...` is `(S_q,)` (3-D q) or `(B, T)` (4-D q)."""
    stats = tuple(q.shape[:-1])
    acc = _acc_dtype(q)
    out = q.new_empty(stats + (_d_v(q, d_v),))
    lse_indexer = q.new_empty(stats, dtype=acc) if indexer_topk else _empty(q)
    return out, q.new_empty(stats, dtype=acc), q.new_empty(stats, dtype=acc), lse_indexer


def _sparse_attention_backward_run(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale, d_v,
                                   deterministic):
    dq, dkv, d_sink = _public("sparse_attention", "sparse_attention_backward")(
        q, kv, out, dout, lse, topk_idxs, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale,
        d_v=d_v, deterministic=deterministic, impl="fused")
    return dq, dkv, _none_as_empty(d_sink, q)


def _sparse_attention_backward_fake(q, kv, out, dout, lse, topk_idxs, attn_sink, topk_length, softmax_scale, d_v,
                                    deterministic):
    """dq like q, dkv like kv, d_sink like attn_sink (`(0,)` FP32 without one)."""
    d_sink = _empty(q) if attn_sink is None else torch.empty_like(attn_sink)
    return torch.empty_like(q), torch.empty_like(kv), d_sink


def _sparse_attn_score_recompute_run(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length,
                                     topk_indices_global):
    return (_public("sparse_attention", "sparse_attn_score_recompute")(
        q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length=topk_length,
        topk_indices_global=topk_indices_global, impl="fused"),)


def _sparse_attn_score_recompute_fake(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length,
                                      topk_indices_global):
    """target `(B, S_q, topk)` FP32 (FP64 for FP64 inputs)."""
    return (q_attn.new_empty(topk_indices.shape, dtype=_acc_dtype(q_attn, lse)),)


def _dense_attn_score_recompute_run(q, k, lse, softmax_scale, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    return tuple(_public("sparse_attention", "dense_attn_score_recompute")(
        q, k, lse, softmax_scale, ratio=ratio, q_causal_offsets=q_causal_offsets, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, impl="fused"))


def _dense_attn_score_recompute_fake(q, k, lse, softmax_scale, ratio, q_causal_offsets, cu_seqlens_q, cu_seqlens_k):
    """out `(B, S_q, S_k)` and denom `(B, S_q)` (THD: `(total_q, max_seqlen_k)`, a data-dependent width, and
    `(total_q,)`), FP32 (FP64 for FP64 inputs)."""
    acc = _acc_dtype(q, lse)
    if cu_seqlens_q is not None:
        rows = (q.shape[0],)
        shape = rows + (torch.library.get_ctx().new_dynamic_size(),)
    else:
        rows = tuple(q.shape[:2])
        shape = rows + (k.shape[1],)
    return q.new_empty(shape, dtype=acc), q.new_empty(rows, dtype=acc)


# --- native sparse attention ------------------------------------------------------------------------------------

def _nsa_run(query, key, value, g_cmp, g_slc, block_indices, block_counts, block_counts_per_token, cu_seqlens,
             softmax_scale, block_size):
    counts = block_counts if block_counts_per_token is None else block_counts_per_token
    return (_public("nsa", "native_sparse_attention")(
        query, key, value, g_cmp, g_slc, block_indices, counts, cu_seqlens, softmax_scale=softmax_scale,
        block_size=block_size, impl="fused"),)


def _nsa_fake(query, key, value, g_cmp, g_slc, block_indices, block_counts, block_counts_per_token, cu_seqlens,
              softmax_scale, block_size):
    """`[B, T, HQ, Dv]` in query's dtype. The public op's int-or-tensor block_counts is two arguments here: the
    int block_counts, and block_counts_per_token (a tensor, which wins when given)."""
    return (query.new_empty((*query.shape[:3], value.shape[3])),)


def _qsa_indexed_run(q, k, v, indices, scale):
    return tuple(_public("qsa", "qsa_indexed_forward")(q, k, v, indices, scale, impl="fused"))


def _qsa_indexed_fake(q, k, v, indices, scale):
    """out `[T, Hq, Dv]` in q's dtype, out_fp32 `[T, Hq, Dv]` (FP64 for FP64 q), lse `[Hq, T]` FP32 (FP64)."""
    t, hq = q.shape[:2]
    acc = _acc_dtype(q)
    return (q.new_empty((t, hq, v.shape[2])), q.new_empty((t, hq, v.shape[2]), dtype=acc),
            q.new_empty((hq, t), dtype=acc))


def _qsa_bitmap_run(q, k, v, block_bitmap, scale, cu_seqlens):
    return tuple(_public("qsa", "qsa_bitmap_forward")(q, k, v, block_bitmap, scale, cu_seqlens=cu_seqlens,
                                                      impl="fused"))


def _qsa_bitmap_fake(q, k, v, block_bitmap, scale, cu_seqlens):
    """As qsa_indexed_forward's."""
    return _qsa_indexed_fake(q, k, v, block_bitmap, scale)


def _quantize_kv_run(kv):
    return (_public("kv_cache", "quantize_kv_fp8")(kv, impl="fused"),)


def _quantize_kv_fake(kv):
    """uint8 `[..., 656]`."""
    return (kv.new_empty((*kv.shape[:-1], 656), dtype=torch.uint8),)


def _dequantize_kv_run(cache):
    return (_public("kv_cache", "dequantize_kv_fp8")(cache, impl="fused"),)


def _dequantize_kv_fake(cache):
    """bfloat16 `[..., 576]`."""
    return (cache.new_empty((*cache.shape[:-1], 576), dtype=torch.bfloat16),)


def _indexer_decode_run(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k):
    return (_public("kv_cache", "indexer_decode_topk")(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k,
                                                       impl="fused"),)


def _indexer_decode_fake(q_indexer, weights, k_cache, block_table, cache_seqlens, top_k):
    """int32 `[B, next_n, top_k]`."""
    return (q_indexer.new_empty((*q_indexer.shape[:2], top_k), dtype=torch.int32),)


def _decode_run(q, kv_cache, indices, attn_sink, topk_length, softmax_scale, d_v):
    return tuple(_public("kv_cache", "sparse_attention_decode")(
        q, kv_cache, indices, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale, d_v=d_v,
        impl="fused"))


def _decode_fake(q, kv_cache, indices, attn_sink, topk_length, softmax_scale, d_v):
    """out `[B, s_q, H, d_v]` in q's dtype, lse `[B, s_q, H]` FP32."""
    return q.new_empty((*q.shape[:3], d_v)), q.new_empty(q.shape[:3], dtype=torch.float32)


OPS: tuple[OpDef, ...] = (
    OpDef("compactify", "Tensor topk_idxs, Tensor? topk_length=None", ("compact_idxs", "lengths"),
          _compactify_run, _compactify_fake),
    OpDef("local_to_global", "Tensor topk_idxs, int seqlen_k", ("global_idxs",),
          _local_to_global_run, _local_to_global_fake),
    OpDef("lightning_indexer", "Tensor q, Tensor k, Tensor weights, int topk, bool causal=False, "
          "int compress_ratio=1, Tensor? cu_seqlens=None, Tensor? cu_seqlens_k=None, bool? check_offsets=None",
          ("indices",), _lightning_indexer_run, _lightning_indexer_fake),
    OpDef("indexer_scores", "Tensor q_indexer, Tensor k_indexer, Tensor weights, int ratio=1, "
          "Tensor? q_causal_offsets=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, bool return_lse=False, "
          "str precision=\"default\", Tensor? q_scale=None, Tensor? k_scale=None",
          ("scores", "lse"), _indexer_scores_run, _indexer_scores_fake, _indexer_scores_run_out),
    OpDef("dense_indexer_score_recompute", "Tensor q_indexer, Tensor k_indexer, Tensor weights, int ratio=1, "
          "Tensor? q_causal_offsets=None, float sm_scale=1.0, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None",
          ("out", "denom"), _dense_indexer_score_recompute_run, _dense_indexer_score_recompute_fake),
    OpDef("dense_indexer_backward", "Tensor index_q, Tensor weights, Tensor index_k, Tensor attn_score, "
          "Tensor attn_l1norm, Tensor index_score, Tensor index_lse, Tensor? grad_loss=None, float sm_scale=1.0, "
          "float loss_coeff=1.0, int ratio=1, Tensor? q_causal_offsets=None, Tensor? cu_seqlens_q=None, "
          "Tensor? cu_seqlens_k=None, bool deterministic=False",
          ("d_index_q", "d_weights", "d_index_k"), _dense_indexer_backward_run, _dense_indexer_backward_fake),
    OpDef("dense_indexer_kl_backward", "Tensor q, Tensor k, Tensor lse, Tensor index_q, Tensor weights, "
          "Tensor index_k, float? softmax_scale=None, float sm_scale=1.0, float loss_coeff=1.0, "
          "Tensor? grad_loss=None, int ratio=1, Tensor? q_causal_offsets=None, Tensor? cu_seqlens_q=None, "
          "Tensor? cu_seqlens_k=None",
          ("loss", "d_index_q", "d_weights", "d_index_k"), _dense_indexer_kl_backward_run,
          _dense_indexer_kl_backward_fake),
    OpDef("indexer_forward_topk", "Tensor q_indexer, Tensor k_indexer, Tensor weights, int top_k, int ratio=1, "
          "Tensor? q_causal_offsets=None, bool return_softmax=True, bool return_lse=False, "
          "bool topk_indices_global=True, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
          "bool deterministic=False, str precision=\"default\", Tensor? q_scale=None, Tensor? k_scale=None",
          ("indices", "logits", "softmax", "lse"), _indexer_forward_topk_run, _indexer_forward_topk_fake),
    OpDef("indexer_topk", "Tensor input_values, Tensor seq_lens, int top_k, bool return_values=True, int next_n=1",
          ("indices", "values"), _indexer_topk_run, _indexer_topk_fake),
    OpDef("sparse_indexer_score_recompute", "Tensor q_indexer, Tensor k_indexer, Tensor weights, "
          "Tensor topk_indices, Tensor? topk_length=None, bool topk_indices_global=False, float sm_scale=1.0",
          ("predict",), _sparse_indexer_score_recompute_run, _sparse_indexer_score_recompute_fake),
    OpDef("indexer_backward", "Tensor index_q, Tensor weights, Tensor index_k, Tensor attn_score, "
          "Tensor index_score, Tensor topk_indices, Tensor? grad_loss=None, float sm_scale=1.0, float loss_coeff=1.0, "
          "bool topk_indices_global=False, bool deterministic=False",
          ("d_index_q", "d_weights", "d_index_k"), _indexer_backward_run, _indexer_backward_fake),
    OpDef("sparse_attention", "Tensor q, Tensor kv, Tensor topk_idxs, Tensor? attn_sink=None, "
          "Tensor? topk_length=None, float? softmax_scale=None, int? d_v=None, int? indexer_topk=None",
          ("out", "lse", "max_logits", "lse_indexer"), _sparse_attention_run, _sparse_attention_fake),
    OpDef("sparse_attention_backward", "Tensor q, Tensor kv, Tensor out, Tensor dout, Tensor lse, "
          "Tensor topk_idxs, Tensor? attn_sink=None, Tensor? topk_length=None, float? softmax_scale=None, "
          "int? d_v=None, bool deterministic=False",
          ("dq", "dkv", "d_sink"), _sparse_attention_backward_run, _sparse_attention_backward_fake),
    OpDef("sparse_attn_score_recompute", "Tensor q_attn, Tensor k_attn, Tensor lse, Tensor topk_indices, "
          "float? softmax_scale=None, Tensor? topk_length=None, bool topk_indices_global=False",
          ("target",), _sparse_attn_score_recompute_run, _sparse_attn_score_recompute_fake),
    OpDef("dense_attn_score_recompute", "Tensor q, Tensor k, Tensor lse, float? softmax_scale=None, int ratio=1, "
          "Tensor? q_causal_offsets=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None",
          ("out", "denom"), _dense_attn_score_recompute_run, _dense_attn_score_recompute_fake),
    OpDef("native_sparse_attention", "Tensor query, Tensor key, Tensor value, Tensor? g_cmp=None, "
          "Tensor? g_slc=None, Tensor? block_indices=None, int block_counts=16, Tensor? block_counts_per_token=None, "
          "Tensor? cu_seqlens=None, float? softmax_scale=None, int block_size=64",
          ("out",), _nsa_run, _nsa_fake),
    OpDef("sparse_attention_decode", "Tensor q, Tensor kv_cache, Tensor indices, Tensor? attn_sink=None, "
          "Tensor? topk_length=None, float? softmax_scale=None, int d_v=512",
          ("out", "lse"), _decode_run, _decode_fake),
    OpDef("qsa_indexed_forward", "Tensor q, Tensor k, Tensor v, Tensor indices, float? scale=None",
          ("out", "out_fp32", "lse"), _qsa_indexed_run, _qsa_indexed_fake),
    OpDef("quantize_kv_fp8", "Tensor kv", ("cache",), _quantize_kv_run, _quantize_kv_fake),
    OpDef("dequantize_kv_fp8", "Tensor cache", ("kv",), _dequantize_kv_run, _dequantize_kv_fake),
    OpDef("indexer_decode_topk", "Tensor q_indexer, Tensor weights, Tensor k_cache, Tensor block_table, "
          "Tensor cache_seqlens, int top_k", ("indices",), _indexer_decode_run, _indexer_decode_fake),
    OpDef("qsa_bitmap_forward", "Tensor q, Tensor k, Tensor v, Tensor block_bitmap, float? scale=None, "
          "Tensor? cu_seqlens=None", ("out", "out_fp32", "lse"), _qsa_bitmap_run, _qsa_bitmap_fake),
)


def _returns(op: OpDef) -> str:
    return "Tensor" if len(op.outputs) == 1 else "(" + ", ".join("Tensor" for _ in op.outputs) + ")"


def schema(op: OpDef) -> str:
    """The functional schema, e.g. `compactify(Tensor topk_idxs, Tensor? topk_length=None) -> (Tensor, Tensor)`."""
    return f"{op.name}({op.args}) -> {_returns(op)}"


def out_schema(op: OpDef) -> str:
    """The out variant's schema: the functional arguments, then one keyword-only, mutated `out_<output>` per output."""
    outs = ", ".join(f"Tensor({_ALIASES[i]}!) out_{o}" for i, o in enumerate(op.outputs))
    return f"{op.name}_out({op.args}, *, {outs}) -> ()"


def _positional(name: str, args: tuple, kwargs: dict) -> list:
    """The op's positional (non keyword-only) arguments in schema order, defaults filled in: the dispatcher
    passes only what the caller gave, and an argument given by name arrives in kwargs."""
    schema_args = getattr(getattr(torch.ops, NAMESPACE), name).default._schema.arguments
    params = [a for a in schema_args if not a.kwarg_only]
    rest = params[len(args):]
    return list(args) + [kwargs[a.name] if a.name in kwargs else a.default_value for a in rest]


def _functional(op: OpDef, fn: Callable) -> Callable:
    """`fn` (op.run or op.fake) as the functional op's kernel: one tensor, or a tuple for several outputs."""
    def kernel(*args, **kwargs):
        res = fn(*_positional(op.name, args, kwargs))
        return res[0] if len(op.outputs) == 1 else tuple(res)
    return kernel


def _out_impl(op: OpDef) -> Callable:
    """Writes the op's results into the caller's out tensors (copied, unless the op has its own run_out)."""
    def kernel(*args, **kwargs):
        dsts = [kwargs[f"out_{o}"] for o in op.outputs]
        full = _positional(f"{op.name}_out", args, kwargs)
        if op.run_out is not None:
            op.run_out(*full, *dsts)
            return
        for dst, src in zip(dsts, op.run(*full)):
            dst.copy_(src)
    return kernel


def _out_fake(*args, **outs) -> None:
    return None


def _register(lib: torch.library.Library, op: OpDef) -> None:
    """Defines `dsagen::<name>` and `dsagen::<name>_out` with their real and fake implementations."""
    for name, sch, impl, fake in ((op.name, schema(op), _functional(op, op.run), _functional(op, op.fake)),
                                  (f"{op.name}_out", out_schema(op), _out_impl(op), _out_fake)):
        lib.define(sch)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)


def _register_all() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for op in OPS:
        _register(lib, op)
    return lib


_LIB = _register_all()     # held for the life of the process: dropping it would deregister the ops
