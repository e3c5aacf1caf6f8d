"""DeepSeek-V3.2's FP8 MLA KV cache format (656 bytes per token): the writer and reader kernels on sm_90a
(codec_sm90.py), their spec (spec.py) and host launch (host.py)."""
