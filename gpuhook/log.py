"""The event log: one JSON line per event in the configured log file.

runc buffers a hook's stdout/stderr and shows them only inside its error
message, so the file is the real log; on failure the CLI also prints one
plain line on stderr for the user. Only ``service.load_settings`` calls ``configure_logging``.

This is a small in-house logger rather than structlog, decided by measurement (2026-12-01,
the script is in issue 13's closing note; 2-core VM, medians of 15 runs): a fresh
``python -I`` that imports structlog 26.1 takes ~140 ms longer than one that does not (it pulls
in asyncio), and every front-end that is a fresh process pays that: the hook when gpuhookd does
not serve, gpuhook-runtime, nvidia-container-cli, cdi-hook, the CLI. gpuhookd imports once, but
there a structlog event (processors add_log_level, TimeStamper, JSONRenderer; WriteLogger) costs
~26 µs against ~20 µs here, so it buys the daemon nothing, and two loggers would mean two event
shapes. One logger, one shape for every process: structlog's (snake_case event names, context
bound once, key=value fields, one JSON object a line).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Final, TextIO

LEVELS: Final = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class EventLog:
    """Writes events at or above a level, with bound context, as JSON lines."""

    __slots__ = ("_context", "_minimum", "_stream")

    def __init__(self, stream: TextIO | None = None, level: str = "info") -> None:
        self._stream = stream
        self._minimum = LEVELS[level]
        self._context: dict[str, Any] = {}

    @property
    def configured(self) -> bool:
        """Whether events go anywhere."""
        return self._stream is not None

    def bind(self, **context: Any) -> None:
        """Add fields to every later event (the container id, its pid)."""
        self._context.update(context)

    def debug(self, event: str, **fields: Any) -> None:
        """A detail for --debug runs."""
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """A step that happened."""
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Something skipped or degraded."""
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """A failure."""
        self._emit("error", event, fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        """One JSON line; values that JSON cannot hold are written as strings."""
        if self._stream is None or LEVELS[level] < self._minimum:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        record = {"timestamp": stamp, "level": level, "event": event, **self._context, **fields}
        self._stream.write(json.dumps(record, default=str) + "\n")
        self._stream.flush()


_log = EventLog()


def get_logger() -> EventLog:
    """The process's event log (a no-op until configure_logging runs)."""
    return _log


def is_configured() -> bool:
    """Whether configure_logging has run in this process."""
    return _log.configured


def _open_log(path: Path | None) -> TextIO:
    """The log stream: *path* in append mode, or stderr if it cannot be opened."""
    if path is None:
        return open("/dev/null", "a", encoding="utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as err:
        print(f"gpuhook: cannot open log file {path}: {err.strerror}; logging to stderr", file=sys.stderr)
        return sys.stderr


def configure_logging(path: Path | None, level: str) -> None:
    """Send events at *level* and above to *path*."""
    global _log  # noqa: PLW0603 - the one process-wide log, set once by the CLI
    _log = EventLog(_open_log(path), level)
