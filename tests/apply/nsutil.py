"""Run a function in a forked child with a private mount namespace (mounts never reach the host)."""

from __future__ import annotations

import ctypes
import os
import pickle
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def in_private_mount_ns(fn: Callable[[], T]) -> T:
    """fn() in a child that unshared its mount namespace; its exception text becomes an AssertionError."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if _libc.unshare(_CLONE_NEWNS) or _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None):
                raise OSError(ctypes.get_errno(), "unshare/mount private")
            outcome = ("ok", fn())
        except BaseException:  # noqa: BLE001 - report everything to the parent
            outcome = ("error", traceback.format_exc())
        os.write(write_fd, pickle.dumps(outcome))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "error":
        raise AssertionError(f"in the private mount namespace:\n{value}")
    return value  # type: ignore[no-any-return]
