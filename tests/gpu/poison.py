"""Poison torch's caching allocator so that outputs an op allocates with torch.empty start out holding
a known garbage pattern: an element a kernel forgets to write then shows up as that pattern."""

from __future__ import annotations

import torch

POISON_INT32 = 0x5A5A5A5A


def poison_allocator(device: str = "cuda", mbytes: int = 256) -> None:
    """Fill and release `mbytes` MiB of cached device memory with 0x5A bytes."""
    torch.cuda.synchronize()
    blocks = [torch.full((mbytes * 2**20 // 4 // 8,), POISON_INT32, dtype=torch.int32, device=device)
              for _ in range(8)]
    torch.cuda.synchronize()
    del blocks
