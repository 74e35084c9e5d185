"""Pretty operational stderr records: `YYYY-MM-DD HH:MM:SS.mmm LEVEL message`.

No terminal control sequences when stderr is redirected; records never carry prompts,
outputs, bodies or credentials (callers log counts, ids and timings only).
"""

from __future__ import annotations

import logging
import sys
import time

LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}
logging.addLevelName(5, "TRACE")

_COLORS = {"WARNING": "\x1b[33m", "ERROR": "\x1b[31m", "CRITICAL": "\x1b[31;1m", "DEBUG": "\x1b[2m", "TRACE": "\x1b[2m"}


class _Formatter(logging.Formatter):
    def __init__(self, color: bool):
        super().__init__()
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        level = record.levelname
        if self.color and level in _COLORS:
            level = f"{_COLORS[level]}{level}\x1b[0m"
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{stamp}.{int(record.msecs):03d} {level} {message}"


def setup_logging(level: str = "info") -> None:
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(color=sys.stderr.isatty()))
    root = logging.getLogger("ninfer")
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    root.propagate = False
