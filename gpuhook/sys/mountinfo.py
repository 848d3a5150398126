"""The one reader of ``/proc/<pid>/mountinfo``, and the id of the mount an fd lives on.

Read-only. ``parse_mountinfo`` is pure (its tests feed it text); ``read_mountinfo`` is the
edge that reads the file. Every other module that wants to know about mounts (cgroup
hierarchies, shared peer groups, the cgroup mode doctor reports) works on its rows.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpuhook.sys._libc import AT_EMPTY_PATH, syscall

#: the kernel escapes space, tab, newline and backslash in paths as a backslash and three octal digits
_ESCAPE: Final = re.compile(r"\\([0-3][0-7]{2})")
#: fields before the optional ones: id, parent, major:minor, root, mount point, mount options
_FIXED: Final = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class MountInfo:
    """One line of mountinfo (proc(5)), with the paths' octal escapes decoded."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor" of the filesystem
    root: str  # the directory of the filesystem that is mounted here
    mount_point: str
    options: tuple[str, ...]  # per-mount options: rw, nosuid, relatime, ...
    optional: tuple[str, ...]  # tagged fields: shared:N, master:N, propagate_from:N, unbindable
    fs_type: str
    source: str
    super_options: tuple[str, ...]  # per-superblock options (for cgroup v1: the controllers)

    @property
    def shared_peer_group(self) -> int | None:
        """N of ``shared:N`` (the mount propagates to and from that peer group), else None."""
        for tag in self.optional:
            name, _, value = tag.partition(":")
            if name == "shared" and value.isdigit():
                return int(value)
        return None


def unescape(field: str) -> str:
    """A mountinfo path field with its ``\\ooo`` escapes (``\\040`` for a space ...) decoded."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field) if "\\" in field else field


def parse_line(line: str) -> MountInfo | None:
    """One mountinfo line as a row; None for a line that does not have mountinfo's shape."""
    fields = line.split()
    try:
        separator = fields.index("-", _FIXED)
    except ValueError:
        return None
    if len(fields) < separator + 4 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return MountInfo(
        mount_id=int(fields[0]), parent_id=int(fields[1]), device=fields[2], root=unescape(fields[3]),
        mount_point=unescape(fields[4]), options=tuple(fields[5].split(",")), optional=tuple(fields[_FIXED:separator]),
        fs_type=fields[separator + 1], source=unescape(fields[separator + 2]),
        super_options=tuple(fields[separator + 3].split(",")),
    )


def parse_mountinfo(text: str) -> tuple[MountInfo, ...]:
    """Every row of a mountinfo text, in mount order.

    A line without mountinfo's shape is left out rather than fatal: callers look for
    particular mounts, and a format a future kernel extends must not stop a container.
    """
    return tuple(row for row in map(parse_line, text.splitlines()) if row is not None)


def read_mountinfo(pid: int | str = "self", *, proc: Path = Path("/proc")) -> tuple[MountInfo, ...]:
    """The mounts *pid* sees (``self``: our own namespace); raises OSError."""
    # Bytes that are not UTF-8 survive as surrogates, so a path round-trips to os functions.
    return parse_mountinfo((proc / str(pid) / "mountinfo").read_text(encoding="utf-8", errors="surrogateescape"))


def shared_mount_ids(mounts: Iterable[MountInfo]) -> frozenset[int]:
    """Ids of the *mounts* that are in a shared peer group (mountinfo ``shared:N``)."""
    return frozenset(row.mount_id for row in mounts if row.shared_peer_group is not None)


#: statx(2) is not one of the unified numbers; STATX_MNT_ID arrived in Linux 5.8.
SYS_STATX: Final = {"x86_64": 332, "aarch64": 291}.get(os.uname().machine, 332)
STATX_MNT_ID: Final = 0x1000
_STATX_SIZE: Final = 256  # struct statx
_STATX_MNT_ID_OFFSET: Final = 144  # __u64 stx_mnt_id, after stx_dev_minor


def mount_id(fd: int) -> int:
    """The id of the mount *fd* lives on: statx's stx_mnt_id (one syscall), else fdinfo's mnt_id."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if syscall(SYS_STATX, fd, b"", AT_EMPTY_PATH, STATX_MNT_ID, buf) == 0:
        mask = int.from_bytes(buf.raw[:4], "little")
        if mask & STATX_MNT_ID:
            return int.from_bytes(buf.raw[_STATX_MNT_ID_OFFSET : _STATX_MNT_ID_OFFSET + 8], "little")
    return fdinfo_mount_id(fd)


def fdinfo_mount_id(fd: int) -> int:
    """``mnt_id`` in /proc/self/fdinfo (Linux 3.15), for kernels before statx's STATX_MNT_ID."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(0, f"/proc/self/fdinfo/{fd} has no mnt_id line; the kernel is older than Linux 3.15", str(fd))
