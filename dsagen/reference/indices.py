"""Reference implementations of the top-k index utilities of cuDNN frontend DSA:
compactify_wrapper and local_to_global_wrapper."""

from __future__ import annotations

import torch


def compactify(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable compaction of each row. See dsagen.compactify for the contract.

    topk_idxs: (rows, K) int32; topk_length: (rows,) int or None. Returns ((rows, K) int32, (rows,) int32).
    """
    rows, k = topk_idxs.shape
    valid = topk_idxs >= 0
    if topk_length is not None:
        slot = torch.arange(k, device=topk_idxs.device)
        valid &= slot[None, :] < topk_length.to(torch.int64)[:, None]
    # a stable sort of "invalid" flags keeps valid ids in their original order, in front
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    moved = torch.gather(topk_idxs, 1, order)
    lengths = valid.sum(dim=1, dtype=torch.int32)
    keep = torch.arange(k, device=topk_idxs.device)[None, :] < lengths[:, None]
    out = torch.where(keep, moved, torch.full_like(moved, -1))
    return out.to(torch.int32).contiguous(), lengths


def local_to_global(topk_idxs: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """`b * seqlen_k + x` for 0 <= x < seqlen_k, else -1. topk_idxs: (B, S_q, K) int32."""
    b = torch.arange(topk_idxs.shape[0], device=topk_idxs.device, dtype=torch.int64).view(-1, 1, 1)
    x = topk_idxs.to(torch.int64)
    ok = (x >= 0) & (x < seqlen_k)
    return torch.where(ok, b * seqlen_k + x, torch.full_like(x, -1)).to(torch.int32)
