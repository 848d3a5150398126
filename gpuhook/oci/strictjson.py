"""Strict JSON decoding for input an attacker may shape.

The standard ``json`` module lets duplicate keys win silently (the last one),
accepts ``NaN``/``Infinity``, and treats ``true`` as an ``int`` for
``isinstance``; security.md §3.4 lists each. Parsers here refuse all of them
and raise ``SpecError`` naming the document.
"""

from __future__ import annotations

from gpuhook.errors import SpecError

try:
    # The C scanner the json package itself uses. Importing json would also import re and enum
    # (~3 ms of every container start) for the pure-Python fallbacks this never needs.
    from _json import make_scanner as _make_scanner
except ImportError:  # pragma: no cover - Pythons without the C accelerator
    from json.scanner import make_scanner as _make_scanner

TYPE_CHECKING = False  # typing costs ~3 ms to import; the no-GPU path must not pay it
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

#: podman adds every annotation to the state; 1 MiB leaves room and bounds memory.
STATE_LIMIT = 1 << 20
#: docker and podman specs are a few KiB; a large env still fits in 8 MiB.
SPEC_LIMIT = 8 << 20


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook refusing a key that appears twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    """parse_constant refusing NaN and the infinities."""
    raise ValueError(f"non-standard JSON constant {name}")


class _Context:
    """The decoder settings the scanner reads (what json.JSONDecoder would hold)."""

    strict = True
    object_hook = None
    object_pairs_hook = staticmethod(_no_duplicates)
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_no_constant)
    memo: dict[str, str] = {}  # noqa: RUF012 - the pure-Python scanner's string cache, read only by it


_scan = _make_scanner(_Context())  # type: ignore[arg-type] # the scanner only reads these attributes
_BLANK = " \t\n\r"


def decode(text: str) -> Any:
    """One JSON document, like json.loads with our hooks; raises ValueError or RecursionError.

    A syntax error's ValueError says what was expected and where (``Expecting ',' delimiter: line 1
    column 9 (char 8)``, as json.loads words it).
    """
    start = len(text) - len(text.lstrip(_BLANK))
    try:
        value, end = _scan_once(text, start)
    except SystemError:
        # CPython 3.11's scanner reports a syntax error as json.decoder.JSONDecodeError, but finds that
        # class only in sys.modules (3.12 imports it), and json.decoder is not imported on the hot path:
        # without it the report itself fails. Only bad input gets here, so import it now and scan again
        # (scanning is deterministic: the same error, this time raised whole).
        import json.decoder  # noqa: F401 - imported for the scanner's sake

        value, end = _scan_once(text, start)
    if text[end:].strip(_BLANK):
        raise ValueError(f"Extra data: {_where(text, end)}")
    return value


def _scan_once(text: str, start: int) -> tuple[Any, int]:
    """The value at *start* and where it ends; a syntax error is a ValueError naming its place."""
    try:
        value, end = _scan(text, start)
    except StopIteration as err:  # nothing that starts a value at err.value
        raise ValueError(f"Expecting value: {_where(text, err.value)}") from None
    return value, end


def _where(text: str, at: int) -> str:
    """*at* (a character index of *text*) as json.decoder.JSONDecodeError words a place."""
    line = text.count("\n", 0, at) + 1
    column = at - text.rfind("\n", 0, at)
    return f"line {line} column {column} (char {at})"


def loads_object(data: bytes, *, what: str, limit: int) -> Mapping[str, Any]:
    """Decode *data* (UTF-8) as one JSON object of at most *limit* bytes."""
    if len(data) > limit:
        raise SpecError(f"{what} is {len(data)} bytes; the limit is {limit}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{what} is not UTF-8: byte {data[err.start]:#04x} at offset {err.start} ({err.reason})"
                        ) from None
    try:
        value = decode(text)
    except RecursionError:
        raise SpecError(f"{what} nests arrays or objects too deeply to decode") from None
    except ValueError as err:
        raise SpecError(f"{what} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise SpecError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def get_str(obj: Mapping[str, Any], key: str, *, what: str, default: str | None = None) -> str:
    """obj[key] as a string (or *default* when absent and a default is given)."""
    if key not in obj and default is not None:
        return default
    value = obj.get(key)
    if not isinstance(value, str):
        raise SpecError(f"{what}: {key!r} must be a string, got {_kind(value)}")
    return value


def get_int(obj: Mapping[str, Any], key: str, *, what: str) -> int | None:
    """obj[key] as a non-negative int (never a bool), or None when absent."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{what}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def get_obj(obj: Mapping[str, Any], key: str, *, what: str) -> Mapping[str, Any]:
    """obj[key] as an object; an absent key is an empty object."""
    value = obj.get(key, {})
    if not isinstance(value, dict):
        raise SpecError(f"{what}: {key!r} must be an object, got {_kind(value)}")
    return value


def get_list(obj: Mapping[str, Any], key: str, *, what: str) -> list[Any]:
    """obj[key] as a list; an absent key or null is an empty list."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{what}: {key!r} must be a list, got {_kind(value)}")
    return value


def _kind(value: object) -> str:
    """A JSON type name for messages."""
    return "nothing" if value is None else type(value).__name__
