"""compactify and local_to_global: spec.py, host.py and their generic (arch-independent) kernel modules."""
