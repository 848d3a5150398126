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
    and whether we had to kill it: at the deadline, or because the process we work for has gone."""

    output: bytes
    status: int | None
    timed_out: bool
    abandoned: bool = False


def wait_child(pid: int, read_fd: int, timeout: float, *, await_exit: bool = True,
               abort_fd: int | None = None) -> ChildResult:
    """Read *read_fd* to EOF and reap *pid*; SIGKILL it once *timeout* seconds have passed.

    ``await_exit=False``: a child that closed *read_fd*'s other end after its last word is not
    waited for while it exits (tearing down its memory takes milliseconds); it is reaped if it
    has already gone, else left to init once we exit.

    *abort_fd*: a channel to the process we work for, which says nothing while the child runs:
    if it becomes readable (its end closed: that process died), the child is killed and reaped
    at once (``abandoned``), so that the caller can undo its own work without waiting.
    """
    chunks = []
    deadline = time.monotonic() + timeout
    timed_out = abandoned = False
    # poll, not select: select() refuses an fd past 1023, and a start holding many files has such fds
    poller = select.poll()
    for fd in (read_fd,) if abort_fd is None else (read_fd, abort_fd):
        poller.register(fd, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            ready = [fd for fd, _ in poller.poll(left * 1000)] if left > 0 else []
            if not ready or abort_fd in ready:
                timed_out, abandoned = not ready, bool(ready)
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        reaped, status = os.waitpid(pid, 0 if await_exit or timed_out or abandoned else os.WNOHANG)
    return ChildResult(b"".join(chunks), os.waitstatus_to_exitcode(status) if reaped else None, timed_out,
                       abandoned)
