"""Read a cubin's SASS with nvdisasm (from the pip package nvidia-cuda-nvdisasm, or on PATH): used by
tests that check a kernel compiled to the instructions it was designed around (HGMMA, LDGSTS, no spills)."""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile

_OPCODE_RE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def find_nvdisasm() -> str | None:
    """The path of an nvdisasm executable, or None."""
    roots = list(site.getsitepackages()) + [os.path.join(sys.prefix, "lib", f"python{sys.version_info[0]}."
                                                                         f"{sys.version_info[1]}", "site-packages")]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin", "nvdisasm")))
        if hits:
            return hits[0]
    return shutil.which("nvdisasm")


def disassemble(cubin: bytes) -> str:
    """The SASS text of `cubin` (`nvdisasm -c`); FileNotFoundError when nvdisasm is missing."""
    tool = find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    """How many times each opcode (without modifiers: HGMMA, LDGSTS, ...) appears in `sass`."""
    return collections.Counter(m.group(1) for m in _OPCODE_RE.finditer(sass))
