"""The torch-facing public ops: input validation, then dispatch to dsagen.reference (impl="reference")
or the family host code through dsagen.ops._fused (impl="fused")."""

from . import _registry  # noqa: F401  (defines the torch.ops.dsagen custom ops and their fakes; loads no kernel)
