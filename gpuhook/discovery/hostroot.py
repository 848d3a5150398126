"""Reads of the host's driver files, always relative to a configured root.

A driver root is not always ``/``: a containerised driver lives under
``/run/nvidia/driver``, a cloud image's under ``/usr/local/nvidia``, the test
host in a temporary directory. Absolute symlinks and ld.so.cache paths inside
such a root mean "inside the root", so every lookup resolves with
``RESOLVE_IN_ROOT`` rather than by string joins.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuhook.sys import pathrs


@dataclass(frozen=True, slots=True)
class HostRoot:
    """A directory that stands for ``/`` when looking up driver files."""

    path: Path

    def resolve(self, rel: str) -> tuple[Path, os.stat_result] | None:
        """The host path and stat of *rel* inside the root, symlinks followed inside it; None if absent."""
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            return Path(pathrs.fd_path(fd)), os.fstat(fd)
        finally:
            os.close(fd)

    def stat(self, rel: str) -> os.stat_result | None:
        """The stat of *rel* inside the root, symlinks followed inside it; None if absent."""
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def read_bytes(self, rel: str) -> bytes | None:
        """The contents of the regular file *rel* inside the root, or None if absent."""
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            # Reopened through the fd: the very file resolved, for reading (an O_PATH fd cannot read).
            with open(f"/proc/self/fd/{fd}", "rb") as handle:
                return handle.read()
        finally:
            os.close(fd)

    def listdir(self, rel: str) -> tuple[str, ...]:
        """Sorted names in the directory *rel* inside the root (empty if absent)."""
        fd = self._open(rel)
        if fd is None:
            return ()
        try:
            return tuple(sorted(os.listdir(f"/proc/self/fd/{fd}"))) if stat.S_ISDIR(os.fstat(fd).st_mode) else ()
        finally:
            os.close(fd)

    def _open(self, rel: str) -> int | None:
        """An O_PATH fd for *rel* resolved inside the root, or None if absent."""
        try:
            root_fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return pathrs.openat2(root_fd, rel.lstrip("/") or ".", os.O_PATH | os.O_CLOEXEC,
                                  pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(root_fd)
