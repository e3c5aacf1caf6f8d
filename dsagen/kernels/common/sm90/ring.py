"""The mbarrier ring that hands tiles from a producer to its consumers: STAGES buffers, each with a ready and a
free mbarrier. Tile g, counted over the CTA's whole item loop (cta.py), goes to stage s = g % STAGES and is that
stage's use u = g // STAGES:

  producer   waits free[s] with parity (u % 2) ^ 1 (`ring_wait_free`; the first use of a stage passes at once),
             fills the stage and makes ready[s] complete (cp.async noinc arrivals, or a TMA transaction count);
  consumers  wait ready[s] with parity u % 2 (`ring_wait_ready`), read the stage, and arrive on free[s] after their
             last read of it retired.

The arrival counts are the kernel's (`ring_mbarriers` lists them for cta.init_mbarriers).
"""

import cutlass.cute as cute


def ring_mbarriers(kv_ready, kv_free, stages: int, ready_count: int, free_count: int) -> list:
    """The (mbarrier, arrivals) pairs of a ring of `stages` stages for cta.init_mbarriers, in the order kv_ready[0],
    kv_free[0], kv_ready[1], ...: kv_ready[s] expects ready_count arrivals (a cp.async ring: the producer's 128
    noinc arrivals plus any metadata arrivals; a TMA ring: 1), kv_free[s] free_count (the consumer threads or
    warps that arrive)."""
    out = []
    for s in range(stages):
        out += [(kv_ready + s, ready_count), (kv_free + s, free_count)]
    return out


@cute.jit
def ring_wait_free(free, g, stages: int) -> None:
    """Producer: wait until the consumers freed tile g's stage (free[g % stages]) of its previous use."""
    cute.arch.mbarrier_wait(free + g % stages, ((g // stages) % 2) ^ 1)


@cute.jit
def ring_wait_ready(ready, g, stages: int) -> None:
    """Consumer: wait until tile g is in its stage (ready[g % stages])."""
    cute.arch.mbarrier_wait(ready + g % stages, (g // stages) % 2)
