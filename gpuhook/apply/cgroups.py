"""Device-cgroup rules for the container, on cgroup v1 (``devices.allow``) or v2 (eBPF).

The container's cgroup is found from the host's view of its pid
(``/proc/<pid>/cgroup`` and the hook's mountinfo), never from the rootfs.
Rules are exact (``c MAJOR:MINOR rw``). On v1 a rule the cgroup already grants
is not written again, so rollback (``devices.deny``) only removes what we
added; on v2 the runtime's program is extended and swapped atomically, and
rollback swaps the original back (``cgroupv2.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from gpuhook.errors import ApplyError
from gpuhook.planning.plan import CgroupRule
from gpuhook.sys.mountinfo import MountInfo, read_mountinfo

NOT_FOUND: Final = (
    "has neither a v1 devices cgroup nor a cgroup2 directory the hook can see; "
    "set `no_cgroups: true` if the runtime itself allows the GPU devices"
)
Undo = Callable[[], None]


@dataclass(frozen=True, slots=True)
class DeviceCgroup:
    """Where the container's device access is decided: a v1 devices dir or a v2 cgroup dir."""

    version: int
    path: Path


def parse_cgroup_file(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` → {controller: path}; the v2 entry is under ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def cgroup_mounts(mounts: Iterable[MountInfo], *, v2: bool) -> list[tuple[str, str]]:
    """(mount root, mount point) of the v1 devices hierarchies, or of the cgroup2 ones, in mount order."""
    if v2:
        return [(row.root, row.mount_point) for row in mounts if row.fs_type == "cgroup2"]
    return [(row.root, row.mount_point) for row in mounts if row.fs_type == "cgroup" and "devices" in row.super_options]


def locate_device_cgroup(pid: int, *, proc: Path = Path("/proc")) -> DeviceCgroup:
    """The cgroup that decides *pid*'s device access; raises ApplyError."""
    try:
        groups = parse_cgroup_file((proc / str(pid) / "cgroup").read_text())
        mounts = read_mountinfo(proc=proc)
    except OSError as err:
        raise ApplyError("find device cgroup", f"pid {pid}", errno_=err.errno) from err
    v1 = groups.get("devices")
    v1_mounts = cgroup_mounts(mounts, v2=False)
    if v1 is not None and v1 != "/" and v1_mounts:
        root, mountpoint = v1_mounts[-1]
        return DeviceCgroup(1, _join(root, mountpoint, v1))
    v2 = groups.get("")
    if v2 is not None:
        # A later mount can cover an earlier one (runc in v2 mode mounts cgroup2 over /sys/fs/cgroup):
        # the last hierarchy that holds the container's directory is the visible one.
        for root, mountpoint in reversed(cgroup_mounts(mounts, v2=True)):
            path = _join(root, mountpoint, v2)
            if path.is_dir():
                return DeviceCgroup(2, path)
    raise ApplyError("find device cgroup", f"pid {pid}", detail=NOT_FOUND)


def _join(root: str, mountpoint: str, path: str) -> Path:
    """The host directory of cgroup *path* in a hierarchy mounted from *root* at *mountpoint*."""
    rel = PurePosixPath(path)
    if ".." in rel.parts:
        raise ApplyError("find device cgroup", path, detail="contains '..'")
    if root != "/":
        try:
            rel = PurePosixPath("/") / rel.relative_to(root)
        except ValueError as err:
            raise ApplyError("find device cgroup", path, detail=f"is outside the mount root {root}") from err
    return Path(mountpoint, *rel.parts[1:])


def grant(cgroup: DeviceCgroup, rules: tuple[CgroupRule, ...]) -> Undo:
    """Allow *rules* in *cgroup*; returns how to take them back."""
    if cgroup.version == 2:
        from gpuhook.apply import cgroupv2  # bpf only where v2 is in use

        return cgroupv2.grant(cgroup.path, rules)
    added = allow(cgroup.path, rules)
    return lambda: deny(cgroup.path, added)


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
