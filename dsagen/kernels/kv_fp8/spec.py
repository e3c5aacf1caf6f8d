"""Spec of the FP8 MLA KV cache codec (dsagen.quantize_kv_fp8 / dsagen.dequantize_kv_fp8 with impl="fused")."""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.base import KernelSpec, register_spec


@register_spec
@dataclass(frozen=True)
class KvFp8CodecSpec(KernelSpec):
    """The writer (dequantize=False: bf16 [N, 576] -> the cache bytes [N, 656]) or the reader (dequantize=True) of
    dsagen/reference/kv_cache.py's token format, byte for byte (kernel: kv_fp8/codec_sm90.py). One warp per token,
    4 per CTA: lane l takes NoPE values 16 l .. 16 l + 15 (tile l // 8) and, for l < 8, 16 bytes of the RoPE values.
    Token count and row strides are run-time arguments."""

    op = "kv_fp8_codec"
    template = "kv_fp8/codec_{arch}.py.j2"

    dequantize: bool = False

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.arch != "sm_90a":
            out.append(f"the FP8 KV cache codec is implemented for sm_90a only, not {self.arch}")
        return out
