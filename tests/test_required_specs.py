"""The GPU tests' kernels are listed in tests/gpu/required_specs.json, the file `dsagen build --spec-file` reads:
it must be exactly the union of the test modules' REQUIRED_SPECS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import required_specs  # noqa: E402

from dsagen.spec import KernelSpec  # noqa: E402


def test_the_data_file_lists_exactly_the_specs_the_gpu_tests_require():
    on_file = json.loads(required_specs.DATA.read_text())
    assert required_specs.render(required_specs.collect()) == required_specs.DATA.read_text(), (
        "tests/gpu/required_specs.json is stale: run python tests/gpu/required_specs.py --write")
    assert all(KernelSpec.from_canonical(d).check() for d in on_file)
