"""The racecheck verdict of scripts/sanitize.sh (tests/gpu/sanitizer_probes.py racecheck_verdict): the one explained
hazard pattern (consumer B's pair max read by consumer A after BAR_MAX_B) is recognised at a CTA's own shared
address and at the shared::cluster address racecheck prints for a cluster's CTA of rank 1; any other hazard is
not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("sanitizer_probes",
                                               Path(__file__).parent / "gpu" / "sanitizer_probes.py")
probes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probes)


def _hazard(addr: int, block: int, writer: int, reader: int, kernel: str = "dsagen_sparse_attention_fwd_x_0") -> str:
    return (f"========= Error: Potential RAW hazard detected at __shared__ {addr:#x} in block ({block},0,0) :\n"
            f"=========     Write Thread ({writer},0,0) at {kernel}+0xf3d0\n"
            f"=========     Read Thread ({reader},0,0) at {kernel}+0x194c0\n"
            "=========     Current Value : 17\n=========\n")


def test_pair_max_pattern_in_both_ctas_of_a_cluster():
    log = _hazard(0x618, 0, 288, 160) + _hazard(0x1000618, 1, 288, 160)
    counts, other = probes.racecheck_verdict(log)
    assert counts["dsagen_sparse_attention_fwd"] == 2 and other == []


def test_other_hazards_stay_unexplained():
    log = (_hazard(0x1000400, 1, 288, 160)                 # outside the pair-max window
           + _hazard(0x618, 0, 160, 288)                    # the other direction
           + _hazard(0x618, 0, 288, 160, kernel="dsagen_other_kernel_0"))
    counts, other = probes.racecheck_verdict(log)
    assert sum(counts.values()) == 0 and len(other) == 3
