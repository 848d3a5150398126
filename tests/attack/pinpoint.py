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

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_SECCOMP = 317
_SYS_RENAMEAT2 = 316
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_USER_NOTIF = 0x7FC00000
_SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# Path argument index per syscall: fchmodat(dirfd, path, ...), mknodat(dirfd, path, ...), openat(...).
_PATH_ARG = {268: 1, 259: 1, 257: 1, 437: 1, 90: 0, 133: 0}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("instruction_pointer", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class _NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def _iowr(nr: int, size: int) -> int:
    """The _IOWR('!', nr, size) ioctl number."""
    return (3 << 30) | (size << 16) | (ord("!") << 8) | nr


_NOTIF_RECV = _iowr(0, ctypes.sizeof(_Notif))
_NOTIF_SEND = _iowr(1, ctypes.sizeof(_NotifResp))


def _install(nr: int) -> int:
    """Install the notifying filter for *nr*; returns the listener fd."""
    program = [
        _SockFilter(0x20, 0, 0, 4),  # ld arch
        _SockFilter(0x15, 1, 0, _AUDIT_ARCH_X86_64),
        _SockFilter(0x06, 0, 0, _SECCOMP_RET_ALLOW),
        _SockFilter(0x20, 0, 0, 0),  # ld nr
        _SockFilter(0x15, 0, 1, nr),
        _SockFilter(0x06, 0, 0, _SECCOMP_RET_USER_NOTIF),
        _SockFilter(0x06, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*program)
    prog = _SockFprog(len(program), filters)
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _libc.syscall.restype = ctypes.c_long
    fd = _libc.syscall(_SYS_SECCOMP, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(prog))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    return int(fd)


def _path_of(notif: _Notif) -> bytes:
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
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
        notif = _Notif()
        try:
            fcntl.ioctl(listener, _NOTIF_RECV, notif)
        except OSError:
            continue  # the caller died meanwhile (ENOENT)
        if not swapped and os.path.basename(_path_of(notif)) == name:
            _libc.syscall(_SYS_RENAMEAT2, _AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
            swapped = True
        resp = _NotifResp(notif.id, 0, 0, _SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        try:
            fcntl.ioctl(listener, _NOTIF_SEND, resp)
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
