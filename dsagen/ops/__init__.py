"""The torch-facing public ops: input validation, then dispatch to dsagen.reference (impl="reference")
or dsagen.fused (impl="fused")."""
