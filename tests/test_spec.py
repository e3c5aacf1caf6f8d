"""The spec layer: validation with actionable reasons, canonical JSON, names, registry, presets."""

from __future__ import annotations

import dataclasses

import pytest

from dsagen.spec import (ARCHES, CompactifySpec, KernelSpec, LocalToGlobalSpec, RuntimeProbeSpec, SpecError,
                         arch_for_capability, get_arch, get_preset, preset_names, spec_types)


def test_valid_spec_has_no_reasons():
    s = CompactifySpec(arch="sm_90a")
    assert s.reasons() == [] and s.can_implement() == (True, "") and s.check() is s


def test_invalid_spec_lists_every_reason():
    s = CompactifySpec(arch="sm_77", warps_per_cta=3)
    ok, why = s.can_implement()
    assert not ok and "sm_77" in why and "warps_per_cta=3" in why and "sm_90a" in why
    with pytest.raises(SpecError, match="warps_per_cta"):
        s.check()


def test_specs_are_frozen_and_hashable():
    s = LocalToGlobalSpec(arch="sm_90a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.threads = 128  # type: ignore[misc]
    assert hash(s) == hash(LocalToGlobalSpec(arch="sm_90a"))


def test_canonical_round_trip_for_every_family():
    for spec in [CompactifySpec(arch="sm_90a", warps_per_cta=4), LocalToGlobalSpec(arch="sm_100a", threads=128),
                 RuntimeProbeSpec(arch="sm_90a", feature="smem", smem_bytes=65536)]:
        c = spec.canonical()
        assert c["op"] == spec.op and list(c["fields"]) == sorted(c["fields"])
        assert KernelSpec.from_canonical(c) == spec


def test_from_canonical_rejects_unknown_op_and_fields():
    with pytest.raises(SpecError, match="unknown op"):
        KernelSpec.from_canonical({"op": "nope", "fields": {}})
    with pytest.raises(SpecError, match="unknown fields"):
        KernelSpec.from_canonical({"op": "compactify", "fields": {"arch": "sm_90a", "seqlen": 4}})


def test_names_are_readable_and_symbols_are_identifiers():
    assert CompactifySpec(arch="sm_90a").name() == "compactify_sm_90a"
    assert CompactifySpec(arch="sm_90a", warps_per_cta=4).name() == "compactify_warps_per_cta4_sm_90a"
    sym = RuntimeProbeSpec(arch="sm_90a", feature="smem", smem_bytes=65536).symbol()
    assert sym.isidentifier() and sym.startswith("dsagen_")


def test_specs_hold_no_run_time_sizes():
    """Sequence lengths, batch sizes and pointers are kernel arguments, never spec fields."""
    forbidden = {"seqlen", "seq_len", "seqlen_k", "seqlen_q", "batch", "batch_size", "ptr", "num_rows", "T", "S"}
    for name, kind in spec_types().items():
        fields = {f.name for f in dataclasses.fields(kind)}
        assert not fields & forbidden, (name, fields & forbidden)


def test_registry_and_arches():
    types = spec_types()
    assert types["compactify"] is CompactifySpec and types["local_to_global"] is LocalToGlobalSpec
    assert get_arch("sm_90a").capability == (9, 0) and "sm_100a" in ARCHES
    assert arch_for_capability((9, 0)).name == "sm_90a"
    with pytest.raises(ValueError, match="unknown arch"):
        get_arch("sm_80")
    with pytest.raises(ValueError, match="no dsagen target"):
        arch_for_capability((8, 0))


def test_presets():
    assert "deepseek-v3.2" in preset_names()
    specs = get_preset("deepseek-v3.2", "sm_90a")
    assert CompactifySpec(arch="sm_90a") in specs and LocalToGlobalSpec(arch="sm_90a") in specs
    assert all(s.arch == "sm_90a" for s in specs)
    with pytest.raises(ValueError, match="unknown preset.*deepseek-v3.2"):
        get_preset("llama", "sm_90a")


def test_probe_spec_validation():
    assert "feature" in RuntimeProbeSpec(arch="sm_90a").can_implement()[1]
    assert "smem_bytes" in RuntimeProbeSpec(arch="sm_90a", feature="smem", smem_bytes=1000).can_implement()[1]
    assert "only meaningful" in RuntimeProbeSpec(arch="sm_90a", feature="tma", smem_bytes=65536).can_implement()[1]
