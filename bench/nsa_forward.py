"""NSA selected branch forward (--backward: and forward + backward): dsagen's fused kernel against FLA's (GPU).

Times dsagen.native_sparse_attention(impl="fused") against FLA's Triton `parallel_nsa` at the NSA paper's shape.

    PYTHONPATH=.peer/fla python bench/nsa_forward.py [--T 8192 32768 65536] [--indices random local]
                                                     [--rounds 7] [--backward] [--check-T 1024] [--seed 0]
                                                     [--variant stages=3] [--dkv-variant stages=3,overlap=true]
                                                     [--profile] [--cudnn] [--json FILE]

Shape: B 1, HQ 64 query heads over H 4 KV heads (G 16), D = Dv = 128, blocks of 64 tokens, S 16 selected blocks
per (token, KV head), bf16, causal, no compressed branch, no sliding window, no gate. Block ids int32
[B, T, H, S], drawn on the GPU in one of two modes:
  random: every (token, KV head) takes 16 distinct blocks uniformly among its causal blocks 0..t//64, always with
          its own block t//64 (NSA's selection forces it); a token with fewer than 16 causal blocks pads with -1.
  local:  one such set per (query block of 64 tokens, KV head), drawn for the block's last token and given to all
          of the block's tokens (restricted to blocks <= the token's own, which for whole 64-token query blocks
          changes nothing): neighbouring tokens share their selection, as NSA's per-query-block selection does.
FLOPs = 4 * HQ * D * S * 64 per token for the forward (QK^T and PV over every slot: nominal, the -1 slots of
the first 1024 tokens and the causal half of each token's own block count too; the printed `valid` is the share
of slots that hold a block), 2.5x that for the backward, 3.5x for forward + backward; the backward line is the
difference of the fwd+bwd and fwd medians.

Contenders, timed interleaved round by round (common.paired_time_ms, the order shuffled every round):
  dsagen: dsagen.native_sparse_attention(q, k, v, block_indices=idx, block_counts=16, block_size=64,
          impl="fused"); where no fused kernel exists (NotImplementedError) a note is printed and FLA runs alone.
  fla:    fla.ops.nsa.parallel_nsa(q, k, v, block_indices=idx, block_counts=16, block_size=64,
          scale=1/sqrt(D)), from the fla-core 0.6.0 wheel unpacked into .peer/fla (carry that folder and put it on
          PYTHONPATH; Triton and einops come from the machine). Optional: without it a note is printed.
  FLA 0.6.0's parallel_nsa, as read in its source: g_cmp=None skips the compressed branch and the top-k (the given
  block_indices are used as they are), g_slc=None returns the selected branch unscaled, window_size=0 skips the
  sliding window, so the call is the selected branch alone, except that it always mean-pools k and v (unused
  here: two small memory-bound kernels, well under 1% of the forward). It asserts HQ / H a power of 2 and >= 16
  (the G query heads of a KV head are the kernel's M tile; 64 / 4 = 16 passes). block_indices [B, T, H, S] (per
  token only), any integer dtype (the kernel loads and widens each id to int64; its own top-k writes int32, and
  int32 is what both contenders get here); ids < 0 or after the token are skipped; with an int block_counts the
  forward reads all S = block_indices.shape[-1] slots (the int matters only to the backward), so S must be 16
  here; scale defaults to K ** -0.5 and is passed explicitly. One Triton program per (token, KV head): the Q
  tile [16, 128] against 16 gathered K / V blocks of 64 rows. Its forward's autotune key (block and head sizes)
  is the same for every T, so the configuration chosen on the first call serves all T.
  cudnn:  (--cudnn) the cuDNN frontend's SM90 NSA selection forward (`cudnn.NSA.selection_attention_wrapper`,
          CuTe-DSL kernel HopperSelectAttentionFwd, 1.32; ../shared/peers/ shows how to carry the frontend and
          CuTe-DSL): packed THD views of the same tensors (one sequence), int32 block ids [T, H, S] with
          block_counts = each token's valid (non -1, leading) slots, is_causal=True (token-level causal masking inside
          the selected blocks), forward only (no SM90 NSA backward in the frontend); it takes groups up to 16, so it
          also runs the small group (--hq 16) that FLA refuses. Optional: without the import a note is printed.
Checks: on the first T, dsagen's output against FLA's (max abs difference, and relative to max |FLA out|), and
with --backward their dq, dk, dv; at --check-T (default 1024; 0 skips) both against
dsagen.native_sparse_attention(impl="reference") (plain PyTorch, FP32 accumulation; slow at large T).
Time: CUDA events around one call after a warm-up, median over --rounds rounds (default 7). --json FILE writes
the device, versions, shape, checks and one row per (T, indices).
--dkv-variant: the backward alone (host.select_backward on the forward's out and lse: delta, the dq kernel, the
inverse index, the dk / dv kernel) with the op's dk / dv kernel and with each variant (NsaSelectDkvSpec fields
replaced), interleaved; every variant's dq, dk, dv checked bytewise against the op's.
--profile: one dsagen forward + backward through autograd under torch.profiler, its GPU time per kernel (the dq and
dk / dv kernels, the inverse index's sort and the torch glue), so the backward's split is measured, not inferred.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from common import cudnn_namespace, print_paired

import dsagen

B, HQ, H, D, DV, BLOCK, S = 1, 64, 4, 128, 128, 64, 16
MODES = ("random", "local")
SCALE = 1.0 / math.sqrt(D)


def _select(last_tok: torch.Tensor, b: int, h: int, s: int, n_blocks: int, block: int,
            gen: torch.Generator) -> torch.Tensor:
    """[b, R, h, s] int32: for each of the R rows (a token at position last_tok[r]) and KV head, s distinct
    blocks drawn uniformly among the causal blocks 0..last_tok // block, always with the own block (first), -1
    where fewer than s exist. Uniform scores, future blocks -1, the own block 2, top s; chunked over rows so the
    score tensor stays under 256 MiB."""
    device = last_tok.device
    cols = max(n_blocks, s)                            # at least s columns for topk; the extra ones are future
    col = torch.arange(cols, device=device)
    step = max(1, (1 << 26) // (b * h * cols))
    out = []
    for r0 in range(0, last_tok.numel(), step):
        own = torch.div(last_tok[r0:r0 + step], block, rounding_mode="floor")
        rows = own.numel()
        scores = torch.rand(b, rows, h, cols, generator=gen, device=device)
        scores.masked_fill_((col > own[:, None]).view(1, rows, 1, cols), -1.0)
        scores.scatter_(-1, own.view(1, rows, 1, 1).expand(b, rows, h, 1), 2.0)
        val, idx = scores.topk(s, dim=-1)
        out.append(torch.where(val < 0, -1, idx).to(torch.int32))
    return torch.cat(out, dim=1)


def random_indices(t: int, gen: torch.Generator, b: int = B, h: int = H, s: int = S, block: int = BLOCK,
                   device: str | torch.device = "cuda") -> torch.Tensor:
    """[b, t, h, s] int32: per (token, KV head) s distinct causal blocks incl. its own, -1 padded (see _select)."""
    return _select(torch.arange(t, device=device), b, h, s, -(-t // block), block, gen).contiguous()


def local_indices(t: int, gen: torch.Generator, b: int = B, h: int = H, s: int = S, block: int = BLOCK,
                  device: str | torch.device = "cuda") -> torch.Tensor:
    """[b, t, h, s] int32: per (query block of `block` tokens, KV head) one set drawn as in random_indices for the
    query block's last token, shared by all its tokens; ids after a token's own block become -1."""
    nqb = -(-t // block)
    last = (torch.arange(nqb, device=device) * block + block - 1).clamp(max=t - 1)
    per_block = _select(last, b, h, s, nqb, block, gen)            # [b, nqb, h, s]
    own = torch.div(torch.arange(t, device=device), block, rounding_mode="floor")
    idx = per_block.index_select(1, own)                           # [b, t, h, s]
    return torch.where(idx > own.view(1, t, 1, 1), -1, idx).contiguous()


def make_indices(mode: str, t: int, gen: torch.Generator, device: str | torch.device = "cuda") -> torch.Tensor:
    return (random_indices if mode == "random" else local_indices)(t, gen, device=device)


def make_inputs(t: int, mode: str, seed: int):
    """CUDA bf16 q [B, t, HQ, D], k [B, t, H, D], v [B, t, H, DV], dout like the output, and int32 ids."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, t, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, t, H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, t, H, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(B, t, HQ, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v, do, make_indices(mode, t, gen)


def load_fla():
    """FLA's parallel_nsa, or None with a note printed (the peer is optional)."""
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:                       # noqa: BLE001 - the peer is optional
        print(f"# FLA parallel_nsa not importable ({type(e).__name__}: {e}); put .peer/fla on PYTHONPATH; "
              "dsagen rows only")
        return None
    return parallel_nsa


def cudnn_selection(nsa, idx: torch.Tensor):
    """fn(q, k, v) -> out [1, T, HQ, Dv] through cudnn.NSA.selection_attention_wrapper on packed views of one
    sequence (module docstring); the ids' int32 copy, counts and offsets are made here, outside the timed call."""
    t = idx.shape[1]
    ids = idx[0].to(torch.int32).contiguous()                          # [T, H, S], valid slots first
    counts = (ids >= 0).sum(-1, dtype=torch.int32)                     # [T, H]
    cu = torch.tensor([0, t], dtype=torch.int32, device=idx.device)
    return lambda q, k, v: nsa.selection_attention_wrapper(
        q[0], k[0], v[0], ids, counts, cu, cu, block_size=BLOCK, scale_softmax=SCALE, max_s_q=t, max_s_k=t,
        is_causal=True)[0][None]


def contenders(idx: torch.Tensor, parallel_nsa, variants=(), cudnn_nsa=None) -> dict:
    """name -> fn(q, k, v) -> out, the selected branch alone; `variants`: extra dsagen contenders, each
    "field=value[,field=value]" of NsaSelectFwdSpec replaced in the op's spec (select_forward's spec=); cudnn_nsa:
    cuDNN's NSA namespace (the selection forward joins as "cudnn")."""
    fns = {"dsagen": lambda q, k, v: dsagen.native_sparse_attention(q, k, v, block_indices=idx, block_counts=S,
                                                                    block_size=BLOCK, impl="fused")}
    if cudnn_nsa is not None:
        fns["cudnn"] = cudnn_selection(cudnn_nsa, idx)
    if parallel_nsa is not None:
        fns["fla"] = lambda q, k, v: parallel_nsa(q, k, v, block_indices=idx, block_counts=S, block_size=BLOCK,
                                                  scale=SCALE)
    for var in variants:
        fns[f"dsagen {var}"] = _variant(idx, var)
    return fns


def _variant(idx: torch.Tensor, var: str):
    import dataclasses

    from dsagen.kernels.nsa.host import select_forward
    from dsagen.kernels.nsa.spec import select_fwd_spec_for

    spec = dataclasses.replace(select_fwd_spec_for(HQ // H, D, DV, BLOCK, S, "bfloat16", "sm_90a"),
                               **_spec_fields(var))
    return lambda q, k, v: select_forward(q, k, v, idx, S, None, SCALE, BLOCK, spec=spec)[0]


def available(fns: dict, q, k, v, noted: set, what: str = "forward") -> dict:
    """The fns whose call does not raise NotImplementedError (a note printed once per name)."""
    out = {}
    for name, fn in fns.items():
        try:
            fn(q, k, v)
        except NotImplementedError as e:
            if (name, what) not in noted:
                print(f"# {name} {what}: no fused kernel available (NotImplementedError: {e}); timing the others")
                noted.add((name, what))
            continue
        out[name] = fn
    return out


def diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.float() - want.float()).abs().max().item()
    return {"max_abs_diff": d, "rel_to_max_out": d / max(want.float().abs().max().item(), 1e-30)}


def print_diff(label: str, d: dict) -> None:
    print(f"# check {label}: max |diff| {d['max_abs_diff']:.3e}  ({d['rel_to_max_out']:.2e} of max |out|)")


def grads(fn, q, k, v, do):
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)


def reference_check(t: int, mode: str, seed: int, parallel_nsa, noted: set) -> list[dict]:
    """Each contender's output against impl="reference" at T = t."""
    q, k, v, _, idx = make_inputs(t, mode, seed)
    want = dsagen.native_sparse_attention(q, k, v, block_indices=idx, block_counts=S, block_size=BLOCK,
                                          impl="reference")
    checks = []
    for name, fn in available(contenders(idx, parallel_nsa), q, k, v, noted).items():
        d = diff(fn(q, k, v), want)
        print_diff(f"T {t} {mode} {name} vs reference", d)
        checks.append({"T": t, "indices": mode, "what": f"{name} vs reference", **d})
    return checks


def run_case(t: int, mode: str, args, parallel_nsa, noted: set, check: bool) -> tuple[dict, list[dict]]:
    q, k, v, do, idx = make_inputs(t, mode, args.seed)
    valid = (idx >= 0).float().mean().item()
    row = {"T": t, "indices": mode, "valid_slots": valid}
    checks = []
    fns = available(contenders(idx, parallel_nsa, args.variant, args.cudnn_nsa), q, k, v, noted)
    flops = 4.0 * HQ * D * S * BLOCK * t
    label = f"T {t:<6} {mode:<6} valid {valid:6.1%}"
    for peer in ("fla", "cudnn"):
        if check and {"dsagen", peer} <= fns.keys():
            d = diff(fns["dsagen"](q, k, v), fns[peer](q, k, v))
            print_diff(f"T {t} {mode} dsagen vs {peer}", d)
            checks.append({"T": t, "indices": mode, "what": f"dsagen vs {peer}", **d})
    fwd_ms = {}
    if fns:
        ms = print_paired(f"{label} fwd", [(n, (lambda f=f: f(q, k, v))) for n, f in fns.items()], flops,
                          args.rounds)
        fwd_ms = dict(zip(fns, ms))
        for n, m in fwd_ms.items():
            row.update({f"{n}_fwd_ms": m, f"{n}_fwd_tflops": flops / m / 1e9})
        if {"dsagen", "fla"} <= fwd_ms.keys():
            row["fwd_speedup"] = fwd_ms["fla"] / fwd_ms["dsagen"]
        if {"dsagen", "cudnn"} <= fwd_ms.keys():
            row["fwd_vs_cudnn"] = fwd_ms["cudnn"] / fwd_ms["dsagen"]
    if args.backward:
        # the op and FLA only (a --variant runs the forward kernel alone, with no autograd)
        bfns = {n: f for n, f in fns.items() if n in ("dsagen", "fla") and _has_backward(n, f, q, k, v, do, noted)}
        if check and len(bfns) == 2:
            for gname, gd, gf in zip(("dq", "dk", "dv"), grads(bfns["dsagen"], q, k, v, do),
                                     grads(bfns["fla"], q, k, v, do)):
                d = diff(gd, gf)
                print_diff(f"T {t} {mode} dsagen vs fla {gname}", d)
                checks.append({"T": t, "indices": mode, "what": f"dsagen vs fla {gname}", **d})
        if bfns:
            leaves = {n: tuple(x.detach().requires_grad_() for x in (q, k, v)) for n in bfns}
            steps = [(n, (lambda f=f, lv=leaves[n]: torch.autograd.grad(f(*lv), lv, do))) for n, f in bfns.items()]
            ms = print_paired(f"{label} fwd+bwd", steps, 3.5 * flops, args.rounds)
            both = dict(zip(bfns, ms))
            for n, m in both.items():
                row.update({f"{n}_fwd_bwd_ms": m, f"{n}_fwd_bwd_tflops": 3.5 * flops / m / 1e9})
            bwd = {n: both[n] - fwd_ms[n] for n in both if n in fwd_ms and both[n] > fwd_ms[n]}
            for n, m in bwd.items():
                row.update({f"{n}_bwd_ms": m, f"{n}_bwd_tflops": 2.5 * flops / m / 1e9})
            if bwd:
                line = "  ".join(f"{n} {m:.3f} ms ({2.5 * flops / (m * 1e9):.0f} TFLOP/s)" for n, m in bwd.items())
                ratio = f"  dsagen vs fla {bwd['fla'] / bwd['dsagen']:.2f}x" if len(bwd) == 2 else ""
                print(f"{label} bwd (fwd+bwd - fwd): {line}{ratio}", flush=True)
            if len(ms) > 1:
                row["fwd_bwd_speedup"] = ms[1] / ms[0]
    if args.dkv_variant:
        row.update(dkv_variants(t, mode, args, label))
    if args.profile:
        row.update(profile_step(t, mode, args, label))
    return row, checks


def _spec_fields(var: str) -> dict:
    """ "field=value[,field=value]" -> {field: int or bool}."""
    fields = {}
    for item in var.split(","):
        name, value = item.split("=")
        low = value.lower()
        fields[name] = low == "true" if low in ("true", "false") else int(value)
    return fields


def dkv_variants(t: int, mode: str, args, label: str) -> dict:
    """The backward alone with the op's dk / dv kernel and each --dkv-variant: ms per call (interleaved) and a
    bytewise check of dq, dk, dv against the op's kernel."""
    import dataclasses

    from dsagen.kernels.nsa.host import _forward, _Operands, select_backward
    from dsagen.kernels.nsa.spec import select_dkv_spec_for

    q, k, v, do, idx = make_inputs(t, mode, args.seed)
    ops = _Operands(q, k, v, idx, S, None, SCALE, BLOCK)
    out, lse = _forward(ops, None)
    base = select_dkv_spec_for(HQ // H, D, DV, "bfloat16", "sm_90a")
    specs = {"op": base}
    specs.update({var: dataclasses.replace(base, **_spec_fields(var)) for var in args.dkv_variant})
    want = select_backward(ops, out, lse, do, base)
    for name, spec in specs.items():
        same = all(torch.equal(a, b) for a, b in zip(select_backward(ops, out, lse, do, spec), want))
        print(f"# check {label} bwd dkv {name}: {'bytes equal to the op' if same else 'DIFFERS from the op'}")
    ms = print_paired(f"{label} bwd alone", [(name, (lambda sp=spec: select_backward(ops, out, lse, do, sp)))
                                            for name, spec in specs.items()], 2.5 * 4.0 * HQ * D * S * BLOCK * t,
                      args.rounds)
    return {f"bwd_{name}_ms": m for name, m in zip(specs, ms)}


def profile_step(t: int, mode: str, args, label: str) -> dict:
    """GPU ms per kernel name of one dsagen forward + backward (after a warm-up step), from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    q, k, v, do, idx = make_inputs(t, mode, args.seed)
    fn = contenders(idx, None)["dsagen"]
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    torch.autograd.grad(fn(*leaves), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(fn(*leaves), leaves, do)
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():           # the GPU's own events (kernels, memsets, copies), not the host ops above
        if e.device_type == DeviceType.CUDA:
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            per[e.key] = us / 1e3
    total = sum(per.values())
    print(f"{label} profile (GPU ms per kernel, total {total:.3f}):")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {ms:8.3f}  {ms / total:6.1%}  {name[:100]}")
    return {"profile_ms": per}


def _has_backward(name, fn, q, k, v, do, noted: set) -> bool:
    try:
        grads(fn, q, k, v, do)
    except NotImplementedError as e:
        if (name, "backward") not in noted:
            print(f"# {name} backward: not available (NotImplementedError: {e}); timing the others")
            noted.add((name, "backward"))
        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536], help="sequence lengths")
    ap.add_argument("--indices", nargs="+", choices=MODES, default=list(MODES), help="block id patterns")
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds (median)")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward through autograd")
    ap.add_argument("--check-T", type=int, default=1024,
                    help="T of the check against impl='reference' (0 skips it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", nargs="*", default=[],
                    help="extra dsagen contenders: NsaSelectFwdSpec fields replaced, e.g. stages=3")
    ap.add_argument("--dkv-variant", nargs="*", default=[],
                    help="the backward alone against dk / dv kernels with NsaSelectDkvSpec fields replaced, e.g. "
                         "stages=3,overlap=true")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of one dsagen forward + backward")
    ap.add_argument("--cudnn", action="store_true", help="the cuDNN frontend's SM90 selection forward beside ours")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    parallel_nsa = load_fla()
    args.cudnn_nsa = (cudnn_namespace("NSA", "selection_attention_wrapper", "no cudnn rows") if args.cudnn
                      else None)
    fla_version = None
    if parallel_nsa is not None:
        import fla
        fla_version = fla.__version__
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  FLA {fla_version}")
    print(f"# B {B}  HQ {HQ}  H {H}  D {D}  Dv {DV}  block {BLOCK}  S {S}  bf16  "
          f"fwd {4 * HQ * D * S * BLOCK / 1e6:.1f} MFLOP / token")
    noted: set = set()
    checks, rows = [], []
    if args.check_T:
        for mode in args.indices:
            checks += reference_check(args.check_T, mode, args.seed, parallel_nsa, noted)
    for i, t in enumerate(args.T):
        for mode in args.indices:
            row, c = run_case(t, mode, args, parallel_nsa, noted, check=i == 0)
            rows.append(row)
            checks += c
            torch.cuda.empty_cache()                # the case's tensors are gone with run_case's frame
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": fla_version,
                       "shape": {"B": B, "HQ": HQ, "H": H, "D": D, "Dv": DV, "block_size": BLOCK, "S": S,
                                 "dtype": "bfloat16"},
                       "rounds": args.rounds, "checks": checks, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
