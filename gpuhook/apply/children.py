"""Waiting for a forked child: everything it writes to a pipe, its exit status, and a hard deadline."""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChildResult:
    """What a child wrote, how it ended (exit code, or -signal; None: still exiting, left to init),
    and whether we had to kill it."""

    output: bytes
    status: int | None
    timed_out: bool


def wait_child(pid: int, read_fd: int, timeout: float, *, await_exit: bool = True) -> ChildResult:
    """Read *read_fd* to EOF and reap *pid*; SIGKILL it once *timeout* seconds have passed.

    ``await_exit=False``: a child that closed *read_fd*'s other end after its last word is not
    waited for while it exits (tearing down its memory takes milliseconds); it is reaped if it
    has already gone, else left to init once we exit.
    """
    chunks = []
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        reaped, status = os.waitpid(pid, 0 if await_exit or timed_out else os.WNOHANG)
    return ChildResult(b"".join(chunks), os.waitstatus_to_exitcode(status) if reaped else None, timed_out)
