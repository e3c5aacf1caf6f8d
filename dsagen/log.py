"""dsagen's logging: the `dsagen` logger and its children (dsagen.build, dsagen.jit, dsagen.store, ...).

dsagen logs builds, JIT compiles, cache hits and misses and kernel loads through the standard `logging`
module and adds only a NullHandler: an application configures logging as it does for any library, and
without that configuration nothing of dsagen's is printed (not even warnings, through Python's last-resort
handler).
DSAGEN_LOG_LEVEL (read once, when dsagen is imported) is the shortcut without code: set to a level name
(DEBUG, INFO, WARNING, ERROR, CRITICAL) or number, it sets the `dsagen` logger's level and adds one
handler that writes to stderr. Unset, nothing is printed beyond what dsagen prints otherwise.
"""

from __future__ import annotations

import logging
import os
import sys

from .errors import ConfigError

LOG_LEVEL_VAR = "DSAGEN_LOG_LEVEL"
FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("dsagen")
# the library convention: with no handler configured, Python's last-resort handler would print every WARNING and
# ERROR on stderr, a second time where the command line prints the same failure itself
if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):  # once, if the module is reloaded
    logger.addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The child logger `dsagen.<name>` (e.g. get_logger("jit"))."""
    return logger.getChild(name)


def parse_level(raw: str) -> int:
    """A logging level from a name (case-insensitive) or a number; ConfigError naming DSAGEN_LOG_LEVEL otherwise."""
    v = raw.strip()
    if v.upper() in _LEVELS:
        return logging.getLevelName(v.upper())
    if v.isdigit():
        return int(v)
    raise ConfigError(f"{LOG_LEVEL_VAR}={raw!r}: expected one of {', '.join(_LEVELS)} or a number")


def _handler_installed() -> bool:
    return any(getattr(h, "_dsagen_env", False) for h in logger.handlers)


def configure_from_env() -> None:
    """Apply DSAGEN_LOG_LEVEL once: the level and a stderr handler when set, nothing when unset or blank.

    An unusable value warns (on stderr, through `warnings`) and leaves logging as it is: a typo in a
    logging variable must not stop a program that imports dsagen. `dsagen env` reports it as INVALID."""
    raw = os.environ.get(LOG_LEVEL_VAR)
    if raw is None or not raw.strip() or _handler_installed():
        return
    try:
        level = parse_level(raw)
    except ConfigError as e:
        import warnings

        warnings.warn(f"dsagen: {e}; logging is left unconfigured", stacklevel=2)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._dsagen_env = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)


__all__ = ["logger", "get_logger", "parse_level", "configure_from_env", "LOG_LEVEL_VAR"]
