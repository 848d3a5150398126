"""Device-cgroup rules for the container (cgroup v1 ``devices.allow``).

The container's cgroup is found from the host's view of its pid
(``/proc/<pid>/cgroup`` and the host's mountinfo), never from the rootfs.
Rules are exact (``c MAJOR:MINOR rw``); a rule the cgroup already grants is
not written again, so rollback (``devices.deny``) only removes what we added.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Final

from gpuhook.errors import ApplyError
from gpuhook.planning.plan import CgroupRule

V2_UNSUPPORTED: Final = (
    "the container's device access is controlled by cgroup v2 (eBPF), which gpuhook cannot program yet; "
    "set `no_cgroups: true` and let the runtime allow the GPU devices (for example with --device)"
)


def parse_cgroup_file(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` → {controller: path}; the v2 entry is under ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def devices_mount(mountinfo: str) -> tuple[str, str] | None:
    """(mount root, mount point) of the v1 devices hierarchy in a mountinfo text."""
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        is_cgroup_v1 = len(fields) >= 5 and len(tail_fields) >= 3 and tail_fields[0] == "cgroup"
        if is_cgroup_v1 and "devices" in tail_fields[2].split(","):
            return _unescape(fields[3]), _unescape(fields[4])
    return None


def _unescape(field: str) -> str:
    """mountinfo octal escapes (\\040 for space ...)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def device_cgroup_dir(pid: int, *, proc: Path = Path("/proc")) -> Path:
    """The host directory of the devices cgroup of *pid*; raises ApplyError."""
    try:
        groups = parse_cgroup_file((proc / str(pid) / "cgroup").read_text())
        mount = devices_mount((proc / "self" / "mountinfo").read_text())
    except OSError as err:
        raise ApplyError("find device cgroup", f"pid {pid}", errno_=err.errno) from err
    path = groups.get("devices")
    if path is None or mount is None or (path == "/" and groups.get("", "/") != "/"):
        raise ApplyError("device cgroup", f"pid {pid}", detail=V2_UNSUPPORTED)
    root, mountpoint = mount
    rel = PurePosixPath(path)
    if root != "/":
        try:
            rel = PurePosixPath("/") / rel.relative_to(root)
        except ValueError as err:
            raise ApplyError("device cgroup", path, detail=f"is outside the devices mount root {root}") from err
    if ".." in rel.parts:
        raise ApplyError("device cgroup", path, detail="contains '..'")
    return Path(mountpoint, *rel.parts[1:])


def _covered(rule: CgroupRule, listing: str) -> bool:
    """Whether devices.list already grants *rule* (an exact or wildcard entry with its access)."""
    for entry in listing.splitlines():
        try:
            kind, numbers, access = entry.split()
            major, minor = numbers.split(":")
        except ValueError:
            continue
        matches = kind in ("a", "c") and major in ("*", str(rule.major)) and minor in ("*", str(rule.minor))
        if matches and set(rule.access) <= set(access):
            return True
    return False


def _write(path: Path, rules: list[CgroupRule]) -> None:
    """Write one rule per write(2): the kernel parses a single rule per write."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for rule in rules:
            os.write(fd, str(rule).encode())
    finally:
        os.close(fd)


def allow(directory: Path, rules: tuple[CgroupRule, ...]) -> list[CgroupRule]:
    """Grant *rules* in *directory*; returns the ones actually added (for rollback)."""
    try:
        listing = (directory / "devices.list").read_text()
        added = [r for r in rules if not _covered(r, listing)]
        if added:
            _write(directory / "devices.allow", added)
    except OSError as err:
        raise ApplyError("device cgroup allow", str(directory), errno_=err.errno) from err
    return added


def deny(directory: Path, rules: list[CgroupRule]) -> None:
    """Take back rules added by allow() (rollback)."""
    if rules:
        _write(directory / "devices.deny", rules)
