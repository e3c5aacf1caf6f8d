"""Query sparse attention (QSA, FlashInfer QSA): the indexed form's forward kernel on sm_90a (fwd_sm90.py), its spec
(spec.py) and host launch (host.py)."""
