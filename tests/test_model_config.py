"""Builds from a model: a Hugging Face-style config of a DeepSeek sparse-attention model -> every kernel spec it needs
(dsagen.spec.model_config), the deepseek-v3.2 preset as the same function, and `dsagen build --model`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dsagen.cli import main
from dsagen.kernels.indexer_bwd.spec import IndexerBwdSpec
from dsagen.kernels.indexer_score_recompute.spec import IndexerScoreRecomputeSpec
from dsagen.kernels.lightning_indexer.spec import IndexerScoreSpec, forward_topk_config_for, scores_config_for
from dsagen.kernels.lightning_indexer.spec import config_for as indexer_config
from dsagen.kernels.row_scatter_add.spec import RowScatterAddSpec
from dsagen.kernels.sparse_mla.spec import SparseAttnCombineSpec, SparseAttnFwdSpec
from dsagen.kernels.sparse_mla_bwd.spec import SparseAttnBwdOrderSpec, SparseAttnBwdSpec
from dsagen.spec import ARCHES, SpecError, get_preset, missing_ops
from dsagen.kernels.kv_fp8.spec import KvFp8CodecSpec
from dsagen.spec.model_config import (DEEPSEEK_V32, FIELDS, ModelConfigError, load_model_config, mla_kernel_heads,
                                      missing_ops_for_model, model_from_config, specs_for_model)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "deepseek-v3.2-config.json"


def _config(**changes) -> dict:
    d = json.loads(EXAMPLE.read_text())
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


def test_the_example_is_deepseek_v32_and_the_preset_is_specs_for_model():
    assert load_model_config(EXAMPLE) == DEEPSEEK_V32
    for arch in ARCHES:
        assert get_preset("deepseek-v3.2", arch) == specs_for_model(load_model_config(EXAMPLE), arch)
        assert missing_ops("deepseek-v3.2", arch) == missing_ops_for_model(DEEPSEEK_V32, arch)


def test_deepseek_v32_kernels():
    specs = specs_for_model(DEEPSEEK_V32, "sm_90a")
    assert [s.op for s in specs[:2]] == ["compactify", "local_to_global"]
    assert specs[2:4] == [KvFp8CodecSpec(arch="sm_90a"), KvFp8CodecSpec(arch="sm_90a", dequantize=True)]
    indexer = list(indexer_config(64, 128, "bfloat16", "sm_90a").specs())
    assert specs[4:4 + len(indexer)] == indexer
    (isr,) = [s for s in specs if isinstance(s, IndexerScoreRecomputeSpec)]
    assert (isr.num_heads, isr.head_dim, isr.dtype) == (64, 128, "bfloat16")
    ibwd = [s for s in specs if isinstance(s, IndexerBwdSpec)]
    assert [(x.head_dim, x.dtype, x.deterministic) for x in ibwd] == [(128, "bfloat16", False), (128, "bfloat16", True)]
    fwd = [s for s in specs if isinstance(s, SparseAttnFwdSpec)]
    assert [(f.num_heads, f.d_qk, f.d_v, f.dtype, f.lse_prefix, f.kv_fp8, f.split_kv) for f in fwd] == [
        (128, 576, 512, "bfloat16", False, False, False), (128, 576, 512, "bfloat16", True, False, False),
        (128, 576, 512, "bfloat16", False, True, False), (128, 576, 512, "bfloat16", False, False, True),
        (128, 576, 512, "bfloat16", False, True, True)]
    assert [s for s in specs if isinstance(s, SparseAttnCombineSpec)] == [SparseAttnCombineSpec(arch="sm_90a")]
    bwd = [s for s in specs if isinstance(s, SparseAttnBwdSpec)]
    assert [(b.num_heads, b.d_qk, b.d_v, b.dtype, b.deterministic) for b in bwd] == [
        (128, 576, 512, "bfloat16", False), (128, 576, 512, "bfloat16", True)]
    assert [s for s in specs if isinstance(s, SparseAttnBwdOrderSpec)] == [SparseAttnBwdOrderSpec(arch="sm_90a")]
    assert [s for s in specs if isinstance(s, RowScatterAddSpec)] == [RowScatterAddSpec(arch="sm_90a", width=128),
                                                                       RowScatterAddSpec(arch="sm_90a", width=576)]
    assert [s.op for s in specs_for_model(DEEPSEEK_V32, "sm_100a")] == ["compactify", "local_to_global"]
    assert missing_ops_for_model(DEEPSEEK_V32, "sm_100a") == [
        "dense_attn_score_recompute", "dense_indexer_backward", "indexer_backward", "indexer_scores_mask_lse",
        "indexer_topk", "kv_fp8_codec",
        "lightning_indexer_score", "lightning_indexer_topk", "row_scatter_add",
        "sparse_attention_bwd", "sparse_attention_bwd_order", "sparse_attention_combine", "sparse_attention_fwd",
        "sparse_attn_score_recompute", "sparse_indexer_score_recompute"]


def test_a_smaller_variant_gets_its_own_head_counts():
    model = model_from_config(_config(num_attention_heads=32, index_n_heads=32, index_head_dim=64,
                                      torch_dtype="float16"))
    specs = specs_for_model(model, "sm_90a")
    (score,) = [s for s in specs if isinstance(s, IndexerScoreSpec) and not s.dense_scores]
    # indexer_scores / indexer_forward_topk: the dense_scores form in the model's dtype, no FP8 at head dim 64
    (dense,) = [s for s in specs if isinstance(s, IndexerScoreSpec) and s.dense_scores]
    assert (dense.num_heads, dense.head_dim, dense.dtype) == (32, 64, "float16")
    fwd, fwd_prefix = [s for s in specs if isinstance(s, SparseAttnFwdSpec)]
    assert (score.num_heads, score.head_dim, score.dtype) == (32, 64, "float16")
    assert (fwd.num_heads, fwd.d_qk, fwd.dtype) == (64, 576, "float16")     # 32 heads run padded to 64
    assert fwd_prefix == dataclasses.replace(fwd, lse_prefix=True)
    assert model_from_config(_config(qk_rope_head_dim=0)).d_qk == 512
    # bf16 models also get the decode's kernels: the FP8 cache's and the split_kv forms of both caches
    assert [(s.num_heads, s.kv_fp8, s.split_kv)
            for s in specs_for_model(model_from_config(_config(num_attention_heads=96)), "sm_90a")
            if isinstance(s, SparseAttnFwdSpec)] == [(128, False, False), (128, False, False), (128, True, False),
                                                     (128, False, True), (128, True, True)]
    # the indexer's training kernels follow its heads and head dim: 32 heads run padded to 64
    (isr,) = [s for s in specs if isinstance(s, IndexerScoreRecomputeSpec)]
    assert (isr.num_heads, isr.head_dim, isr.dtype) == (64, 64, "float16")
    assert [(b.head_dim, b.dtype, b.deterministic) for b in specs if isinstance(b, IndexerBwdSpec)] == [
        (64, "float16", False), (64, "float16", True)]
    # a 128-head indexer has a 128-head score recompute and no fused backward (64 heads at most)
    wide = specs_for_model(model_from_config(_config(index_n_heads=128)), "sm_90a")
    assert [s.num_heads for s in wide if isinstance(s, IndexerScoreRecomputeSpec)] == [128]
    assert not [s for s in wide if isinstance(s, IndexerBwdSpec)]


def test_tensor_parallel_splits_the_mla_heads_only():
    model = model_from_config(_config(), tensor_parallel=8)
    assert (model.num_heads, model.index_n_heads) == (16, 64)
    assert [s.num_heads for s in specs_for_model(model, "sm_90a")
            if isinstance(s, SparseAttnFwdSpec)] == [64] * 5   # BF16 cache, lse_prefix, FP8 cache, 2 split_kv
    with pytest.raises(ModelConfigError, match="num_attention_heads=128 does not split evenly over --tp 3"):
        model_from_config(_config(), tensor_parallel=3)
    with pytest.raises(ModelConfigError, match="--tp 0"):
        model_from_config(_config(), tensor_parallel=0)


def test_fields_that_do_not_concern_attention_are_ignored():
    noisy = _config(hidden_size="not even a number", rope_scaling={"type": "yarn"}, quantization_config=[1, 2],
                    n_routed_experts=None)
    assert model_from_config(noisy) == DEEPSEEK_V32
    assert model_from_config(_config(torch_dtype=None, dtype="bfloat16")) == DEEPSEEK_V32   # newer HF configs


def test_mla_kernel_heads_agrees_with_the_host_code():
    from dsagen.kernels.sparse_mla.host import kernel_heads

    assert all(mla_kernel_heads(h) == kernel_heads(h) for h in range(1, 129))


@pytest.mark.parametrize("changes,field,msg", [
    ({"num_attention_heads": 256}, "num_attention_heads", "256 query heads per GPU, but the sparse MLA kernels serve 1..128"),
    ({"num_attention_heads": 0}, "num_attention_heads", "serve 1..128"),
    ({"index_n_heads": 48}, "index_n_heads", "index_n_heads=48: the lightning-indexer kernels serve 8, 16, 32, 64, 128"),
    ({"index_head_dim": 96}, "index_head_dim", "index_head_dim=96"),
    ({"kv_lora_rank": 256}, "kv_lora_rank", "kv_lora_rank=256"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim", "qk_rope_head_dim=32"),
    ({"index_topk": 0}, "index_topk", "index_topk=0"),
    ({"torch_dtype": "float32"}, "torch_dtype", "torch_dtype='float32': the attention kernels run bfloat16 or float16"),
    ({"num_attention_heads": "128"}, "num_attention_heads", "field 'num_attention_heads' must be an integer"),
    ({"index_topk": True}, "index_topk", "field 'index_topk' must be an integer"),
    ({"torch_dtype": 16}, "torch_dtype", "field 'torch_dtype' must be a string"),
])
def test_unsupported_values_name_the_field(changes, field, msg):
    with pytest.raises(ModelConfigError, match="^cfg.json: ") as e:
        model_from_config(_config(**changes), "cfg.json")
    assert field in str(e.value) and msg in str(e.value)
    assert isinstance(e.value, SpecError) and isinstance(e.value, ValueError)


def test_missing_fields_are_all_named():
    with pytest.raises(ModelConfigError) as e:
        model_from_config(_config(index_n_heads=None, index_head_dim=None, index_topk=None), "v3.json")
    text = str(e.value)
    assert text.startswith("v3.json: missing fields index_n_heads (")
    assert "index_head_dim (" in text and "index_topk (" in text and "num_attention_heads" not in text
    with pytest.raises(ModelConfigError, match="missing field torch_dtype"):
        model_from_config(_config(torch_dtype=None))
    with pytest.raises(ModelConfigError, match="a model config is a JSON object"):
        model_from_config([1, 2])
    assert set(FIELDS) == {"num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
                           "index_head_dim", "index_topk", "torch_dtype"}


# ---- the command line ----------------------------------------------------------------------------------
def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("dsagen: error: ") and err.count("\n") == 1, err
    return err


def test_build_model_errors(cache_env, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_config(num_attention_heads=512)))
    assert main(["build", "--model", str(bad)]) == 2
    assert f"--model {bad}: num_attention_heads: 512 query heads per GPU" in _err(capsys)
    bad.write_text("{not json")
    assert main(["build", "--model", str(bad), "--dry-run"]) == 2
    assert "not valid JSON" in _err(capsys)
    assert main(["build", "--model", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in _err(capsys)
    assert main(["build", "--preset", "deepseek-v3.2", "--tp", "2"]) == 2
    assert "--tp 2: only --model configs are split over GPUs" in _err(capsys)


def test_dry_run_lists_and_compiles_nothing(cache_env, capsys):
    assert main(["build", "--model", str(EXAMPLE), "--dry-run", "--arch", "sm_90a,sm_100a"]) == 0
    cap = capsys.readouterr()
    names = [s.name() for a in ("sm_90a", "sm_100a") for s in specs_for_model(DEEPSEEK_V32, a)]
    lines = cap.out.splitlines()
    assert lines[0].split() == ["name", "arch", "status", "key", "source"]
    listed = [line.split()[0] for line in lines[2:-1]]
    assert len(listed) == len(names)
    for shown, name in zip(listed, names):          # names wider than the table's column keep both ends around '..'
        head, _, tail = shown.partition("..")
        assert shown == name or (tail and name.startswith(head) and name.endswith(tail)), (shown, name)
    assert all(line.split()[2:4] == ["to", "build"] for line in lines[2:-1])
    assert lines[-1] == f"{len(names)} kernel(s): 0 cached, {len(names)} to build (dry run: nothing compiled)"
    assert ("has no sm_100a kernels yet for: dense_attn_score_recompute, dense_indexer_backward, indexer_backward, "
            "indexer_scores_mask_lse, indexer_topk, kv_fp8_codec, lightning_indexer_score") in cap.err
    assert all(len(line) <= 100 for line in lines)
    assert not cache_env.exists()                      # nothing written, not even the cache root


@pytest.mark.compile
def test_build_model_builds_v32_and_a_smaller_variant(cache_env, tmp_path, capsys):
    small = tmp_path / "small.json"
    small.write_text(json.dumps(_config(num_attention_heads=32, index_n_heads=32, index_head_dim=64)))
    assert main(["build", "--model", str(EXAMPLE), "--model", str(small), "--arch", "sm_90a", "-j", "2"]) == 0
    out = capsys.readouterr().out
    want = list(dict.fromkeys(s.name() for p in (EXAMPLE, small) for s in specs_for_model(load_model_config(p), "sm_90a")))
    assert {"sparse_attention_fwd_sm_90a", "sparse_attention_fwd_h64_sm_90a",
            "lightning_indexer_score_h32_d64_sm_90a"} <= set(want)
    assert f"{len(want)} kernel(s): {len(want)} built, 0 cached, 0 failed" in out
    assert all(len(line) <= 100 for line in out.splitlines())
    # everything is cached now: the dry run says so, and names the layer
    assert main(["build", "--model", str(small), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.split()[2] == "cached" and line.split()[-1] == "DSAGEN_CACHE_DIR" for line in lines[2:-1])
    n_small = len(specs_for_model(load_model_config(small), "sm_90a"))
    assert n_small == 39                               # 2 index ops, the FP8 KV cache's writer and reader, 5
    #         indexer, the dense indexer forward (its score kernel and mask pass), the combined indexer + top-k (4
    #         top-k forms that finish their rows; no FP8 at D 64) and the decode-time indexer's paged score kernel
    #         (its top-k kernels are those), 4 indexer top-k, the indexer score recompute, 2 indexer backwards and 3
    #         dense ones (atomic, deterministic, the KL loss path's), 5 MLA
    #         forwards (BF16 cache, lse_prefix, FP8 cache, the split_kv forms of both caches) and the decode's combine,
    #         2 MLA backwards and their id ordering, the attention score recompute and its dense form, and
    #         the row scatter-add of each deterministic backward (D 64 and 576)
    assert lines[-1].endswith(f"{n_small} cached, 0 to build (dry run: nothing compiled)")


SERVING_OPS = {"compactify", "local_to_global", "kv_fp8_codec", "lightning_indexer_score", "lightning_indexer_topk",
               "indexer_scores_mask_lse", "indexer_topk", "sparse_attention_fwd", "sparse_attention_combine"}


def test_serving_keeps_the_forward_kernels_and_leaves_training_out():
    full = specs_for_model(DEEPSEEK_V32, "sm_90a")
    serving = specs_for_model(DEEPSEEK_V32, "sm_90a", serving=True)
    assert serving == [s for s in full if s.op in SERVING_OPS]              # a subset, in the same order
    assert {s.op for s in serving} == SERVING_OPS
    assert {s.op for s in full} - SERVING_OPS == {
        "sparse_indexer_score_recompute", "indexer_backward", "row_scatter_add", "dense_indexer_backward",
        "sparse_attention_bwd", "sparse_attention_bwd_order", "sparse_attn_score_recompute",
        "dense_attn_score_recompute"}
    assert get_preset("deepseek-v3.2", "sm_90a", serving=True) == serving
    assert missing_ops("deepseek-v3.2", "sm_100a", serving=True) == sorted(SERVING_OPS - {"compactify",
                                                                                         "local_to_global"})


def test_build_serving_dry_run_lists_only_the_serving_kernels(cache_env, capsys):
    assert main(["build", "--model", str(EXAMPLE), "--serving", "--dry-run", "--arch", "sm_90a"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = len(specs_for_model(DEEPSEEK_V32, "sm_90a", serving=True))
    assert lines[-1] == f"{n} kernel(s): 0 cached, {n} to build (dry run: nothing compiled)"
    assert main(["build", "--spec", json.dumps({"op": "compactify", "fields": {"arch": "sm_90a"}}),
                 "--serving"]) == 2
    assert "--serving selects among the kernels of a --preset or --model" in capsys.readouterr().err
    assert not cache_env.exists()
