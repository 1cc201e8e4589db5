"""Logging: one logger per component (`pipeline.gate`, `stages.rollout`, ...), one format, and
warnings that would repeat every step said once.

The level chosen (`--log-level`) applies to the project's own loggers; everyone else's (other
libraries, a user's reward module) log at info at the most verbose, so `--log-level debug` is
our debug output, not thousands of lines of matplotlib's font manager.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"

_warned: set[tuple[str, str]] = set()
OWN_LOGGERS = ("pipeline", "stages", "backends", "bench")
NARRATION = "pipeline.startup"  # what start-up is doing: pipeline/startup.py


def setup(level: str = "INFO", handler: logging.Handler | None = None) -> None:
    """Route every record at `level` and above through `handler` (stderr by default; start-up's
    narration, `pipeline.startup`, is the console's to show and never reaches stderr)."""
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(lambda record: record.name != NARRATION)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler.addFilter(_quiet_others)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def _quiet_others(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.INFO or record.name.partition(".")[0] in OWN_LOGGERS


def warn_once(logger: logging.Logger, key: str, message: str, *args: Any) -> None:
    """Log a warning the first time `key` comes up for `logger`; later ones at debug level."""
    if (logger.name, key) in _warned:
        logger.debug(message, *args)
        return
    _warned.add((logger.name, key))
    logger.warning(message, *args)


def reset_warnings() -> None:
    """Forget which warnings were given (a new run warns afresh)."""
    _warned.clear()
