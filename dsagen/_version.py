"""dsagen's version: the one source of truth (pyproject.toml reads it, `dsagen --version` prints it)."""

__version__ = "0.1.0"
