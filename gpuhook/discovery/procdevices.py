"""Decode /proc/devices: character-device majors by driver name."""

from __future__ import annotations

from collections.abc import Mapping

from gpuhook.errors import DiscoveryError


def parse_proc_devices(text: str) -> Mapping[str, int]:
    """The "Character devices:" section as ``{name: major}`` (first name wins)."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":"):
            in_char = stripped == "Character devices:"
            continue
        if not in_char or not stripped:
            continue
        number, _, name = stripped.partition(" ")
        if not number.isascii() or not number.isdigit() or not name:
            raise DiscoveryError(f"/proc/devices: unexpected line {line!r}")
        majors.setdefault(name.strip(), int(number))
    return majors
