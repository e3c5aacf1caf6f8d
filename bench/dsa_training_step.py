"""One sparse training step of a DeepSeek-V3.2 DSA attention layer, every stage fused against every stage in plain
PyTorch, in one run (GPU).

    python bench/dsa_training_step.py [--T 4096] [--rounds 3]

One sequence of T tokens, causal, bf16: the indexer (H 64, D 128) selects top-2048 keys per query, the sparse MLA
(H 128, D_qk 576, d_v 512, with a sink) attends over them; the indexer is trained with the KL loss against the
attention's distribution over the same slots. Stages, in order:
    ids      = lightning_indexer(q_i, k_i, w, 2048, causal=True)          indexer forward + top-k
    out, lse = sparse_attention(q, kv, ids, attn_sink)                     attention forward
    target   = sparse_attn_score_recompute(q, kv, lse, ids)                attention scores over the slots
    predict  = sparse_indexer_score_recompute(q_i, k_i, w, ids)            indexer softmax over the slots
    d_i      = indexer_backward(q_i, w, k_i, target, predict, ids)         indexer gradients
    d_attn   = sparse_attention_backward(q, kv, out, dout, lse, ids)       attention gradients
Each stage is timed alone (CUDA events, median of --rounds rounds after a warm-up) with impl="fused" and with
impl="reference", then the whole step; the fused outputs are checked against the reference step's. The reference
indexer's ids are put in the fused kernel's slot order (ascending, -1 last; a sort inside its stage) so that the
later stages of both steps see the same slots.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_time_ms  # noqa: E402

import dsagen  # noqa: E402

H_I, D_I, H, D_QK, D_V, TOPK = 64, 128, 128, 576, 512, 2048


def inputs(t: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    return dict(
        q_i=torch.randn((1, t, H_I, D_I), generator=g, device="cuda", dtype=bf),
        k_i=torch.randn((1, t, D_I), generator=g, device="cuda", dtype=bf),
        w=(torch.randn((1, t, H_I), generator=g, device="cuda") * H_I ** -0.5).to(bf),
        q=torch.randn((t, H, D_QK), generator=g, device="cuda", dtype=bf),
        kv=torch.randn((t, D_QK), generator=g, device="cuda", dtype=bf),
        sink=torch.randn((H,), generator=g, device="cuda"),
        dout=torch.randn((t, H, D_V), generator=g, device="cuda", dtype=bf))


def stages(x: dict, impl: str):
    """The step's stages as (name, fn) with fn() -> outputs; each reads the previous stages' outputs from `s`."""
    s: dict = {}
    scale, sm_scale = D_QK ** -0.5, D_I ** -0.5

    def indexer():
        ids = dsagen.lightning_indexer(x["q_i"], x["k_i"], x["w"], TOPK, causal=True, impl=impl)
        if impl == "reference":   # the fused kernel's slot order (ascending ids, -1 last), so later stages align
            big = torch.iinfo(torch.int32).max
            ids = torch.where(ids < 0, big, ids).sort(-1).values
            ids = torch.where(ids == big, -1, ids)
        s["ids"] = ids
        return ids

    def attn_fwd():
        s["out"], s["lse"], _ = dsagen.sparse_attention(x["q"], x["kv"], s["ids"][0], attn_sink=x["sink"],
                                                        softmax_scale=scale, impl=impl)
        return s["out"], s["lse"]

    def attn_recompute():
        s["target"] = dsagen.sparse_attn_score_recompute(x["q"][None], x["kv"][None], s["lse"][None].float(),
                                                         s["ids"], scale, impl=impl)
        return s["target"]

    def indexer_recompute():
        s["predict"] = dsagen.sparse_indexer_score_recompute(x["q_i"], x["k_i"], x["w"], s["ids"], sm_scale=sm_scale,
                                                             impl=impl)
        return s["predict"]

    def indexer_bwd():
        return dsagen.indexer_backward(x["q_i"], x["w"], x["k_i"], s["target"], s["predict"], s["ids"],
                                       sm_scale=sm_scale, impl=impl)

    def attn_bwd():
        return dsagen.sparse_attention_backward(x["q"], x["kv"], s["out"].to(torch.bfloat16), x["dout"], s["lse"],
                                                s["ids"][0], attn_sink=x["sink"], softmax_scale=scale, impl=impl)

    return [("indexer fwd + top-k", indexer), ("attention fwd", attn_fwd), ("attn score recompute", attn_recompute),
            ("indexer score recompute", indexer_recompute), ("indexer backward", indexer_bwd),
            ("attention backward", attn_bwd)]


def close(a, b) -> float:
    """max |a - b| / max |b| over the tensors of two outputs."""
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b) if x is not None and x.dtype.is_floating_point)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    x = inputs(args.T)
    fused, ref = stages(x, "fused"), stages(x, "reference")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  T {args.T} (causal)  topk {TOPK}")
    print(f"{'stage':>24} | {'fused ms':>9} {'PyTorch ms':>10} {'x':>6} | max rel diff")
    total_f = total_r = 0.0
    for (name, f), (_, r) in zip(fused, ref):
        want = r()
        got = f()
        if name == "indexer fwd + top-k":   # 1.0 when any row's selected set differs, else 0
            diff = float((got != want).any())
        else:
            diff = close(got, want)
        tf = cuda_time_ms(f, rounds=args.rounds)
        tr = cuda_time_ms(r, rounds=max(1, args.rounds - 1))
        total_f += tf
        total_r += tr
        print(f"{name:>24} | {tf:9.3f} {tr:10.2f} {tr / tf:6.1f} | {diff:.2e}", flush=True)
    step_f = cuda_time_ms(lambda: [f() for _, f in fused], rounds=args.rounds)
    step_r = cuda_time_ms(lambda: [r() for _, r in ref], rounds=max(1, args.rounds - 1))
    print(f"{'sum of stages':>24} | {total_f:9.3f} {total_r:10.2f} {total_r / total_f:6.1f} |")
    print(f"{'whole step':>24} | {step_f:9.3f} {step_r:10.2f} {step_r / step_f:6.1f} |")


if __name__ == "__main__":
    main()
