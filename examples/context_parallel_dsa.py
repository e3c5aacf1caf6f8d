"""Context-parallel DeepSeek sparse attention (DSA) layer over torch.distributed ranks.

The sequence of T tokens is cut into 2W chunks of C = T / (2W) tokens for a world of W ranks. Rank r owns
chunks r and 2W-1-r (a head chunk and a tail chunk), for its query rows and for its KV / indexer-key rows:
under the causal mask a head chunk sees few keys and a tail chunk many, so every rank does the same work.

One layer step on rank r:

1. all-gather the indexer keys and the KV latent of every rank (`all_gather_single`, formerly
   `all_gather_into_tensor`) and put the chunks back in sequence order, so each rank holds the full
   [B, T, D] keys its queries may see; the KV latent's gather is started first and waited for only after the
   indexer's top-k of both query chunks (step 2), so its transfer runs under the indexer's kernels;
2. for each of its two query chunks, starting at global token `start`: the indexer's top-k with the causal mask
   placed at `start` (`dsagen.indexer_forward_topk(..., q_causal_offsets=start, topk_indices_global=False)`: row t
   selects among the first `start + t + 1` keys, without materializing the chunk's [C, T] scores); the ids are
   global token positions;
3. sparse attention of the chunk's queries over the gathered KV with those ids (`dsagen.sparse_attention`,
   batched layout: ids are rows of the full kv);
4. backward by autograd: dq stays local, the gradient of the gathered KV is reduce-scattered back to the
   ranks that own the rows (`reduce_scatter_single` / `reduce_scatter_tensor`, which gloo has in torch 2.13;
   where a backend raises on it, an `all_reduce` and a slice), and the sink's gradient, a sum over all query
   rows, is all-reduced;
5. optionally the indexer's training ops (DeepSeek-V3.2's KL loss between the attention's and the indexer's
   distributions over the selected slots) per query chunk: `dsagen.sparse_attn_score_recompute` (the target, from
   the attention's lse), `dsagen.sparse_indexer_score_recompute` (the prediction) and `dsagen.indexer_backward`
   with each row weighted 1 / (B T), so that the ranks' gradients add up to one call's over the whole sequence;
   d_index_q and d_weights stay local, d_index_k (every query's term for every key) is reduce-scattered to the
   key rows' owners like dkv.

`dsagen.lightning_indexer` takes no offset for query rows that start inside the sequence (its causal mask
places query 0 at token 0), hence `indexer_forward_topk`, the same scores (up to the positive factor
1 / sqrt(H * D), which does not change the selection) with the mask at the chunk's global position.

impl is "fused" on CUDA (NCCL; bf16, D_qk 576, d_v 512) and "reference" on CPU (gloo; plain PyTorch).

Launch on 2-4 GPUs (or CPU processes with gloo)::

    torchrun --nproc-per-node 2 examples/context_parallel_dsa.py --T 32768
    torchrun --nproc-per-node 2 examples/context_parallel_dsa.py --T 256 --heads 16 --d-qk 72 --d-v 64 \\
        --index-heads 8 --index-dim 32 --topk 64          # CPU, small shapes

T must be a multiple of 2 * world size.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

import dsagen
from dsagen.ops.indexer_training import IndexerGrads


@dataclass
class Shard:
    """A rank's rows of the sequence, in local order (head chunk, then tail chunk).

    q:         [B, 2C, H, D_qk] attention queries
    kv:        [B, 2C, D_qk]    KV latent (K = all columns, V = the first d_v)
    q_index:   [B, 2C, H_i, D_i] indexer queries
    k_index:   [B, 2C, D_i]     indexer keys
    w_index:   [B, 2C, H_i]     indexer head weights
    """

    q: torch.Tensor
    kv: torch.Tensor
    q_index: torch.Tensor
    k_index: torch.Tensor
    w_index: torch.Tensor


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def chunk_ids(rank: int, world_size: int) -> tuple[int, int]:
    """The two sequence chunks (of 2 * world_size) that `rank` owns: r and 2W-1-r."""
    return rank, 2 * world_size - 1 - rank


def shard_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's rows of a full-sequence tensor [B, T, ...] -> [B, 2C, ...] (head chunk, then tail chunk)."""
    chunks = x.chunk(2 * world_size, dim=1)
    head, tail = chunk_ids(rank, world_size)
    return torch.cat([chunks[head], chunks[tail]], dim=1)


def unshard_order(world_size: int, device: torch.device) -> torch.Tensor:
    """perm [2W] with gathered_chunks[perm[c]] = sequence chunk c, where gathered chunk 2r + j is rank r's j-th."""
    perm = []
    for c in range(2 * world_size):
        perm.append(2 * c if c < world_size else 2 * (2 * world_size - 1 - c) + 1)
    return torch.tensor(perm, device=device)


# torch >= 2.13 names the single-tensor collectives *_single (the *_tensor names remain, deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatheredRows(torch.autograd.Function):
    """The all-gathered rows as an autograd node of the local rows: forward returns `gathered` ([W, B, 2C, F], rank
    r's rows at index r, filled by an all-gather the caller has waited for); backward reduce-scatters the gradient
    (sum over ranks) back to the local rows x [B, 2C, F]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.rank = world()[0]
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """grad [W, B, 2C, F] -> this rank's sum over all ranks' grad[rank], [B, 2C, F]."""
        return reduce_scatter_ranks(grad, ctx.rank), None


def reduce_scatter_ranks(parts: torch.Tensor, rank: int) -> torch.Tensor:
    """parts [W, ...] on every rank -> sum over the ranks of their parts[rank], [...]."""
    parts = parts.contiguous()
    out = parts.new_empty(parts.shape[1:])
    try:
        _reduce_scatter(out, parts.flatten(0, 1))
        return out
    except RuntimeError:    # gloo before reduce-scatter support raises on every rank, before communicating
        dist.all_reduce(parts)
        return parts[rank].clone()


class PendingGather(NamedTuple):
    """An all-gather of a shard's rows in flight (start_gather): the local rows x [B, 2C, ...], the contiguous
    [B, 2C, F] rows sent (kept alive until the gather is waited for), the buffer the ranks' rows land in
    ([W B, 2C, F]) and the collective's handle (None without a process group)."""

    x: torch.Tensor
    sent: torch.Tensor | None
    buffer: torch.Tensor | None
    work: object | None


def start_gather(x: torch.Tensor) -> PendingGather:
    """Start the all-gather of every rank's shard rows x [B, 2C, ...] (asynchronous: the caller's next kernels run
    while the rows travel); finish_gather waits and orders them."""
    _, world_size = world()
    if world_size == 1:
        return PendingGather(x, None, None, None)
    flat = x.reshape(*x.shape[:2], -1).contiguous()
    buffer = flat.new_empty((world_size * flat.shape[0], *flat.shape[1:]))     # ranks concatenated along dim 0
    sent = flat.detach()
    return PendingGather(x, sent, buffer, _all_gather(buffer, sent, async_op=True))


def finish_gather(pending: PendingGather) -> torch.Tensor:
    """The full sequence [B, T, ...] in token order of a started gather, differentiable with respect to its local
    rows (backward: the reduce-scatter). With one process the shard is the sequence already."""
    x = pending.x
    rank, world_size = world()
    if world_size == 1:
        return x
    pending.work.wait()
    b, rows = x.shape[:2]
    tail = x.shape[2:]
    flat = x.reshape(b, rows, -1)
    gathered = _GatheredRows.apply(flat, pending.buffer.view(world_size, *flat.shape))     # [W, B, 2C, F]
    c = rows // 2
    chunks = gathered.reshape(world_size, b, 2, c, -1).permute(1, 0, 2, 3, 4).reshape(b, 2 * world_size, c, -1)
    ordered = chunks.index_select(1, unshard_order(world_size, x.device))
    return ordered.reshape(b, world_size * rows, *tail)


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """Every rank's shard [B, 2C, ...] -> the full sequence [B, T, ...] in token order (differentiable; the gather
    waited for at once)."""
    return finish_gather(start_gather(x))


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Every rank's full-sequence gradient [B, T, ...] -> this rank's shard rows [B, 2C, ...] of their sum over
    ranks (the reduce-scatter that gather_sequence's backward does, for gradients computed outside autograd).

    With one process the gradient is the shard's already."""
    rank, world_size = world()
    if world_size == 1:
        return x
    return reduce_scatter_ranks(torch.stack([shard_rows(x, r, world_size) for r in range(world_size)]), rank)


def all_reduce_grad(t: torch.Tensor) -> None:
    """Sum t.grad over ranks in place (a replicated parameter whose gradient each rank holds in part)."""
    if world()[1] > 1 and t.grad is not None:
        dist.all_reduce(t.grad)


def chunk_topk(q_index: torch.Tensor, k_index: torch.Tensor, w_index: torch.Tensor, start: int, topk: int,
               impl: str) -> torch.Tensor:
    """Causal indexer top-k for query rows at global tokens [start, start + C).

    q_index [B, C, H_i, D_i], k_index [B, T, D_i] (full sequence), w_index [B, C, H_i] -> int32 ids [B, C, topk]
    of global token positions <= the row's own, -1 padded.
    """
    offsets = torch.full((q_index.shape[0],), start, dtype=torch.int32, device=q_index.device)
    return dsagen.indexer_forward_topk(q_index, k_index, w_index, topk, q_causal_offsets=offsets,
                                       return_softmax=False, topk_indices_global=False, impl=impl).indices


def chunk_attention(q: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, sink: torch.Tensor | None, d_v: int,
                    impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of C query rows over the full KV: q [B, C, H, D_qk], kv [B, T, D_qk], ids [B, C, K]
    -> out [B, C, H, d_v], lse [B, C, H] (KV-only, FP32)."""
    out, lse, _ = dsagen.sparse_attention(q, kv, ids, attn_sink=sink, d_v=d_v, impl=impl)
    return out, lse


def chunk_indexer_grads(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor,
                        q_index: torch.Tensor, k_index: torch.Tensor, w_index: torch.Tensor, index_scale: float,
                        loss_coeff: float, impl: str) -> IndexerGrads:
    """The indexer's training ops for C query rows (DeepSeek-V3.2's KL loss between the attention's and the
    indexer's distributions over the selected slots): q [B, C, H, D_qk], kv [B, T, D_qk], lse [B, C, H] (the
    attention's), ids [B, C, K], q_index [B, C, H_i, D_i], k_index [B, T, D_i], w_index [B, C, H_i]
    -> IndexerGrads (d_index_k over the full sequence, [B, T, D_i])."""
    target = dsagen.sparse_attn_score_recompute(q, kv, lse, ids, impl=impl)
    predict = dsagen.sparse_indexer_score_recompute(q_index, k_index, w_index, ids, sm_scale=index_scale, impl=impl)
    return dsagen.indexer_backward(q_index, w_index, k_index, target, predict, ids, sm_scale=index_scale,
                                   loss_coeff=loss_coeff, impl=impl)


def dsa_layer(shard: Shard, sink: torch.Tensor | None, topk: int, d_v: int, impl: str,
              index_scale: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, IndexerGrads | None]:
    """The context-parallel DSA layer on this rank's shard.

    Returns out [B, 2C, H, d_v], lse [B, 2C, H] and the indexer ids [B, 2C, topk] (global token positions) for
    the shard's query rows, in the shard's order. Gradients reach shard.q, shard.kv (reduce-scattered) and the
    sink (this rank's part: call all_reduce_grad(sink) after backward).

    index_scale: None, or the indexer's softmax scale to also train it: the indexer's KL loss over the selected
    slots (dsagen.sparse_attn_score_recompute's target, dsagen.sparse_indexer_score_recompute's prediction) and its
    gradients by dsagen.indexer_backward, each row weighted 1 / (B T) as one call over the whole sequence weighs it.
    Returned as IndexerGrads of the shard's rows (else None): d_index_q [B, 2C, H_i, D_i], d_weights
    [B, 2C, H_i] and d_index_k [B, 2C, D_i], reduce-scattered to the key rows' owners.
    """
    rank, world_size = world()
    rows = shard.q.shape[1]
    c = rows // 2
    kv_pending = start_gather(shard.kv)                                    # in flight under the indexer
    with torch.no_grad():
        k_index = gather_sequence(shard.k_index)                           # [B, T, D_i]
    rows_of = [slice(j * c, (j + 1) * c) for j in range(2)]               # the shard's head and tail chunk
    topk_ids = [chunk_topk(shard.q_index[:, rows_j], k_index, shard.w_index[:, rows_j], chunk * c, topk, impl)
                for rows_j, chunk in zip(rows_of, chunk_ids(rank, world_size))]
    kv = finish_gather(kv_pending)                                         # [B, T, D_qk], differentiable
    outs, lses, index_grads = [], [], []
    for rows_j, ids in zip(rows_of, topk_ids):
        q_index, w_index = shard.q_index[:, rows_j], shard.w_index[:, rows_j]
        out, lse = chunk_attention(shard.q[:, rows_j], kv, ids, sink, d_v, impl)
        if index_scale is not None:
            with torch.no_grad():
                index_grads.append(chunk_indexer_grads(shard.q[:, rows_j].detach(), kv.detach(), lse, ids, q_index,
                                                       k_index, w_index, index_scale, c / (world_size * rows), impl))
        outs.append(out)
        lses.append(lse)
    grads = None
    if index_scale is not None:
        grads = IndexerGrads(torch.cat([g.d_index_q for g in index_grads], 1),
                             torch.cat([g.d_weights for g in index_grads], 1),
                             scatter_sequence(index_grads[0].d_index_k + index_grads[1].d_index_k))
    return torch.cat(outs, 1), torch.cat(lses, 1), torch.cat(topk_ids, 1), grads


def make_inputs(batch: int, seq: int, heads: int, d_qk: int, index_heads: int, index_dim: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-sequence random inputs, the same on every rank (seeded): q, kv, q_index, k_index, w_index, sink."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return dict(q=rand(batch, seq, heads, d_qk), kv=rand(batch, seq, d_qk),
                q_index=rand(batch, seq, index_heads, index_dim), k_index=rand(batch, seq, index_dim),
                w_index=rand(batch, seq, index_heads),
                sink=(torch.randn(heads, generator=g)).to(device=device, dtype=torch.float32))


def shard_inputs(full: dict[str, torch.Tensor], rank: int, world_size: int) -> Shard:
    """This rank's Shard of full-sequence inputs; q and kv are leaves that require grad."""
    parts = {k: shard_rows(full[k], rank, world_size) for k in ("q", "kv", "q_index", "k_index", "w_index")}
    parts["q"].requires_grad_(True)
    parts["kv"].requires_grad_(True)
    return Shard(**parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=32768, help="sequence length (a multiple of 2 * world size)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--d-qk", type=int, default=576)
    p.add_argument("--d-v", type=int, default=512)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--no-indexer-training", action="store_true",
                   help="leave out step 5 (the indexer's training ops)")
    p.add_argument("--json", help="append the run's step times (ms, the slowest rank's per step) to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    """One process per rank (torchrun): NCCL + impl="fused" + bf16 on CUDA, gloo + impl="reference" + fp32 on CPU.
    Each step (forward, backward of a fixed loss, the sink's all-reduce, the indexer's gradients) is timed between
    barriers; rank 0 prints the slowest rank's median step time. Runs with 1, 2 and 4 processes give the scaling
    efficiency t(1) / (W t(W))."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = world()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    impl, dtype = ("fused", torch.bfloat16) if cuda else ("reference", torch.float32)
    full = make_inputs(args.batch, args.T, args.heads, args.d_qk, args.index_heads, args.index_dim, dtype, device)
    shard = shard_inputs(full, rank, world_size)
    sink = full["sink"].requires_grad_(True)
    index_scale = None if args.no_indexer_training else args.index_dim ** -0.5
    times = []
    for step in range(args.steps + 1):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, _, _, _ = dsa_layer(shard, sink, args.topk, args.d_v, impl, index_scale)
        out.float().square().mean().backward()
        all_reduce_grad(sink)
        if cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step > 0:                                    # step 0 warms up (kernel loads, allocator)
            times.append(dt.item() * 1e3)
        shard.q.grad = shard.kv.grad = sink.grad = None
    if rank == 0:
        med = sorted(times)[len(times) // 2]
        print(f"world {world_size}, T {args.T}, {impl}, indexer training {index_scale is not None}: "
              f"step {med:.2f} ms (median of {len(times)}; {', '.join(f'{t:.2f}' for t in times)})")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"world": world_size, "T": args.T, "impl": impl,
                                    "indexer_training": index_scale is not None, "step_ms": times, "median_ms": med,
                                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                                    "torch": torch.__version__}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
