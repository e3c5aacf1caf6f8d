"""Valid cache entries without a compiler: a fake source and cubin under the real key and identity
materials of a spec, so that every store check (schema, key re-derivation, folder agreement) passes."""

from __future__ import annotations

from dsagen.jit.keys import identity_material, identity_of, key_material, key_of
from dsagen.kernel_record import kernel_record_sha256
from dsagen.spec import CompactifySpec

TC = {"nvidia-cutlass-dsl": "4.8.1"}
KERNEL_RECORD = {"symbol": "kernel_0", "params": [],
                 "launch": {"grid": ["1", "1", "1"], "block": [128, 1, 1], "cluster": [1, 1, 1], "smem": 0},
                 "regcount": 32, "static_smem": 0}


def fake_entry(spec=None, source: str = "src", cubin: bytes = b"cubin-bytes", toolchain: dict = TC,
               created: str = "2026-01-01T00:00:00+00:00"):
    """(key, files, manifest) of a self-consistent entry for `spec` (CompactifySpec by default) whose
    source is `source`: ready for `store.commit(spec.arch, spec.op, key, files, manifest)`."""
    spec = spec or CompactifySpec(arch="sm_90a")
    material = key_material(spec, source, toolchain)
    key = key_of(material)
    files = {"kernel.cubin": cubin, "kernel.py": source.encode()}
    manifest = {"schema": material["schema"], "identity": identity_of(spec),
                "identity_material": identity_material(spec), "key_material": material, "op": spec.op,
                "name": spec.name(), "spec": spec.canonical(), "toolchain": material["toolchain"],
                "created": created, "compile_seconds": 0.0, "kernel": dict(KERNEL_RECORD),
                "kernel_sha256": kernel_record_sha256(KERNEL_RECORD)}
    return key, files, manifest


def commit_fake(store, spec=None, **kw):
    """Commit a `fake_entry` into the writable root of `store` under its lock; returns the Entry."""
    spec = spec or CompactifySpec(arch="sm_90a")
    key, files, manifest = fake_entry(spec, **kw)
    with store.lock(key):
        return store.commit(spec.arch, spec.op, key, files, manifest)
