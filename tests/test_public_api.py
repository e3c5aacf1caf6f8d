"""The public API: every op resolves from `dsagen`, is documented (shapes, returns, errors) and typed;
every error dsagen raises on purpose derives from `dsagen.DsagenError` and its expected builtin."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import dsagen

OPS = sorted(dsagen._OPS)
HELPERS = sorted(dsagen._HELPERS)


def test_all_lists_the_ops_helpers_and_the_error_base():
    assert dsagen.__all__ == ["DsagenError", *OPS, *HELPERS] and len(OPS) >= 17
    assert all(n[0].islower() for n in OPS + HELPERS)
    assert not set(OPS) & set(HELPERS)
    assert "sparse_attention_backward" in OPS and "sparse_attention_backward_workspace" in HELPERS
    assert set(dir(dsagen)) >= set(dsagen.__all__)


@pytest.mark.parametrize("name", HELPERS)
def test_public_helper_is_documented_and_typed(name):
    fn = getattr(dsagen, name)
    doc = inspect.getdoc(fn) or ""
    assert len(doc) > 300, f"{name}: docstring too short to state shapes, dtypes and errors"
    assert "Raises" in doc and "Returns" in doc, f"{name}: docstring does not say what it returns and raises"
    sig = inspect.signature(fn)
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    unannotated = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not unannotated, f"{name}: parameters without annotations: {unannotated}"


def test_sparse_attention_backward_signature():
    """The backward takes the forward's arguments plus out, dout and lse, and the fused kernel's options."""
    sig = inspect.signature(dsagen.sparse_attention_backward)
    assert list(sig.parameters) == ["q", "kv", "out", "dout", "lse", "topk_idxs", "attn_sink", "topk_length",
                                    "softmax_scale", "d_v", "deterministic", "workspace", "impl"]
    kw_only = [p for p, v in sig.parameters.items() if v.kind is inspect.Parameter.KEYWORD_ONLY]
    assert kw_only == list(sig.parameters)[6:]
    defaults = {p: v.default for p, v in sig.parameters.items() if p in kw_only}
    assert defaults == dict(attn_sink=None, topk_length=None, softmax_scale=None, d_v=None, deterministic=False,
                            workspace=None, impl="fused")
    doc = inspect.getdoc(dsagen.sparse_attention_backward)
    for needle in ("cuDNN frontend DSA §2", "deterministic", "workspace", "sparse_attention_backward_workspace",
                   "FP32", "batched", "NotImplementedError"):
        assert needle in doc, needle


@pytest.mark.parametrize("name", OPS)
def test_public_op_is_documented_and_typed(name):
    fn = getattr(dsagen, name)
    doc = inspect.getdoc(fn) or ""
    assert len(doc) > 300, f"{name}: docstring too short to state shapes, dtypes and errors"
    assert "Raises" in doc or "raises" in doc, f"{name}: docstring does not say what it raises"
    assert "impl" in doc, f"{name}: docstring does not describe impl"
    sig = inspect.signature(fn)
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    unannotated = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not unannotated, f"{name}: parameters without annotations: {unannotated}"
    assert "impl" in sig.parameters and sig.parameters["impl"].default == "fused"


def test_unknown_attribute_raises():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dsagen.nope  # noqa: B018


def test_dsagen_error_is_exported_without_importing_torch_or_the_dsl():
    code = ("import sys, dsagen; e = dsagen.DsagenError; import dsagen.errors as m; assert e is m.DsagenError; "
            "print(sorted(x for x in sys.modules if x.split('.')[0] in ('torch', 'cutlass', 'cuda', 'jinja2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _error_classes():
    from dsagen.store.pack import PackError
    from dsagen.jit.resolver import KernelNotCached
    from dsagen.store.store import CacheCorruption, CacheLockTimeout
    from dsagen.errors import CacheNotStored, CacheRootError, ConfigError
    from dsagen.jit.abi import AbiError
    from dsagen.jit.render import TemplateNotFound
    from dsagen.runtime.driver import CudaDriverError
    from dsagen.runtime.kernel import KernelArchMismatch
    from dsagen.kernel_record import LaunchExprError
    from dsagen.spec import SpecError

    return [(SpecError, ValueError), (TemplateNotFound, LookupError), (AbiError, ValueError),
            (LaunchExprError, ValueError), (KernelArchMismatch, RuntimeError), (CudaDriverError, RuntimeError),
            (ConfigError, ValueError), (CacheRootError, ValueError), (CacheNotStored, RuntimeError),
            (CacheCorruption, RuntimeError), (CacheLockTimeout, TimeoutError), (KernelNotCached, LookupError),
            (PackError, ValueError)]


@pytest.mark.parametrize("cls,builtin", _error_classes(), ids=lambda c: c.__name__)
def test_error_classes_derive_from_dsagen_error_and_their_builtin(cls, builtin):
    assert issubclass(cls, dsagen.DsagenError) and issubclass(cls, builtin)


def test_spec_preset_and_arch_errors_are_dsagen_errors():
    from dsagen.spec import CompactifySpec, get_arch, get_preset, missing_ops

    with pytest.raises(dsagen.DsagenError, match="unknown preset 'nope'; known: deepseek-v3.2"):
        get_preset("nope", "sm_90a")
    with pytest.raises(dsagen.DsagenError, match="unknown arch 'sm_80'"):
        get_arch("sm_80")
    with pytest.raises(ValueError, match="unknown arch 'sm_80'"):
        get_preset("deepseek-v3.2", "sm_80")
    with pytest.raises(dsagen.DsagenError, match="arch 'sm_1' is unknown"):
        CompactifySpec(arch="sm_1").check()
    assert missing_ops("deepseek-v3.2", "sm_90a") == []
    assert missing_ops("deepseek-v3.2", "sm_100a") == [
        "dense_attn_score_recompute", "dense_indexer_backward", "indexer_backward", "indexer_scores_mask_lse",
        "indexer_topk", "kv_fp8_codec",
        "lightning_indexer_score", "lightning_indexer_topk", "row_scatter_add",
        "sparse_attention_bwd", "sparse_attention_bwd_order", "sparse_attention_combine", "sparse_attention_fwd",
        "sparse_attn_score_recompute",
        "sparse_indexer_score_recompute"]
