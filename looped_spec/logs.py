"""looped-spec's own log lines on stderr for `generate`, `serve` and each Ray Serve replica (as vLLM prints its startup
lines), at the level --log-level names. Logs stay on stderr: generate's stdout is its output, parsed by scripts."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
# vLLM's layout ("INFO 05-06 12:00:00 [file.py:12] message"), with the logger's name: it says which part spoke
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a line is logged (a redirection or a test's capture made after the
    handler was set up included), not to the stream of that moment."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it; the current sys.stderr is always used
        pass


def configure_logging(level: str) -> None:
    """The `looped_spec` loggers at `level` (one of LOG_LEVELS) on stderr; calling it again replaces the setting.
    Records still propagate, so an application's own root handlers (and pytest's caplog) see them too."""
    logger = logging.getLogger("looped_spec")
    for handler in [h for h in logger.handlers if isinstance(h, StderrHandler)]:
        logger.removeHandler(handler)
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
