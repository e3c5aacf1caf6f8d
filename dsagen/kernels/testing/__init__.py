"""Runtime probe kernels (TMA, shared memory, clusters) that the runtime's own GPU tests launch."""
