"""The kernels the GPU tests need, as a plain data file: `required_specs.json` beside this script, the union of
the REQUIRED_SPECS of every tests/gpu/test_*.py module (canonical specs, sorted, no duplicates).

The command line never executes test modules; it builds from the data file:

    dsagen build --spec-file tests/gpu/required_specs.json          # CPU machine, then ship the cache

    python tests/gpu/required_specs.py           # exit 1 when the file is stale
    python tests/gpu/required_specs.py --write   # regenerate it after changing a test's REQUIRED_SPECS

tests/test_required_specs.py fails on CPU when the file and the tests disagree.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "required_specs.json"


def collect() -> list[dict]:
    """The canonical dicts of every REQUIRED_SPECS entry of the tests/gpu test modules, sorted, unique."""
    from dsagen.spec import KernelSpec

    seen: dict[str, dict] = {}
    sys.path.insert(0, str(HERE))  # the modules import their sibling helpers, as under pytest
    try:
        for f in sorted(HERE.glob("test_*.py")):
            spec = importlib.util.spec_from_file_location(f"_required_specs_{f.stem}", f)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            req = getattr(mod, "REQUIRED_SPECS", [])
            for s in (req() if callable(req) else req):
                if not isinstance(s, KernelSpec):
                    raise TypeError(f"{f.name}: REQUIRED_SPECS holds {s!r:.60}, not a KernelSpec")
                seen[s.check().canonical_json()] = s.canonical()
    finally:
        sys.path.remove(str(HERE))
    return [seen[k] for k in sorted(seen)]


def render(specs: list[dict]) -> str:
    """The data file's text: one canonical spec per line inside a JSON list."""
    return "[\n" + ",\n".join(json.dumps(s, sort_keys=True, separators=(",", ":")) for s in specs) + "\n]\n"


def main(argv: list[str]) -> int:
    specs = collect()
    text = render(specs)
    if "--write" in argv:
        DATA.write_text(text)
        print(f"wrote {DATA} ({len(specs)} specs)")
        return 0
    if not DATA.exists() or DATA.read_text() != text:
        print(f"{DATA} is stale: run python {__file__} --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
