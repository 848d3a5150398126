"""Win a race on purpose: ``python -I pinpoint.py NR NAME A B -- ARGV...`` (x86_64).

Installs a seccomp filter that turns syscall NR into a user notification (``SECCOMP_RET_USER_NOTIF``),
forks a supervisor that holds the listener, and execs ARGV. When the traced process (or any of its
children) makes syscall NR on a path whose last component is NAME, the supervisor swaps A and B
with ``renameat2(RENAME_EXCHANGE)`` *before* letting the syscall go on
(``SECCOMP_USER_NOTIF_FLAG_CONTINUE``). That is the worst timing a racer could hit, every time: the
syscall meets the swapped path right after whatever check the caller made before it.

Only the first matching call triggers the swap. The supervisor exits when the traced processes are
gone (the listener hangs up), when its parent dies (``PR_SET_PDEATHSIG``) or after 60 s.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as `python -I SCRIPT`
from notify_abi import (
    AUDIT_ARCH_X86_64,
    NOTIF_RECV,
    NOTIF_SEND,
    PR_SET_NO_NEW_PRIVS,
    SECCOMP_FILTER_FLAG_NEW_LISTENER,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    SECCOMP_SET_MODE_FILTER,
    SECCOMP_USER_NOTIF_FLAG_CONTINUE,
    SYS_SECCOMP,
    Notif,
    NotifResp,
    SockFilter,
    SockFprog,
    libc,
)

_SYS_RENAMEAT2 = 316
_PR_SET_PDEATHSIG = 1
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# Path argument index per syscall: fchmodat(dirfd, path, ...), mknodat(dirfd, path, ...), openat(...).
_PATH_ARG = {268: 1, 259: 1, 257: 1, 437: 1, 90: 0, 133: 0}


def _install(nr: int) -> int:
    """Install the notifying filter for *nr*; returns the listener fd."""
    program = [
        SockFilter(0x20, 0, 0, 4),  # ld arch
        SockFilter(0x15, 1, 0, AUDIT_ARCH_X86_64),
        SockFilter(0x06, 0, 0, SECCOMP_RET_ALLOW),
        SockFilter(0x20, 0, 0, 0),  # ld nr
        SockFilter(0x15, 0, 1, nr),
        SockFilter(0x06, 0, 0, SECCOMP_RET_USER_NOTIF),
        SockFilter(0x06, 0, 0, SECCOMP_RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*program)
    prog = SockFprog(len(program), filters)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(prog))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    return int(fd)


def _path_of(notif: Notif) -> bytes:
    """The path argument of the notified call, read from the caller's memory (b"" if unreadable)."""
    index = _PATH_ARG.get(notif.data.nr)
    if index is None:
        return b""
    try:
        fd = os.open(f"/proc/{notif.pid}/mem", os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.pread(fd, 4096, notif.data.args[index]).split(b"\0", 1)[0]
    except OSError:
        return b""
    finally:
        os.close(fd)


def _supervise(listener: int, name: bytes, a: bytes, b: bytes) -> None:
    """Answer notifications until the traced processes are gone; swap A and B on the first match."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    swapped = False
    deadline = time.monotonic() + 60
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    while time.monotonic() < deadline:
        events = poller.poll(1000)
        if any(ev & (select.POLLHUP | select.POLLERR) for _, ev in events):
            return
        if not events:
            continue
        notif = Notif()
        try:
            fcntl.ioctl(listener, NOTIF_RECV, notif)
        except OSError:
            continue  # the caller died meanwhile (ENOENT)
        if not swapped and os.path.basename(_path_of(notif)) == name:
            libc.syscall(_SYS_RENAMEAT2, _AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
            swapped = True
        resp = NotifResp(notif.id, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        try:
            fcntl.ioctl(listener, NOTIF_SEND, resp)
        except OSError:
            continue


def main(argv: list[str]) -> int:
    """Install, fork the supervisor, exec the command."""
    if os.uname().machine != "x86_64":
        raise SystemExit("pinpoint.py: the syscall numbers here are x86_64's")
    split = argv.index("--")
    nr, name, a, b = int(argv[0]), os.fsencode(argv[1]), os.fsencode(argv[2]), os.fsencode(argv[3])
    command = argv[split + 1:]
    listener = _install(nr)
    if os.fork() == 0:
        try:
            _supervise(listener, name, a, b)
        finally:
            os._exit(0)
    os.close(listener)
    os.execv(command[0], command)
    return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
