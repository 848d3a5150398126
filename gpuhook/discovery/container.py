"""Read-only facts about a container's rootfs that placement needs: its identity and its layout.

Only looked up inside the rootfs (openat2 ``RESOLVE_IN_ROOT``), never by joining paths, and
nothing in it is opened for reading: the image is the attacker's.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuhook.errors import SpecError
from gpuhook.sys import pathrs


def rootfs_identity(rootfs: Path) -> tuple[int, int]:
    """(st_dev, st_ino) of the rootfs directory; refuses the host's own root."""
    try:
        st = os.stat(rootfs)
    except OSError as err:
        raise SpecError(f"cannot open the container rootfs {rootfs}: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError(f"the container rootfs {rootfs} is not a directory")
    host_root = os.stat("/")
    if (st.st_dev, st.st_ino) == (host_root.st_dev, host_root.st_ino):
        raise SpecError(f"the container rootfs {rootfs} is the host's /; refusing to change the host")
    return st.st_dev, st.st_ino


def is_debian_like(rootfs: Path) -> bool:
    """Whether the rootfs has /etc/debian_version (libraries then go to the multiarch directory)."""
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise SpecError(f"cannot open the container rootfs {rootfs}: {err.strerror}") from err
    try:
        fd = pathrs.openat2(root, "etc/debian_version", os.O_PATH,
                            pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS)
    except OSError:
        return False
    finally:
        os.close(root)
    os.close(fd)
    return True
