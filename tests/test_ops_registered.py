"""The fused public ops are `torch.library` custom ops from `import dsagen` on (torch already imported) or from
the first use of an op: functional `torch.ops.dsagen.<name>` and `torch.ops.dsagen.<name>_out` with caller-owned
outputs, each with a fake implementation, so that a module calling them exports with `torch.export` on a
machine without a GPU and loads in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dsagen
from dsagen.ops import _registry
from dsagen.ops._fused import FUSED

ROOT = Path(__file__).resolve().parents[1]
NAMES = [op.name for op in _registry.OPS]
_HEAVY = ("cutlass", "jinja2", "dsagen.jit", "dsagen.kernels", "dsagen.runtime", "dsagen.store")


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_every_op_with_a_fused_kernel_is_registered():
    public = set(FUSED) & set(dsagen._OPS)
    assert set(NAMES) == public
    for name in NAMES:
        assert hasattr(torch.ops.dsagen, name) and hasattr(torch.ops.dsagen, f"{name}_out"), name


def test_import_registers_the_ops_without_loading_kernel_code():
    """`import torch, dsagen` defines every op and its fake; nothing of the compiler, store, runtime or a
    family's host code is imported (the real implementations load them on their first call)."""
    names = ", ".join(repr(n) for n in NAMES)
    out = _run("import sys, torch, dsagen; "
               f"missing = [n for n in ({names},) for v in (n, n + '_out') if not hasattr(torch.ops.dsagen, v)]; "
               f"heavy = sorted(m for m in sys.modules if m.startswith({_HEAVY!r})); print(missing, heavy)")
    assert out == "[] []"


def test_the_first_use_of_an_op_registers_them_when_dsagen_came_before_torch():
    out = _run("import dsagen, sys; assert 'torch' not in sys.modules; f = dsagen.compactify; import torch; "
               "print(hasattr(torch.ops.dsagen, 'sparse_attention_out'))")
    assert out == "True"


def test_existing_host_op_names_stay_registered_where_the_host_module_is_imported():
    import dsagen.kernels.sparse_mla.host  # noqa: F401  (registers dsagen::sparse_attention_fwd, as before)

    assert hasattr(torch.ops.dsagen, "sparse_attention_fwd") and hasattr(torch.ops.dsagen, "sparse_attention")


def test_out_variants_mutate_their_out_arguments_only():
    for op in _registry.OPS:
        sch = getattr(torch.ops.dsagen, f"{op.name}_out").default._schema
        mutated = [a.name for a in sch.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == [f"out_{o}" for o in op.outputs], op.name
        assert all(a.kwarg_only for a in sch.arguments if a.name.startswith("out_")) and not sch.returns


def _bf16(*shape):
    return torch.empty(shape, dtype=torch.bfloat16)


def _i32(*shape):
    return torch.empty(shape, dtype=torch.int32)


def _f32(*shape):
    return torch.empty(shape, dtype=torch.float32)


# B=2, S_q=T=8, S_k=N=32, H=16, D=64 (indexer), D_qk=576 / d_v=512 (attention), K=64
_CASES = {
    "compactify": ((_i32(2, 8, 64),), {}, [((16, 64), torch.int32), ((16,), torch.int32)]),
    "local_to_global": ((_i32(2, 8, 64), 32), {}, [((2, 8, 64), torch.int32)]),
    "lightning_indexer": ((_bf16(2, 8, 16, 64), _bf16(2, 8, 64), _bf16(2, 8, 16), 4), dict(causal=True),
                          [((2, 8, 4), torch.int32)]),
    "indexer_scores": ((_bf16(2, 8, 16, 64), _bf16(2, 32, 64), _bf16(2, 8, 16)), dict(return_lse=True),
                       [((2, 8, 32), torch.float32), ((2, 8), torch.float32)]),
    "dense_indexer_score_recompute": ((_bf16(2, 8, 16, 64), _bf16(2, 32, 64), _bf16(2, 8, 16)), dict(sm_scale=0.5),
                                      [((2, 8, 32), torch.float32), ((2, 8), torch.float32)]),
    "dense_indexer_backward": ((_bf16(2, 8, 16, 64), _bf16(2, 8, 16), _bf16(2, 32, 64), _f32(2, 8, 32), _f32(2, 8),
                                _f32(2, 8, 32), _f32(2, 8)), dict(grad_loss=_f32(1)),
                               [((2, 8, 16, 64), torch.bfloat16), ((2, 8, 16), torch.bfloat16),
                                ((2, 32, 64), torch.bfloat16)]),
    "dense_indexer_kl_backward": ((_bf16(2, 8, 16, 576), _bf16(2, 32, 576), _f32(2, 8, 16), _bf16(2, 8, 16, 64),
                                   _bf16(2, 8, 16), _bf16(2, 32, 64)), dict(ratio=4),
                                  [((), torch.float32), ((2, 8, 16, 64), torch.bfloat16), ((2, 8, 16), torch.bfloat16),
                                   ((2, 32, 64), torch.bfloat16)]),
    "indexer_forward_topk": ((_bf16(2, 8, 16, 64), _bf16(2, 32, 64), _bf16(2, 8, 16), 4), dict(return_lse=True),
                             [((2, 8, 4), torch.int32), ((2, 8, 4), torch.float32), ((2, 8, 4), torch.float32),
                              ((2, 8), torch.float32)]),
    "indexer_topk": ((_f32(16, 32), _i32(16), 4), {}, [((16, 4), torch.int32), ((16, 4), torch.float32)]),
    "sparse_indexer_score_recompute": ((_bf16(2, 8, 16, 64), _bf16(2, 32, 64), _bf16(2, 8, 16), _i32(2, 8, 64)), {},
                                       [((2, 8, 64), torch.float32)]),
    "indexer_backward": ((_bf16(2, 8, 16, 64), _bf16(2, 8, 16), _bf16(2, 32, 64), _f32(2, 8, 64), _f32(2, 8, 64),
                          _i32(2, 8, 64)), {},
                         [((2, 8, 16, 64), torch.bfloat16), ((2, 8, 16), torch.bfloat16), ((2, 32, 64), torch.bfloat16)]),
    "sparse_attention": ((_bf16(2, 8, 16, 576), _bf16(2, 32, 576), _i32(2, 8, 64)), dict(indexer_topk=64),
                         [((2, 8, 16, 512), torch.bfloat16)] + [((2, 8, 16), torch.float32)] * 3),
    "sparse_attention_backward": ((_bf16(8, 16, 576), _bf16(32, 576), _bf16(8, 16, 512), _bf16(8, 16, 512),
                                   _f32(8, 16), _i32(8, 64)), dict(attn_sink=_f32(16)),
                                  [((8, 16, 576), torch.bfloat16), ((32, 576), torch.bfloat16), ((16,), torch.float32)]),
    "dense_attn_score_recompute": ((_bf16(2, 8, 16, 576), _bf16(2, 32, 576), _f32(2, 8, 16)), dict(softmax_scale=0.1),
                                   [((2, 8, 32), torch.float32), ((2, 8), torch.float32)]),
    "sparse_attn_score_recompute": ((_bf16(2, 8, 16, 576), _bf16(2, 32, 576), _f32(2, 8, 16), _i32(2, 8, 64)), {},
                                    [((2, 8, 64), torch.float32)]),
    "native_sparse_attention": ((_bf16(2, 8, 16, 128), _bf16(2, 8, 4, 128), _bf16(2, 8, 4, 64)),
                                dict(block_indices=_i32(2, 8, 4, 16)), [((2, 8, 16, 64), torch.bfloat16)]),
    "sparse_attention_decode": ((_bf16(3, 2, 64, 576), _bf16(5, 64, 1, 576), _i32(3, 2, 128)), {},
                                [((3, 2, 64, 512), torch.bfloat16), ((3, 2, 64), torch.float32)]),
    "qsa_indexed_forward": ((_bf16(24, 12, 256), _bf16(24, 1, 256), _bf16(24, 1, 128), _i32(24, 8)), {},
                            [((24, 12, 128), torch.bfloat16), ((24, 12, 128), torch.float32),
                             ((12, 24), torch.float32)]),
    "quantize_kv_fp8": ((_bf16(3, 2, 576),), {}, [((3, 2, 656), torch.uint8)]),
    "dequantize_kv_fp8": ((torch.empty(5, 656, dtype=torch.uint8),), {}, [((5, 576), torch.bfloat16)]),
    "indexer_decode_topk": ((_bf16(3, 2, 64, 128), _f32(3, 2, 64), _bf16(10, 64, 128), _i32(3, 4), _i32(3), 16), {},
                            [((3, 2, 16), torch.int32)]),
    "qsa_bitmap_forward": ((_bf16(24, 24, 256), _bf16(24, 2, 256), _bf16(24, 2, 256),
                            torch.ones(24, 6, dtype=torch.uint8)), {},
                           [((24, 24, 256), torch.bfloat16), ((24, 24, 256), torch.float32),
                            ((24, 24), torch.float32)]),
}


def _as_fake(mode: FakeTensorMode, x):
    return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x


def _fake_call(name: str):
    args, kwargs, expected = _CASES[name]
    with FakeTensorMode() as mode:
        args = [_as_fake(mode, a) for a in args]
        kwargs = {k: _as_fake(mode, v) for k, v in kwargs.items()}
        res = getattr(torch.ops.dsagen, name)(*args, **kwargs)
        res = (res,) if isinstance(res, torch.Tensor) else res
        outs = {f"out_{o}": torch.empty_like(r) for o, r in zip(_registry.OPS[NAMES.index(name)].outputs, res)}
        assert getattr(torch.ops.dsagen, f"{name}_out")(*args, **kwargs, **outs) is None
    return [(tuple(r.shape), r.dtype) for r in res], expected


@pytest.mark.parametrize("name", NAMES)
def test_fake_implementation_gives_the_public_ops_shapes_and_dtypes(name):
    got, expected = _fake_call(name)
    assert got == expected


def test_optional_outputs_are_empty_tensors():
    with FakeTensorMode():
        q, kv, ids = _bf16(8, 16, 576), _bf16(32, 576), _i32(8, 64)
        assert torch.ops.dsagen.sparse_attention(q, kv, ids)[3].shape == (0,)
        assert torch.ops.dsagen.indexer_topk(_f32(4, 32), _i32(4), 2, return_values=False)[1].shape == (0,)


def test_real_implementation_is_the_public_fused_op():
    """On CPU tensors the custom op reaches the public op with impl='fused', which refuses CPU inputs."""
    with pytest.raises(ValueError, match="impl='fused' runs generated CUDA kernels"):
        torch.ops.dsagen.local_to_global(torch.zeros(1, 2, 4, dtype=torch.int32), 8)


class _Step(torch.nn.Module):
    """An indexer + sparse attention step: lightning_indexer's local ids -> local_to_global -> sparse_attention."""

    def forward(self, q_idx, k_idx, w, q, kv):
        ids = torch.ops.dsagen.lightning_indexer(q_idx, k_idx, w, 64, causal=True)
        flat = torch.ops.dsagen.local_to_global(ids, kv.shape[1])
        out, lse, _, _ = torch.ops.dsagen.sparse_attention(q.flatten(0, 1), kv.flatten(0, 1), flat.flatten(0, 1))
        scores = torch.empty(q_idx.shape[0], q_idx.shape[1], k_idx.shape[1], dtype=torch.float32, device=q.device)
        lse_i = torch.empty(q_idx.shape[:2], dtype=torch.float32, device=q.device)
        torch.ops.dsagen.indexer_scores_out(q_idx, k_idx, w, return_lse=True, out_scores=scores, out_lse=lse_i)
        return out, lse, scores, lse_i


def _export(path: Path) -> None:
    b, t, h, d = 2, 128, 16, 64
    inputs = (_bf16(b, t, h, d), _bf16(b, t, d), _bf16(b, t, h), _bf16(b, t, h, 576), _bf16(b, t, 576))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = tuple(mode.from_tensor(x) for x in inputs)
        ep = torch.export.export(_Step(), fake)
    torch.export.save(ep, path)


def test_a_module_calling_the_ops_exports_and_loads_in_a_fresh_process(tmp_path):
    path = tmp_path / "step.pt2"
    _export(path)
    code = ("import torch, dsagen\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            f"ep = torch.export.load({str(path)!r})\n"
            "targets = []\n"
            "for n in ep.graph.nodes:\n"
            "    if n.op == 'call_function':\n"
            "        t = n.target\n"
            "        if t is torch.ops.higher_order.auto_functionalized: t = n.args[0]\n"
            "        targets.append(str(t))\n"
            "print(sorted(x for x in targets if x.startswith('dsagen.')))\n"
            "with FakeTensorMode(allow_non_fake_inputs=True):\n"
            "    b, t = 2, 128\n"
            "    args = (torch.empty(b, t, 16, 64, dtype=torch.bfloat16), torch.empty(b, t, 64, dtype=torch.bfloat16),\n"
            "            torch.empty(b, t, 16, dtype=torch.bfloat16), torch.empty(b, t, 16, 576, dtype=torch.bfloat16),\n"
            "            torch.empty(b, t, 576, dtype=torch.bfloat16))\n"
            "    out, lse, scores, lse_i = ep.module()(*args)\n"
            "print(tuple(out.shape), tuple(lse.shape), tuple(scores.shape), tuple(lse_i.shape))\n")
    lines = _run(code).splitlines()
    assert lines[0] == str(sorted(["dsagen.indexer_scores_out.default", "dsagen.lightning_indexer.default",
                                   "dsagen.local_to_global.default", "dsagen.sparse_attention.default"]))
    assert lines[1] == "(256, 16, 512) (256, 16) (2, 128, 128) (2, 128)"
