"""structlog set-up: one JSON line per event in the configured log file.

runc buffers a hook's stdout/stderr and shows them only inside its error
message, so the file is the real log; on failure the CLI also prints one
plain line on stderr for the user. Only the CLI calls ``configure_logging``
(structlog's configuration is process-global).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

import structlog


def _open_log(path: Path | None) -> TextIO:
    """The log stream: *path* in append mode, or stderr if it cannot be opened."""
    if path is None:
        return open("/dev/null", "a", encoding="utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8", buffering=1)
    except OSError as err:
        print(f"gpuhook: cannot open log file {path}: {err.strerror}; logging to stderr", file=sys.stderr)
        return sys.stderr


_configured: list[bool] = []


def is_configured() -> bool:
    """Whether configure_logging has run in this process."""
    return bool(_configured)


def configure_logging(path: Path | None, level: str) -> None:
    """Send JSON-lines events at *level* and above to *path*."""
    _configured.append(True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(file=_open_log(path)),
        cache_logger_on_first_use=True,
    )
