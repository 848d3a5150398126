"""Race a path in a container rootfs (security.md §4 B17/B18): ``python -I racer.py exchange SECONDS A B``.

Swaps A and B with ``renameat2(RENAME_EXCHANGE)`` as fast as it can. Errors are ignored (the hook
may remove or replace a racing inode). Stops at the deadline or on SIGTERM, restores the starting
layout as far as it can, and prints the number of successful calls.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_RENAMEAT2 = 316  # x86_64
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2(a: bytes, b: bytes, flags: int) -> bool:
    """One renameat2 call; True if it succeeded."""
    return bool(_libc.syscall(_SYS_RENAMEAT2, _AT_FDCWD, a, _AT_FDCWD, b, flags) == 0)


_stop = False


def _on_term(signum: int, frame: object) -> None:
    """SIGTERM: finish the current round, restore, report."""
    global _stop  # noqa: PLW0603 - a signal handler's flag
    _stop = True


def main() -> int:
    """Race until the deadline or SIGTERM."""
    signal.signal(signal.SIGTERM, _on_term)
    if sys.argv[1] != "exchange":
        raise SystemExit(f"racer.py: unknown mode {sys.argv[1]!r}")
    seconds = float(sys.argv[2])
    paths = [os.fsencode(p) for p in sys.argv[3:]]
    deadline = time.monotonic() + seconds
    done = 0
    swapped = False
    while not _stop and time.monotonic() < deadline:
        for _ in range(200):
            if _renameat2(paths[0], paths[1], _RENAME_EXCHANGE):
                done += 1
                swapped = not swapped
    if swapped:
        _renameat2(paths[0], paths[1], _RENAME_EXCHANGE)
    print(done, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
