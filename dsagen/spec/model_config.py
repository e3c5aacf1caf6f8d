"""From a model to its kernels: the attention facts of a DeepSeek sparse-attention model and the one function,
`specs_for_model`, that turns them into every kernel spec the model needs on an arch.

    from dsagen.spec.model_config import load_model_config, specs_for_model
    model = load_model_config("examples/deepseek-v3.2-config.json")   # a Hugging Face-style config.json
    specs = specs_for_model(model, "sm_90a")

The deepseek-v3.2 preset is `specs_for_model(DEEPSEEK_V32, arch)` and `dsagen build --model CONFIG.json` is
`specs_for_model(load_model_config(CONFIG.json), arch)`: a kernel family added to `specs_for_model` is built for
both.

Fields read from the config (every other field is ignored):

| config field          | meaning                                           | kernels                                  |
|-----------------------|---------------------------------------------------|------------------------------------------|
| `num_attention_heads` | query heads of the sparse MLA (1..128)            | sparse MLA: 64 heads (<= 64) or 128      |
| `kv_lora_rank`        | latent width: d_v, and d_qk without RoPE (512)    | sparse MLA: d_v = 512                    |
| `qk_rope_head_dim`    | RoPE width added to d_qk (0 or 64)                | sparse MLA: d_qk = 512 or 576            |
| `index_n_heads`       | lightning-indexer heads (8, 16, 32, 64, 128)      | indexer score kernel                     |
| `index_head_dim`      | lightning-indexer head dim (64, 128)              | indexer score kernel                     |
| `index_topk`          | selected keys per query (>= 1; a run-time value)  | none (checked only)                      |
| `torch_dtype`         | activation dtype, "bfloat16" or "float16" (or `dtype`) | every attention kernel              |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..kernels.indices.spec import CompactifySpec, LocalToGlobalSpec
from ..kernels.kv_fp8.spec import KvFp8CodecSpec
from ..kernels.lightning_indexer.spec import INDEXER_DTYPES, INDEXER_HEAD_DIMS, INDEXER_HEADS
from ..kernels.lightning_indexer.spec import INDEXER_FP8_DTYPE, config_for as indexer_config
from ..kernels.lightning_indexer.spec import decode_config_for, forward_topk_config_for, scores_config_for
from ..kernels.attn_score_recompute.spec import config_for as attn_score_recompute_config
from ..kernels.attn_score_recompute.spec import dense_config_for as dense_attn_score_recompute_config
from ..kernels.indexer_bwd.spec import config_for as indexer_bwd_config
from ..kernels.indexer_bwd.spec import dense_config_for as dense_indexer_bwd_config
from ..kernels.indexer_score_recompute.spec import config_for as indexer_score_recompute_config
from ..kernels.indexer_topk.spec import config_for as indexer_topk_config
from ..kernels.row_scatter_add.spec import RowScatterAddSpec
from ..kernels.sparse_mla.spec import SparseAttnCombineSpec
from ..kernels.sparse_mla.spec import config_for as sparse_mla_config
from ..kernels.sparse_mla.spec import kernel_heads
from ..kernels.sparse_mla_bwd.spec import SparseAttnBwdOrderSpec
from ..kernels.sparse_mla_bwd.spec import config_for as sparse_mla_bwd_config
from .arch import ARCHES, get_arch
from .base import KernelSpec, SpecError, read_capped

#: Query heads the fused sparse MLA serves: 64 and 128 natively, fewer zero-padded by the op's host code to 64 or
#: 128 (kernel_heads).
MLA_MAX_HEADS = 128
MLA_KV_LORA_RANKS = (512,)
MLA_ROPE_DIMS = (0, 64)
DTYPES = ("bfloat16", "float16")
MAX_TOPK = 2 ** 31 - 1

#: config field -> what it is (the order of the error messages and of the README table)
FIELDS = {
    "num_attention_heads": f"query heads of the sparse MLA (1..{MLA_MAX_HEADS})",
    "kv_lora_rank": f"latent width of the MLA ({', '.join(map(str, MLA_KV_LORA_RANKS))})",
    "qk_rope_head_dim": f"RoPE width of the MLA's queries and keys ({' or '.join(map(str, MLA_ROPE_DIMS))})",
    "index_n_heads": f"lightning-indexer heads ({', '.join(map(str, INDEXER_HEADS))})",
    "index_head_dim": f"lightning-indexer head dim ({', '.join(map(str, INDEXER_HEAD_DIMS))})",
    "index_topk": "keys each query selects (>= 1)",
    "torch_dtype": f"activation dtype ({' or '.join(DTYPES)}; newer configs call it 'dtype')",
}


class ModelConfigError(SpecError):
    """A model config dsagen cannot build kernels for: not a JSON object, a missing field, a value of the wrong
    type, or a value no kernel serves. The message names the config and the field."""


#: The heads of the sparse MLA kernel that serves `num_heads` query heads: 64 (fewer are padded) or 128.
mla_kernel_heads = kernel_heads


@dataclass(frozen=True)
class ModelAttention:
    """The attention facts of a DeepSeek sparse-attention model that decide which kernels it needs.

    num_heads: query heads of the sparse MLA (`num_attention_heads`).
    kv_lora_rank: the latent width (the absorbed MLA's d_v, and its d_qk without RoPE).
    qk_rope_head_dim: the RoPE width (d_qk = kv_lora_rank + qk_rope_head_dim).
    index_n_heads / index_head_dim / index_topk: the lightning indexer's heads, head dim and top-k width.
    dtype: "bfloat16" or "float16".
    """

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    dtype: str

    @property
    def d_qk(self) -> int:
        """Query/key width of the absorbed sparse MLA (latent + RoPE)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        """Value/output width of the absorbed sparse MLA (the latent width)."""
        return self.kv_lora_rank

    def type_problems(self) -> list[str]:
        """Every field not of its exact type (an int field holding a bool or a float, a dtype that is not a str),
        as sentences naming the field; [] when all are. 64.0 or True would pass the range checks below and then
        reach the kernel specs, whose fields are exact ints."""
        out = []
        for name, kind, words in _FIELD_TYPES:
            v = getattr(self, name)
            if type(v) is not kind:
                out.append(f"{name} must be {words}, got {_shown(v)}")
        return out

    def problems(self) -> list[str]:
        """Every value no kernel serves, as 'field=value: why' sentences naming the config field; [] when fine.
        A mistyped field is reported alone (type_problems): the range checks compare values of the right type."""
        out = self.type_problems()
        if out:
            return out
        if not 1 <= self.num_heads <= MLA_MAX_HEADS:
            out.append(f"num_attention_heads: {self.num_heads} query heads per GPU, but the sparse MLA kernels serve "
                       f"1..{MLA_MAX_HEADS} (64 and 128 natively, fewer padded); with tensor parallelism give the GPU "
                       f"count (dsagen build --tp N)")
        if self.kv_lora_rank not in MLA_KV_LORA_RANKS:
            out.append(f"kv_lora_rank={self.kv_lora_rank}: the sparse MLA kernels need "
                       f"{' or '.join(map(str, MLA_KV_LORA_RANKS))} (d_v, two 256-column halves)")
        if self.qk_rope_head_dim not in MLA_ROPE_DIMS:
            out.append(f"qk_rope_head_dim={self.qk_rope_head_dim}: the sparse MLA kernels need "
                       f"{' or '.join(map(str, MLA_ROPE_DIMS))} (d_qk = kv_lora_rank + qk_rope_head_dim = 512 or 576)")
        if self.index_n_heads not in INDEXER_HEADS:
            out.append(f"index_n_heads={self.index_n_heads}: the lightning-indexer kernels serve "
                       f"{', '.join(map(str, INDEXER_HEADS))} heads")
        if self.index_head_dim not in INDEXER_HEAD_DIMS:
            out.append(f"index_head_dim={self.index_head_dim}: the lightning-indexer kernels serve head dims "
                       f"{', '.join(map(str, INDEXER_HEAD_DIMS))}")
        if not 1 <= self.index_topk <= MAX_TOPK:
            out.append(f"index_topk={self.index_topk}: must be in 1..{MAX_TOPK}")
        if self.dtype not in DTYPES or self.dtype not in INDEXER_DTYPES:
            out.append(f"torch_dtype={self.dtype!r}: the attention kernels run {' or '.join(DTYPES)}")
        return out

    def check(self, where: str = "model config") -> "ModelAttention":
        """Return self, or raise ModelConfigError listing every problem (see `problems`)."""
        p = self.problems()
        if p:
            raise ModelConfigError(f"{where}: " + "; ".join(p))
        return self


#: (field, exact type, words for a message) of every ModelAttention field
_FIELD_TYPES = tuple((f.name, str, "a str") if f.name == "dtype" else (f.name, int, "an int")
                     for f in fields(ModelAttention))


def _shown(v: Any) -> str:
    """`v` as JSON where it can be (as a config spells it), else its repr; cut to 40 characters."""
    try:
        return json.dumps(v)[:40]
    except (TypeError, ValueError):
        return repr(v)[:40]


#: DeepSeek-V3.2 (DSA): MLA with 128 query heads, latent 512 + RoPE 64; indexer with 64 heads of 128, top-2048; bf16.
DEEPSEEK_V32 = ModelAttention(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, index_n_heads=64,
                              index_head_dim=128, index_topk=2048, dtype="bfloat16")


def specs_for_model(model: ModelAttention, arch: str, serving: bool = False) -> list[KernelSpec]:
    """Every kernel spec `model` needs on `arch`, validated, in a fixed order without duplicates.

    One line (or block) per kernel family, each built by the family's own `config_for(...)`: the preset and
    `dsagen build --model` both come through here. A family that has no kernel for `arch` yet adds nothing
    there (`missing_ops_for_model` names its ops). To add a family: append its specs below, guarded by the
    arches it exists for, and by `not serving` when only training runs it.

    serving: only the kernels of the forward ops a serving deployment runs (the index post-processing, the
    lightning indexer, the dense indexer forward and combined indexer + top-k, the standalone top-k, the sparse MLA
    forward); the training kernels (the backwards, the score recomputes, the dense warm-up kernels) are left out.
    """
    model.check()
    get_arch(arch)
    hopper = arch == "sm_90a"
    out: list[KernelSpec] = [
        # top-k index post-processing (every arch)
        CompactifySpec(arch=arch),
        LocalToGlobalSpec(arch=arch),
    ]
    if hopper:
        # the FP8 MLA KV cache's writer and reader (quantize_kv_fp8 / dequantize_kv_fp8: serving appends tokens)
        out.extend(KvFp8CodecSpec(arch=arch, dequantize=d) for d in (False, True))
    if hopper:
        # lightning indexer: one score kernel + the top-k plan's kernels serve every topk and compress ratio
        out.extend(indexer_config(model.index_n_heads, model.index_head_dim, model.dtype, arch).specs())
        # dense indexer forward (indexer_scores) and the combined indexer + top-k (indexer_forward_topk), in the
        # model's dtype and in FP8 (E4M3 at head dim 128, as serving stacks run the indexer)
        for dtype in (model.dtype,) + ((INDEXER_FP8_DTYPE,) if model.index_head_dim == 128 else ()):
            out.extend(scores_config_for(model.index_n_heads, model.index_head_dim, dtype, arch).specs())
            out.extend(forward_topk_config_for(model.index_n_heads, model.index_head_dim, dtype, arch).specs())
            # ... and the decode-time indexer over a paged key cache (indexer_decode_topk: the same top-k kernels)
            if dtype in ("bfloat16", INDEXER_FP8_DTYPE):
                out.extend(decode_config_for(model.index_n_heads, model.index_head_dim, dtype, arch).specs())
        # standalone indexer top-k (any width; its plan's kernels serve every row length)
        out.extend(indexer_topk_config(arch).specs())
    if hopper and not serving:
        # sparse indexer score recompute (the indexer's distribution over the selected slots, for its KL loss)
        hi = kernel_heads(model.index_n_heads)
        out.append(indexer_score_recompute_config(hi, model.index_head_dim, model.dtype, arch, None)
                   .spec(hi, model.index_head_dim, model.dtype, arch))
        # sparse indexer backward (64 heads natively, fewer padded): atomic d_index_k and the deterministic kernel
        if model.index_n_heads <= 64:
            for deterministic in (False, True):
                out.append(indexer_bwd_config(model.index_head_dim, model.dtype, arch, None)
                           .spec(model.index_head_dim, model.dtype, arch, deterministic=deterministic))
            # ... whose deterministic d_index_k rows the row scatter-add sums
            out.append(RowScatterAddSpec(arch=arch, width=model.index_head_dim))
            # dense indexer backward (the dense warm-up stage; its scores come from indexer_scores' kernels):
            # atomic d_index_k and the deterministic kernel (per-slot rows the host sums)
            for deterministic in (False, True):
                out.append(dense_indexer_bwd_config(model.index_head_dim, model.dtype, arch, None)
                           .spec(model.index_head_dim, model.dtype, arch, deterministic=deterministic))
            # ... and the fused loss path's (dense_indexer_kl_backward): the atomic kernel that also sums the loss
            out.append(dense_indexer_bwd_config(model.index_head_dim, model.dtype, arch, None)
                       .spec(model.index_head_dim, model.dtype, arch, kl_loss=True))
    if hopper:
        # sparse MLA forward: one kernel for prefill and decode (config_for: one config for every call size)
        h = mla_kernel_heads(model.num_heads)
        out.append(sparse_mla_config(h, model.d_qk, model.dtype, None, arch, None)
                   .spec(h, model.d_qk, model.dtype, arch, d_v=model.d_v))
        # ... and its lse_prefix kernel, which also returns lse_indexer (sparse_attention(..., indexer_topk=N))
        out.append(sparse_mla_config(h, model.d_qk, model.dtype, None, arch, None)
                   .spec(h, model.d_qk, model.dtype, arch, d_v=model.d_v, lse_prefix=True))
        # ... and sparse_attention_decode's (bf16 q of 576): the kernel over DeepSeek-V3.2's FP8 KV cache, the
        # split_kv kernels of both caches (the split over the KV slots of small batches) and their combine kernel
        if model.d_qk == 576 and model.d_v == 512 and model.dtype == "bfloat16":
            out.append(sparse_mla_config(h, 576, "bfloat16", None, arch, None, kv_fp8=True)
                       .spec(h, 576, "bfloat16", arch, kv_fp8=True))
            for kv_fp8 in (False, True):
                out.append(sparse_mla_config(h, 576, "bfloat16", None, arch, None, kv_fp8)
                           .spec(h, 576, "bfloat16", arch, kv_fp8=kv_fp8, split_kv=True))
            out.append(SparseAttnCombineSpec(arch=arch))
    if hopper and not serving:
        h = mla_kernel_heads(model.num_heads)
        # sparse MLA backward: the atomic kernel autograd runs by default and the deterministic one it runs under
        # torch.use_deterministic_algorithms
        for deterministic in (False, True):
            out.append(sparse_mla_bwd_config(h, model.d_qk, model.dtype, arch, None)
                       .spec(h, model.d_qk, model.dtype, arch, d_v=model.d_v, deterministic=deterministic))
        # ... and the ordering of its ids by KV window
        out.append(SparseAttnBwdOrderSpec(arch=arch))
        # ... and the row scatter-add that sums its deterministic dkv rows
        out.append(RowScatterAddSpec(arch=arch, width=model.d_qk))
        # sparse attention score recompute (the indexer's training target)
        out.append(attn_score_recompute_config(h, model.d_qk, model.dtype, arch, None)
                   .spec(h, model.d_qk, model.dtype, arch))
        # ... and its dense form (the dense warm-up stage's target)
        out.append(dense_attn_score_recompute_config(h, model.d_qk, model.dtype, arch, None)
                   .spec(h, model.d_qk, model.dtype, arch))
    return [s.check() for s in dict.fromkeys(out)]


def missing_ops_for_model(model: ModelAttention, arch: str, serving: bool = False) -> list[str]:
    """The ops `model` has kernels for on some arch but not on `arch`, sorted ([] when none); `serving` as for
    specs_for_model."""
    everywhere = {s.op for a in ARCHES for s in specs_for_model(model, a, serving)}
    return sorted(everywhere - {s.op for s in specs_for_model(model, arch, serving)})


def _int_field(config: dict, name: str, where: str) -> int:
    v = config[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelConfigError(f"{where}: field {name!r} must be an integer ({FIELDS[name]}), got {json.dumps(v)[:40]}")
    return v


def model_from_config(config: Any, where: str = "model config", tensor_parallel: int = 1) -> ModelAttention:
    """The checked ModelAttention of a Hugging Face-style config dict (config.json of a DeepSeek sparse-attention
    model) for one GPU of `tensor_parallel` GPUs that split the sparse MLA's query heads (num_attention_heads /
    tensor_parallel heads each; the indexer's heads are not split). Only the fields in FIELDS are read;
    ModelConfigError names every missing field, or the first field of a wrong type, or every value no kernel
    serves."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ModelConfigError(f"--tp {tensor_parallel!r}: give the number of GPUs (>= 1) that split the heads")
    if not isinstance(config, dict):
        raise ModelConfigError(f"{where}: a model config is a JSON object (a Hugging Face config.json), "
                               f"got {type(config).__name__}")
    dtype_key = "torch_dtype" if "torch_dtype" in config else "dtype"
    missing = [n for n in FIELDS if n not in config and not (n == "torch_dtype" and "dtype" in config)]
    if missing:
        listed = "; ".join(f"{n} ({FIELDS[n]})" for n in missing)
        raise ModelConfigError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {listed}. dsagen builds "
                               f"from the config of a DeepSeek sparse-attention model (e.g. "
                               f"examples/deepseek-v3.2-config.json)")
    dtype = config[dtype_key]
    if not isinstance(dtype, str):
        raise ModelConfigError(f"{where}: field {dtype_key!r} must be a string ({FIELDS['torch_dtype']}), "
                               f"got {json.dumps(dtype)[:40]}")
    heads = _int_field(config, "num_attention_heads", where)
    if heads % tensor_parallel:
        raise ModelConfigError(f"{where}: num_attention_heads={heads} does not split evenly over --tp "
                               f"{tensor_parallel} GPUs")
    model = ModelAttention(
        num_heads=heads // tensor_parallel,
        kv_lora_rank=_int_field(config, "kv_lora_rank", where),
        qk_rope_head_dim=_int_field(config, "qk_rope_head_dim", where),
        index_n_heads=_int_field(config, "index_n_heads", where),
        index_head_dim=_int_field(config, "index_head_dim", where),
        index_topk=_int_field(config, "index_topk", where),
        dtype=dtype.removeprefix("torch."))
    return model.check(where)


def load_model_config(path: str | Path, tensor_parallel: int = 1) -> ModelAttention:
    """The checked ModelAttention of the config file `path` (see `model_from_config`); ModelConfigError when the
    file is not UTF-8 JSON, OSError when it cannot be read."""
    where = f"--model {path}"
    raw = read_capped(path, where, ModelConfigError)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ModelConfigError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    return model_from_config(data, where, tensor_parallel)


__all__ = ["ModelAttention", "ModelConfigError", "DEEPSEEK_V32", "FIELDS", "specs_for_model", "missing_ops_for_model",
           "model_from_config", "load_model_config", "mla_kernel_heads"]
