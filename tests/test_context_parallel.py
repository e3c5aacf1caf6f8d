"""examples/context_parallel_dsa.py on worlds of 2 and 4 CPU processes (gloo, impl="reference") against one process.

Every output (out, lse, the indexer ids) and gradient (dq, dkv, d_sink, and the indexer's d_index_q, d_weights,
d_index_k) of the multi-rank run, put back in sequence order, must equal the single-process run of the same layer
within FP32 tolerance; the single-process ids must equal `dsagen.lightning_indexer(causal=True)`'s, its outputs
`dsagen.sparse_attention`'s and its indexer gradients one `dsagen.indexer_backward` call's on the full sequence.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsagen

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "context_parallel_dsa.py"
SHAPES = dict(batch=1, seq=64, heads=16, d_qk=24, index_heads=4, index_dim=16)
TOPK, D_V = 16, 16
INDEX_SCALE = SHAPES["index_dim"] ** -0.5
INDEXER_GRADS = ("d_index_q", "d_weights", "d_index_k")


def _example():
    """The example script as a module."""
    spec = importlib.util.spec_from_file_location("context_parallel_dsa", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(cp) -> dict[str, torch.Tensor]:
    """The example's inputs with the indexer's on a grid of quarters: every indexer score is then exact in FP32
    whatever order a GEMM sums it in (its products are multiples of 1/16 and 1/64), so the 2-rank run and the
    single process select the same ids (equal scores go to the lower id in both) instead of flipping near-ties
    on a different summation order."""
    full = cp.make_inputs(**SHAPES, dtype=torch.float32, device=torch.device("cpu"))
    for name in ("q_index", "k_index", "w_index"):
        full[name] = torch.round(full[name] * 4).clamp(-16, 16) / 4
    return full


def _run_layer(cp, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Forward + backward of the layer on rank's shard; the loss is sum(out * dout) with a fixed dout."""
    full = _inputs(cp)
    shard = cp.shard_inputs(full, rank, world_size)
    sink = full["sink"].requires_grad_(True)
    out, lse, ids, index_grads = cp.dsa_layer(shard, sink, TOPK, D_V, "reference", INDEX_SCALE)
    dout = cp.shard_rows(torch.randn(*out.shape[:1], SHAPES["seq"], *out.shape[2:],
                                     generator=torch.Generator().manual_seed(1)), rank, world_size)
    (out * dout).sum().backward()
    cp.all_reduce_grad(sink)
    return dict(out=out.detach(), lse=lse, ids=ids, dq=shard.q.grad, dkv=shard.kv.grad, d_sink=sink.grad,
                **index_grads._asdict())


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.save(_run_layer(_example(), rank, world_size), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _unshard(cp, parts: list[torch.Tensor]) -> torch.Tensor:
    """Rank shards [B, 2C, ...] -> the sequence [B, T, ...] (inverse of shard_rows)."""
    w = len(parts)
    chunks = [None] * (2 * w)
    for r, part in enumerate(parts):
        head, tail = cp.chunk_ids(r, w)
        chunks[head], chunks[tail] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_match_one_process(tmp_path, world_size):
    cp = _example()
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    single = _run_layer(cp, 0, 1)

    for name in ("out", "lse", "ids", "dq", "dkv", *INDEXER_GRADS):
        got = _unshard(cp, [r[name] for r in ranks])
        if name == "ids":
            assert torch.equal(got, single[name])
        else:
            torch.testing.assert_close(got, single[name], rtol=1e-5, atol=1e-5, msg=name)
    for r in ranks:                                    # the sink's gradient is the same, all-reduced, on each rank
        torch.testing.assert_close(r["d_sink"], single["d_sink"], rtol=1e-5, atol=1e-5)
    for name in ("d_sink", "dkv", *INDEXER_GRADS):
        assert single[name].abs().sum() > 0, name


def test_single_process_is_the_plain_ops():
    """The layer with one rank = lightning_indexer(causal=True) + sparse_attention on the full sequence."""
    cp = _example()
    full = _inputs(cp)
    got = _run_layer(cp, 0, 1)
    ids = dsagen.lightning_indexer(full["q_index"], full["k_index"], full["w_index"], TOPK, causal=True,
                                   impl="reference")
    assert torch.equal(got["ids"], ids)
    out, lse, _ = dsagen.sparse_attention(full["q"], full["kv"], ids, attn_sink=full["sink"], d_v=D_V,
                                          impl="reference")
    torch.testing.assert_close(got["out"], out)
    torch.testing.assert_close(got["lse"], lse)
    target = dsagen.sparse_attn_score_recompute(full["q"], full["kv"], lse, ids, impl="reference")
    predict = dsagen.sparse_indexer_score_recompute(full["q_index"], full["k_index"], full["w_index"], ids,
                                                    sm_scale=INDEX_SCALE, impl="reference")
    want = dsagen.indexer_backward(full["q_index"], full["w_index"], full["k_index"], target, predict, ids,
                                   sm_scale=INDEX_SCALE, impl="reference")
    for name, w in zip(INDEXER_GRADS, want):
        torch.testing.assert_close(got[name], w, msg=name)
