"""Kill the hook (or a gpuhookd worker) at one exact syscall of its apply step (x86_64):
``python -I killat.py REPORT TRIGGER {hook|worker} -- ARGV...``.

Installs a seccomp filter that turns the trigger's syscalls into user notifications
(``SECCOMP_RET_USER_NOTIF``), forks a supervisor that holds the listener, and execs ARGV (the hook,
or ``gpuhook daemon``). TRIGGER is a comma-separated sequence of steps, each ``NR``, ``NR=NAME``
(the call's path argument ends in NAME) or ``NR^TEXT`` (a send of exactly the bytes TEXT); the supervisor
waits for them in order, and at the last one SIGKILLs ``hook``: the process it execs, or ``worker``:
the gpuhookd worker the calling process belongs to; once that process is dead, it lets the call go
on (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``), so the apply child finds itself orphaned in the middle
of that very step. It writes ``killed PID at NR`` to the FIFO REPORT, and closes REPORT once every
apply child of the killed process has exited (its undo is over): the test's event to wait for.

The supervisor answers every notification until the traced processes are gone (the listener
hangs up) or 120 s; it never dies with its parent (a dead listener would fail the calls).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import socket
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

# Path argument indexes: openat(dirfd, path), mknodat(dirfd, path), symlinkat(target, dirfd, path),
# execveat(dirfd, path).
_PATH_ARG = {257: 1, 259: 1, 266: 2, 322: 1}


def _parse(trigger: str) -> list[tuple[int, str, bytes | int | None]]:
    """(nr, kind, value) per step: kind "" (any call), "=" (path ends in value) or "#" (length is value)."""
    steps: list[tuple[int, str, bytes | int | None]] = []
    for step in trigger.split(","):
        if "=" in step:
            nr, name = step.split("=", 1)
            steps.append((int(nr), "=", os.fsencode(name)))
        elif "^" in step:
            nr, text = step.split("^", 1)
            steps.append((int(nr), "^", os.fsencode(text)))
        else:
            steps.append((int(step), "", None))
    return steps


def _install(nrs: set[int]) -> int:
    """Install the notifying filter for *nrs*; returns the listener fd."""
    program = [SockFilter(0x20, 0, 0, 4), SockFilter(0x15, 1, 0, AUDIT_ARCH_X86_64),
               SockFilter(0x06, 0, 0, SECCOMP_RET_ALLOW), SockFilter(0x20, 0, 0, 0)]
    for nr in sorted(nrs):
        program += [SockFilter(0x15, 0, 1, nr), SockFilter(0x06, 0, 0, SECCOMP_RET_USER_NOTIF)]
    program.append(SockFilter(0x06, 0, 0, SECCOMP_RET_ALLOW))
    filters = (SockFilter * len(program))(*program)
    prog = SockFprog(len(program), filters)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(prog))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    return int(fd)


def _matches(notif: Notif, step: tuple[int, str, bytes | int | None]) -> bool:
    nr, kind, value = step
    if notif.data.nr != nr:
        return False
    if kind == "^":
        assert isinstance(value, bytes)
        return int(notif.data.args[2]) == len(value) and _memory(notif.pid, notif.data.args[1], len(value)) == value
    if kind == "=":
        return os.path.basename(_path_of(notif)) == value
    return True


def _path_of(notif: Notif) -> bytes:
    """The path argument of the notified call, read from the caller's memory (b"" if unreadable)."""
    index = _PATH_ARG.get(notif.data.nr)
    if index is None:
        return b""
    return _memory(notif.pid, notif.data.args[index], 4096).split(b"\0", 1)[0]


def _memory(pid: int, address: int, size: int) -> bytes:
    """*size* bytes at *address* in *pid* (b"" if unreadable)."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.pread(fd, size, address)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _victims(caller: int, root: int, target: str) -> tuple[int, list[int]]:
    """(the process to kill, the apply children whose exit ends the undo) for a call made by *caller*."""
    chain = [caller]
    while chain[-1] != root and chain[-1] > 1:
        chain.append(_ppid(chain[-1]))
    if chain[-1] != root:
        raise RuntimeError(f"pid {caller} does not descend from {root}")
    kill = root if target == "hook" else chain[-2]  # a worker: the daemon's child
    below = chain[:chain.index(kill)]
    return kill, ([below[-1]] if below else [c for c in _children(kill) if c != os.getpid()])


def _supervise(listener: int, report: int, steps: list[tuple[int, str, bytes | int | None]], root: int,
               target: str) -> None:
    """Answer notifications; at the trigger, kill and report; close *report* once the undo is over."""
    deadline = time.monotonic() + 120
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    waiting: dict[int, int] = {}  # pidfd -> pid of an apply child still undoing
    while time.monotonic() < deadline:
        events = poller.poll(1000)
        for fd, ev in events:
            if fd in waiting:
                poller.unregister(fd)
                os.close(fd)
                del waiting[fd]
                if not waiting and report >= 0:
                    os.close(report)
                    report = -1
            elif ev & (select.POLLHUP | select.POLLERR):
                return
        if not any(fd == listener and ev & select.POLLIN for fd, ev in events):
            continue
        notif = Notif()
        try:
            fcntl.ioctl(listener, NOTIF_RECV, notif)
        except OSError:
            continue  # the caller died meanwhile (ENOENT)
        if steps and _matches(notif, steps[0]):
            steps.pop(0)
            if not steps:
                kill, children = _victims(notif.pid, root, target)
                for child in children:
                    pidfd = os.pidfd_open(child)
                    waiting[pidfd] = child
                    poller.register(pidfd, select.POLLIN)
                killed = os.pidfd_open(kill)
                signal.pidfd_send_signal(killed, signal.SIGKILL)
                select.select([killed], [], [])  # dead before the call goes on
                os.close(killed)
                os.write(report, f"killed {kill} at {notif.data.nr}; undo by {sorted(waiting.values())}\n".encode())
                if not waiting:
                    os.close(report)
                    report = -1
        resp = NotifResp(notif.id, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        try:
            fcntl.ioctl(listener, NOTIF_SEND, resp)
        except OSError:
            continue


def main(argv: list[str]) -> int:
    """Open the report, install, fork the supervisor, exec the command."""
    if os.uname().machine != "x86_64":
        raise SystemExit("killat.py: the syscall numbers here are x86_64's")
    split = argv.index("--")
    report_path, trigger, target = argv[0], argv[1], argv[2]
    command = argv[split + 1:]
    steps = _parse(trigger)
    report = os.open(report_path, os.O_WRONLY | os.O_CLOEXEC)
    root = os.getpid()
    # The supervisor is forked before the filter exists (its own calls must not wait on itself) and
    # gets the listener over a socket.
    ours, theirs = socket.socketpair()
    if os.fork() == 0:
        try:
            ours.close()
            os.chdir("/")
            _, [listener], _, _ = socket.recv_fds(theirs, 1, 1)
            theirs.close()
            _supervise(listener, report, steps, root, target)
        finally:
            os._exit(0)
    theirs.close()
    listener = _install({nr for nr, _, _ in steps})
    socket.send_fds(ours, [b"l"], [listener])
    ours.close()
    os.close(listener)
    os.close(report)
    os.execv(command[0], command)
    return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
