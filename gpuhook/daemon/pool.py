"""gpuhookd's workers: how many wait, when one is forked, and how a slow client costs only its own.

The daemon (the parent) never touches a connection; it only forks workers, counts them and
watches the lease holders (``holders``: a container's lease is released when its init exits).
Each worker tells it, one byte on its own socketpair, when it has accepted a connection
(``BUSY``), when it waits again (``IDLE``) and when it has answered a GPU request and exits
(``DONE``; EOF says the same). The pages a worker's start wrote (and its apply child's) go into a
region the whole pool shares (``sys.prefault.Learned``): the next ones copy them in while they
wait. The daemon keeps ``spares`` workers idle:

* a worker that accepts while no other idle worker remains is replaced at once, so a client
  that sends nothing (or a byte a second) holds one worker, at most ``READ_TIMEOUT`` seconds,
  and never delays the next container start;
* while another idle worker remains, the replacement is forked when the busy one answers:
  preparing it (fork, apply child, ldconfig child) would take CPU from the request;
* never more than ``max_workers`` in all (one journal line when reached: connections then wait
  in the listen backlog until a worker is free, at most ``READ_TIMEOUT`` for a slow client,
  ``--request-timeout`` for a GPU start);
* an idle worker beyond ``spares`` (after a burst) is told to retire (``RETIRE``).

Idle workers wait in ``epoll`` with ``EPOLLEXCLUSIVE`` on the listener (one woken per
connection, as a blocking accept() would be) and on their socketpair (the retire message).
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import time
import traceback
from dataclasses import dataclass

from gpuhook import service
from gpuhook.daemon import server
from gpuhook.errors import GpuHookError
from gpuhook.daemon.holders import POLL_SECONDS, HolderWatch
from gpuhook.daemon.server import OwnConfig, say
from gpuhook.sys import prefault, process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import NoReturn

    from gpuhook.service import ChildAhead, XidLog

#: Workers kept forked and idle; more absorb a burst of container starts.
SPARE_WORKERS = 2
#: The most workers at once: idle, preparing and serving (each maps ~22 MiB, mostly shared with the daemon;
#: ~7 MiB of its own, and its apply child ~6, once they have copied in the pages a start writes).
MAX_WORKERS = 32
IDLE_NICE = 19
BUSY, IDLE, DONE, RETIRE = b"b", b"i", b"x", b"r"
#: Requests a worker answers without entering a hook's view (no GPU asked, pings, declines) before
#: it retires anyway: it runs with the collector off, so whatever cycles a request leaves stay.
ANSWERS_PER_WORKER = 256


@dataclass(slots=True)
class _Worker:
    """The daemon's view of one worker (mutable: it changes with every byte the worker sends)."""

    pid: int
    end: socket.socket
    busy: bool = False
    retiring: bool = False


def serve(listener: socket.socket, *, request_timeout: float, config: OwnConfig, spares: int = SPARE_WORKERS,
          max_workers: int = MAX_WORKERS) -> NoReturn:
    """Keep *spares* workers idle (module docstring); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    # Forking and preparing spares happens while other workers serve containers: at the lowest
    # priority (nice 19, never starved as SCHED_IDLE could be), so it does not slow them down.
    # A prepared worker (and each child it forked ahead) takes the daemon's own priority back.
    normal = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, IDLE_NICE)
    # Idle workers wait in epoll; the ones woken for a connection another took get EAGAIN, not a block.
    listener.setblocking(False)
    workers: dict[int, _Worker] = {}  # fd of the daemon's end -> the worker
    holders = HolderWatch(config)
    holders.refresh(force=True)
    full = False
    learned = prefault.Learned()  # before the forks: every worker and child shares it
    service.share_library_reads()  # and this
    kernel_log = _kernel_log(config)  # before the forks too: the pool reads each record once
    while True:
        idle = sum(not w.busy and not w.retiring for w in workers.values())
        busy = sum(w.busy for w in workers.values())
        while idle < spares and (idle == 0 or busy == 0):
            if len(workers) >= max_workers:
                if not full:
                    say(f"all {max_workers} workers are in use ({busy} serving); new connections wait in the "
                        "listen backlog until one is free")
                full = True
                break
            try:
                worker = _fork_worker(listener, request_timeout, normal, config, learned,
                                      inherited=[*(w.end.fileno() for w in workers.values()), *holders.fds()])
            except OSError as err:  # EAGAIN, ENOMEM: say so, retry soon
                say(f"fork failed: {err}")
                time.sleep(0.1)
                break
            workers[worker.end.fileno()] = worker
            idle += 1
        full = full and len(workers) >= max_workers
        watched = holders.fds()
        logs = [kernel_log.fileno()] if kernel_log is not None else []
        ready = select.select([*workers, *watched, *logs], [], [], POLL_SECONDS if workers else 0.1)[0]
        ended = False
        for fd in ready:
            if fd in workers:
                ended |= _note(workers, fd, spares)
            elif kernel_log is not None and fd == kernel_log.fileno():
                kernel_log = _read_kernel_log(kernel_log)
            else:
                holders.exited(fd)
        holders.refresh(force=ended)  # a worker that ended may have taken a lease


def _kernel_log(config: OwnConfig) -> XidLog | None:
    """The kernel log the pool reads once (``service.follow_kernel_log``); None where a config does not load."""
    try:
        return service.follow_kernel_log(config.load(False))
    except GpuHookError:
        return None


def _read_kernel_log(log: XidLog) -> XidLog | None:
    """New records in the kernel log: read them now, before the ring overwrites them; the log to go on
    following, or None after an error (never seen; said once: the starts then read the whole log)."""
    try:
        log.read_new()
    except (OSError, ValueError) as err:
        say(f"cannot read the kernel log, no longer followed: {err}")
        return None
    return log


def _note(workers: dict[int, _Worker], fd: int, spares: int) -> bool:
    """Take in what the worker on *fd* says: busy, idle again, or gone (True: it ended)."""
    worker = workers[fd]
    try:
        said = worker.end.recv(64)
    except OSError:
        said = b""
    if not said or DONE in said:  # answered a GPU request (it exits), retired, or died
        worker.end.close()
        del workers[fd]
        return True
    worker.busy = said[-1:] == BUSY
    idle = sum(not w.busy and not w.retiring for w in workers.values())
    if not worker.busy and not worker.retiring and idle > spares:
        worker.retiring = True
        with contextlib.suppress(OSError):  # it is exiting: its EOF follows
            worker.end.send(RETIRE)
    return False


def _fork_worker(listener: socket.socket, request_timeout: float, priority: int, config: OwnConfig,
                 learned: prefault.Learned, inherited: Sequence[int]) -> _Worker:
    """Fork one worker that waits for a connection (*learned*: the pool's pages that starts wrote)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon = os.getpid()
    pid = os.fork()
    if pid != 0:
        theirs.close()
        return _Worker(pid=pid, end=ours)
    code = 0  # pragma: no cover - the worker; exercised through real runc in tests/e2e
    try:
        ours.close()
        for fd in inherited:  # the daemon's ends of the other workers' socketpairs, its holders' pidfds
            os.close(fd)
        gc.disable()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the worker waits for its own children
        # Idle workers go with the daemon; one serving a request finishes it (PDEATHSIG off again).
        process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != daemon:  # it died before the prctl
            os._exit(0)
        ahead: list[ChildAhead] = []

        def prepare() -> None:
            """Before a request waits for it: the apply child's fork (once), then full priority to
            wake for a request."""
            if not ahead:
                # Before the fork: the apply child inherits what was read (the driver's libraries).
                native = service.prepare_worker(config.path, required=config.required)
                ahead.append(service.fork_apply_ahead(close=(listener.fileno(), theirs.fileno()), priority=priority,
                                                      ldconfig_ahead=not native, learned=learned))
                # After that fork, which would share the copies again:
                prefault.populate(learned.load(prefault.Role.WORKER))
            os.setpriority(os.PRIO_PROCESS, 0, priority)

        conn, request = _answer_until_gpu_request(listener, theirs, daemon, request_timeout, config, priority,
                                                  prepare)
        listener.close()
        apply_child = ahead[0] if ahead else None
        try:
            server.serve_gpu_request(conn, request, apply_child, config)
        finally:
            conn.close()
            # The pages this start wrote, for the replacement (before it forks), read at the lowest priority:
            # the container's start goes on meanwhile.
            os.setpriority(os.PRIO_PROCESS, 0, IDLE_NICE)
            learned.store(prefault.Role.WORKER, prefault.written_pages())
            # Now the daemon forks a replacement (if no other idle worker took this one's place):
            # preparing it while this request ran would take CPU from it.
            _tell(theirs, DONE)
            if apply_child is not None:
                apply_child.cancel()  # unless the request started it
    except BaseException:  # noqa: BLE001 - a worker never unwinds into the daemon's loop
        say(f"request failed:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


def _answer_until_gpu_request(listener: socket.socket, daemon_end: socket.socket, daemon: int,
                              request_timeout: float, config: OwnConfig, priority: int,
                              prepare: Callable[[], None]) -> tuple[socket.socket, server.HookWork]:
    """Accept connections and answer those that need no GPU work; return the first that does.

    A container that asks for no GPU (a relay's `no-gpu` notice, or a start the relay was not certain
    of) changes nothing in the worker, so the same prepared worker waits for the next connection: most
    container starts on a hooks.d ``always`` host cost the daemon no fork at all.
    """
    waiter = select.epoll()
    waiter.register(listener.fileno(), select.EPOLLIN | select.EPOLLEXCLUSIVE)
    waiter.register(daemon_end.fileno(), select.EPOLLIN)
    for _ in range(ANSWERS_PER_WORKER):
        conn = _accept(listener, daemon_end, waiter, prepare)
        # The connect woke this worker on the caller's CPU (a sync wake-up), before the caller sent anything:
        # let it send (and a relay's no-gpu notice exit) before this worker's Python runs. The connect and
        # send of a notice took the relay ~355 µs with this worker ahead of it, ~175 µs after it.
        os.sched_yield()
        # Most no-GPU starts: one log line, nothing for the pool to know (gpuhookd's CPU per notice, both
        # processes: ~0.77 ms through the request path, ~0.59 ms here).
        if server.take_notice(conn, config):
            conn.close()
            continue
        os.setpriority(os.PRIO_PROCESS, 0, priority)  # a burst's connection, served before prepare()
        process.prctl(process.PR_SET_PDEATHSIG, 0)  # the daemon's end no longer ends this request
        _tell(daemon_end, BUSY)
        request = server.handle(conn, request_timeout=request_timeout, config=config)
        if request is not None:
            waiter.close()
            return conn, request
        conn.close()
        process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != daemon:
            os._exit(0)
        _tell(daemon_end, IDLE)
    os._exit(0)  # retired: the daemon sees the EOF and forks a fresh one


def _accept(listener: socket.socket, daemon_end: socket.socket, waiter: select.epoll,
            prepare: Callable[[], None]) -> socket.socket:
    """The next connection; exits when the daemon says retire (or is gone). Transient errors
    (EMFILE, ENOBUFS, ...) are reported and retried.

    A connection already queued (a burst of container starts) is taken at once, before
    *prepare* forks anything; only a worker that found none (its accept() said EAGAIN, which no
    other worker can race) prepares, then waits. Deciding on a peek instead would leave a worker
    that saw a connection another then took waiting unprepared: EPOLLEXCLUSIVE need not wake it.
    """
    while True:
        try:
            return listener.accept()[0]
        except BlockingIOError:
            pass  # none waits, or another worker took it
        except OSError as err:
            say(f"accept failed: {err}")
            time.sleep(0.1)
            continue
        prepare()
        events = dict(waiter.poll())
        if daemon_end.fileno() in events and listener.fileno() not in events:  # RETIRE, or EOF: the daemon is gone
            os._exit(0)


def _tell(daemon_end: socket.socket, what: bytes) -> None:
    """One byte to the daemon; a daemon that is gone needs no news."""
    with contextlib.suppress(OSError):
        daemon_end.send(what)
