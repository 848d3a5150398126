"""The ctypes handle on libc that every binding in ``gpuhook.sys`` shares (private).

Rules enforced here for all of them (security.md §3.2 "Known ctypes hazards"):

* A raw C call stops at the first NUL byte, so a path with an embedded NUL
  would silently be truncated ("etc/os-release\\0../../x" opens
  etc/os-release). Every path is refused by :func:`encode_path` if it contains one.
* errno is read with ``use_errno=True`` + ``ctypes.get_errno()`` and raised as
  ``OSError`` carrying the path (:func:`check`).
* Numbers that differ per architecture (``setns`` is 308 on x86_64, 268 on
  aarch64) go through libc's wrapper; the mount-API syscalls are >= 424 and
  share one number on every architecture.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

libc = ctypes.CDLL(None, use_errno=True)
syscall = libc.syscall
syscall.restype = ctypes.c_long

#: the flag shared by the mount API (mount_setattr) and statx (mount ids): "the fd itself, no path"
AT_EMPTY_PATH: Final = 0x1000


def encode_path(path: str) -> bytes:
    """Encode a path for C, refusing the NUL byte that C would truncate at."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError(f"path contains a NUL byte: {path!r}; a C call would stop there and use a shorter path")
    return raw


def check(result: int, what: str) -> int:
    """Raise OSError(errno, strerror, *what*) for a failed call (result < 0), else return *result*."""
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result
