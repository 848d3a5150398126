"""Attributes of the calling process itself: prctl(2) and close_range(2).

Neither touches the filesystem or another process: a front-end sets them on itself
(death signal, dumpability, close-on-exec for inherited fds) before doing any work.
"""

from __future__ import annotations

import ctypes
from typing import Final

from gpuhook.sys._libc import check, libc, syscall

PR_SET_PDEATHSIG: Final = 1
PR_SET_DUMPABLE: Final = 4
PR_CAPBSET_DROP: Final = 24
PR_SET_NO_NEW_PRIVS: Final = 38

SYS_CLOSE_RANGE: Final = 436  # one of the unified >= 424 numbers
CLOSE_RANGE_CLOEXEC: Final = 1 << 2


def prctl(option: int, arg: int) -> int:
    """prctl(2) with one argument; raises OSError naming the option."""
    return check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def close_range_cloexec(first: int) -> None:
    """Mark every fd >= *first* close-on-exec (close_range(2), Linux 5.11)."""
    check(syscall(SYS_CLOSE_RANGE, first, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC), "close_range")
