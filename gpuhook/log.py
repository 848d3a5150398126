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

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Final, TextIO

LEVELS: Final = {"debug": 10, "info": 20, "warning": 30, "error": 40}
#: The most characters of one logged value; containers choose many (a refused one logged ~4 MB).
VALUE_LIMIT: Final = 256
#: The most characters of one message shown to a user (report_failure) or logged as a field.
MESSAGE_LIMIT: Final = 4096
#: The most items of one logged list or mapping (a host lists at most 64 GPUs and their MIG devices in one).
ITEMS_LIMIT: Final = 128
#: Fields whose value is a whole message (an error's text): bounded by MESSAGE_LIMIT, not VALUE_LIMIT.
_MESSAGE_FIELDS: Final = frozenset({"error", "reason", "message", "detail"})


def bounded(text: str, limit: int = VALUE_LIMIT) -> str:
    """*text* cut to *limit* characters, with a marker saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text) - limit} more)"


def _bounded_value(value: Any, limit: int) -> Any:
    """A field value with every string in it (and its repr, if JSON cannot hold it) bounded."""
    if isinstance(value, str):
        return bounded(value, limit)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        items = [_bounded_value(v, limit) for v in value[:ITEMS_LIMIT]]
        return [*items, f"…({len(value) - ITEMS_LIMIT} more)"] if len(value) > ITEMS_LIMIT else items
    if isinstance(value, dict):
        pairs = list(value.items())
        out = {bounded(str(k), limit): _bounded_value(v, limit) for k, v in pairs[:ITEMS_LIMIT]}
        if len(pairs) > ITEMS_LIMIT:
            out["…"] = f"({len(pairs) - ITEMS_LIMIT} more)"
        return out
    return bounded(str(value), limit)


class EventLog:
    """Writes events at or above a level, with bound context, as JSON lines."""

    __slots__ = ("_context", "_failed", "_minimum", "_stream")

    def __init__(self, stream: TextIO | None = None, level: str = "info") -> None:
        self._stream = stream
        self._minimum = LEVELS[level]
        self._context: dict[str, Any] = {}
        self._failed = False

    @property
    def configured(self) -> bool:
        """Whether events go anywhere."""
        return self._stream is not None

    def bind(self, **context: Any) -> None:
        """Add fields to every later event (the container id, its pid)."""
        self._context.update({k: _bounded_value(v, VALUE_LIMIT) for k, v in context.items()})

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
        """One JSON line, every value bounded; values that JSON cannot hold are written as strings.

        Logging never refuses a start: a write that fails (a full disk, a closed stream) is said
        once on stderr and later events are dropped quietly.
        """
        if self._stream is None or LEVELS[level] < self._minimum:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        bounded_fields = {k: _bounded_value(v, MESSAGE_LIMIT if k in _MESSAGE_FIELDS else VALUE_LIMIT)
                          for k, v in fields.items()}
        record = {"timestamp": stamp, "level": level, "event": event, **self._context, **bounded_fields}
        line = json.dumps(record, default=str) + "\n"
        try:
            self._stream.write(line)
            self._stream.flush()
        except (OSError, ValueError) as err:  # ValueError: the stream was closed
            self._write_failed(err)

    def _write_failed(self, err: Exception) -> None:
        """Say once on stderr that events are lost, and stop writing them."""
        stream, self._stream = self._stream, None
        if not self._failed:
            self._failed = True
            why = getattr(err, "strerror", None) or err
            with contextlib.suppress(OSError, ValueError):
                print(f"gpuhook: cannot write the log ({why}); later events of this process are dropped",
                      file=sys.stderr)
        if stream is not None and stream is not sys.stderr:
            with contextlib.suppress(OSError, ValueError):  # the buffered line fails again: drop it
                stream.close()


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
        with contextlib.suppress(OSError, ValueError):  # stderr itself may be gone: logging never refuses
            print(f"gpuhook: cannot open log file {path}: {err.strerror}; logging to stderr", file=sys.stderr)
        return sys.stderr


#: The log file the current stream writes (configure_logging), while it is a file of ours.
_log_path: Path | None = None


def _still_open(path: Path | None) -> TextIO | None:
    """The current stream when it writes *path* and *path* still names its file (gpuhookd configures
    logging for every request: a log that was rotated or removed is opened again)."""
    stream = _log._stream
    if stream is None or stream is sys.stderr or path is None or path != _log_path:
        return None
    try:
        ours, named = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError):
        return None
    return stream if (ours.st_dev, ours.st_ino) == (named.st_dev, named.st_ino) else None


def configure_logging(path: Path | None, level: str) -> None:
    """Send events at *level* and above to *path* (a fresh log: no context bound before)."""
    global _log, _log_path  # the one process-wide log, set by every load_settings
    stream = _still_open(path) or _open_log(path)
    _log, _log_path = EventLog(stream, level), path
