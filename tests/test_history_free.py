"""The repository speaks only of itself: no tracked text file cites a work session, a GPU call letter, an issue
number or a numbered seed document. Sources are cited by their own names and measurements by their dates."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
EXCLUDED_DIRS = (".ci/",)

#: (what it finds, pattern): a history reference in any tracked text file is a failure naming file:line.
PATTERNS = (
    ("session number", re.compile(r"\bsession[ -]?\d", re.IGNORECASE)),
    ("session number", re.compile(r"\bsessions? \d", re.IGNORECASE)),
    ("GPU call letter", re.compile(r"\bcall [A-Z]\b")),
    ("issue number", re.compile(r"\bissue \d", re.IGNORECASE)),
    ("seed document number", re.compile(r"\bseed 00\d", re.IGNORECASE)),
    ("seed document number", re.compile(r"seed[ _-]?\d{3}", re.IGNORECASE)),
)


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [n for n in out.decode().split("\0") if n]
    return [n for n in names if n != SELF and not n.startswith(EXCLUDED_DIRS)]


def history_hits(names: list[str]) -> list[str]:
    hits = []
    for name in names:
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        text = data.decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pattern in PATTERNS:
                m = pattern.search(line)
                if m:
                    hits.append(f"{name}:{lineno}: {what} {m.group(0)!r}: {line.strip()[:120]}")
                    break
    return hits


def test_patterns_catch_history():
    lines = ["in session 5 we tried", "session-3 default", "Session 7 (2026-11-29)", "sessions 2 and 3",
             "GPU call B", "see issue 4", "seed 001 §3", "seed-002 layout", "seed_003"]
    for line in lines:
        assert any(p.search(line) for _, p in PATTERNS), line
    for line in ["torch.manual_seed(seed)", "seed: int = 0", "a call to the kernel", "one call Returns", "reissue 4"]:
        assert not any(p.search(line) for _, p in PATTERNS), line


def test_tracked_files_are_history_free():
    hits = history_hits(tracked_text_files())
    assert not hits, "history references (cite sources by name, measurements by date):\n" + "\n".join(hits)
