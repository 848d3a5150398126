"""Decode /proc/devices (character-device majors) and /proc/driver/nvidia-caps/mig-minors."""

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


def parse_mig_minors(text: str) -> tuple[tuple[str, int], ...]:
    """``mig-minors`` lines (``gpu0/gi7/access 66``, ``config 1``) as (name, minor) pairs."""
    out = []
    for line in text.splitlines():
        name, _, number = line.strip().partition(" ")
        if not name:
            continue
        if not number.isascii() or not number.isdigit():
            raise DiscoveryError(f"mig-minors: unexpected line {line!r}")
        out.append((name, int(number)))
    return tuple(out)
