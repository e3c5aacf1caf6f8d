"""Compare the SASS instruction mix of the kernels in two caches: for every spec built in both (matched by op and
spec fields, so a refactor that changes the sources and keys still pairs up), the opcode counts with their full
modifiers (HGMMA.64x64x16.F32.BF16, LDGSTS.E.BYPASS.128, ...) and the register count. Prints the specs whose mix
differs and exits 1 if any does. Specs pair up without the fields that hold their spec class's default value, so a
field added with a default that keeps the old code pairs the new entries with those built before it.

    python scripts/sass_mix.py OLD_CACHE NEW_CACHE [--exact]

--exact compares the instruction sequence (opcodes with modifiers, in order) instead of the counts.
Needs nvdisasm (pip install nvidia-cuda-nvdisasm).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

from dsagen.jit.sass import disassemble

_INSTR_RE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _defaults(op: str) -> dict:
    """The default field values of op's spec class ({} for an op this dsagen does not know)."""
    from dsagen.spec import spec_types

    cls = spec_types().get(op)
    if cls is None:
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def pairing_key(op: str, spec: dict) -> str:
    """The key two caches' entries pair up by: op and the spec fields (a manifest's canonical spec: {"op", "fields"})
    that differ from their class's default."""
    defaults = _defaults(op)
    fields = {k: v for k, v in spec.get("fields", spec).items() if k not in defaults or defaults[k] != v}
    return json.dumps({"op": op, "spec": fields}, sort_keys=True)


def entries(root: Path) -> dict[str, tuple[dict, Path]]:
    """{pairing_key: (manifest, entry folder)} of every entry under root/v1."""
    out = {}
    for m in sorted(root.glob("v1/*/*/*/*/manifest.json")):
        man = json.loads(m.read_text())
        out[pairing_key(man["op"], man["spec"])] = (man, m.parent)
    return out


def instructions(entry: Path) -> list[str]:
    """The entry's SASS instructions (opcode with modifiers), in order."""
    return _INSTR_RE.findall(disassemble((entry / "kernel.cubin").read_bytes()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--exact", action="store_true", help="compare the instruction sequence, not the counts")
    args = ap.parse_args()
    old, new = entries(args.old), entries(args.new)
    differ = 0
    for key in sorted(old.keys() & new.keys()):
        (m_old, e_old), (m_new, e_new) = old[key], new[key]
        i_old, i_new = instructions(e_old), instructions(e_new)
        regs = (m_old["kernel"].get("regcount"), m_new["kernel"].get("regcount"))
        same = i_old == i_new if args.exact else collections.Counter(i_old) == collections.Counter(i_new)
        if same and regs[0] == regs[1]:
            continue
        differ += 1
        print(f"{m_new['name']}: {len(i_old)} -> {len(i_new)} instructions, registers {regs[0]} -> {regs[1]}")
        c_old, c_new = collections.Counter(i_old), collections.Counter(i_new)
        for op in sorted(c_old.keys() | c_new.keys()):
            if c_old[op] != c_new[op]:
                print(f"    {op:40s} {c_old[op]:6d} -> {c_new[op]:6d}")
    only = (old.keys() ^ new.keys())
    print(f"{len(old.keys() & new.keys())} kernels compared, {differ} differ, {len(only)} in one cache only")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
