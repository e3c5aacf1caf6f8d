"""The public API: every op resolves from `dsagen`, is documented (shapes, returns, errors) and typed."""

from __future__ import annotations

import inspect

import pytest

import dsagen


@pytest.mark.parametrize("name", dsagen.__all__)
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
