"""Hand-written CuTe-DSL device helpers imported by rendered kernel modules; each one a module imported
as `from dsagen.kernels.<name> import ...` (its source hash is part of every importing kernel's cache key)."""
