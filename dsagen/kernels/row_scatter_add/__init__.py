"""The deterministic row scatter-add (acc[target[i]] += rows[i], each row's additions in increasing i): spec.py,
host.py and its generic (arch-independent) kernel module scatter.py."""
