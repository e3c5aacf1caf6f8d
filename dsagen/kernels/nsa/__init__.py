"""Native sparse attention (NSA, ejkernel / fla-org): the selected branch's forward kernel on sm_90a
(select_fwd_sm90.py), its spec (spec.py) and host launch (host.py)."""
