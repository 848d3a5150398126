"""A child forked before its work is known, so that the work does not wait for the fork.

Forking a large process copies its page tables: in a VM that is milliseconds per fork. An idle
gpuhookd worker forks its apply child ahead (which forks its own ldconfig child ahead, and waits);
the request hands it the plan and fds over a socketpair, and from there each child runs exactly
the code a freshly forked one would. Only gpuhookd uses this: a hook process forks at once.

(Pre-faulting the children's memory with MADV_POPULATE_WRITE as well saved ~5 ms per request on
a quiet machine but cost ~25 ms of CPU and ~15 MiB per prepared process, and measured slower
under load in ``make bench``: it is not done.)
"""

from __future__ import annotations

import os
import signal
import socket
import struct

from gpuhook.sys import fdpass, prefault, process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    #: (payload, fds, report fd, the child this one prepared, the channel to the parent) -> exit status
    Work = Callable[[bytes, list[int], int, "ChildAhead | None", socket.socket], int]
    #: (fds the prepared child must close, its priority) -> a child forked ahead by this one
    Prepare = Callable[[Sequence[int], int], "ChildAhead"]

#: the payload (a pickled plan) stays far below this; the limit only bounds a broken parent
PAYLOAD_LIMIT = 64 << 20
#: the payload's length, sent before it (the channel stays open after the payload)
_HEADER = struct.Struct("<Q")
MAX_FDS = 8
#: the nice value a child takes once its work is answered (gpuhookd's spares prepare at it too)
_LOWEST = 19


class ChildAhead:
    """A forked child waiting for its work; ``start`` hands it over (once)."""

    def __init__(self, work: Work, *, priority: int, close: Sequence[int] = (),
                 prepare: Prepare | None = None, learned: tuple[prefault.Learned, prefault.Role] | None = None,
                 ) -> None:
        """Fork now. The child closes *close* (its parent's fds it must not hold), runs
        ``prepare(its own fds to keep out, priority)`` (to fork its own child ahead), copies in the
        pages its predecessors of that role wrote (*learned*), takes the nice value *priority* (it was
        forked by an idle process at the lowest), waits, then runs ``work(payload, fds, report_fd,
        prepared)``, keeps the pages it wrote as that role's newest and exits with its status."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked child; exercised through gpuhookd in tests/e2e
            parent_end.close()
            for fd in (read_fd, *close):
                os.close(fd)
            status = 1
            try:
                status = _wait_for_work(child_end, write_fd, work, parent, priority, prepare, learned)
            except BaseException as err:  # noqa: BLE001 - say why (the journal), never unwind into the forker
                os.write(2, f"gpuhookd: a child forked ahead failed: {err!r}\n".encode())
            finally:
                os._exit(status)
        child_end.close()
        os.close(write_fd)
        self.pid = pid
        self._channel: socket.socket | None = parent_end
        self._report_fd = read_fd

    def start(self, payload: bytes, fds: Sequence[int]) -> tuple[int, int, socket.socket]:
        """Send *payload* and *fds* to the child; (its pid, the fd its report arrives on, the channel).

        The payload goes length first, so the channel stays open both ways after it: the child
        sees its EOF only when the caller closes it, or dies."""
        channel, self._channel = self._channel, None
        if channel is None:
            raise RuntimeError("this child was already started or cancelled")
        framed = _HEADER.pack(len(payload)) + payload
        try:
            sent = channel.sendmsg([framed], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdpass.pack_fds(fds))])
            if sent < len(framed):
                # Not sendall(b""): a child that has its whole payload may already have gone on (an exec
                # closes the channel), and a zero-length send to a closed peer fails with EPIPE.
                channel.sendall(framed[sent:])
        except BaseException:
            channel.close()
            raise
        return self.pid, self._report_fd, channel

    def cancel(self) -> None:
        """Let the child go without work (it exits on the closed channel) and reap it."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            os.close(self._report_fd)
            os.waitpid(self.pid, 0)


def _wait_for_work(channel: socket.socket, report_fd: int, work: Work, parent: int, priority: int,
                   prepare: Prepare | None, learned: tuple[prefault.Learned, prefault.Role] | None) -> int:
    """The child's side: prepare, wait for the payload (or EOF: cancelled), run the work."""
    process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the process that forked us
    if os.getppid() != parent:
        return 0
    prepared = prepare((channel.fileno(), report_fd), priority) if prepare is not None else None
    if learned is not None:
        prefault.populate(learned[0].load(learned[1]))  # after prepare's fork, which would share the copies
    os.setpriority(os.PRIO_PROCESS, 0, priority)  # prepared: wake for the work at full priority
    received = bytearray()
    fds: list[int] = []
    size: int | None = None
    while size is None or len(received) < _HEADER.size + size:
        data, ancillary, _, _ = channel.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += fdpass.unpack_fds(raw)
        if not data:
            break
        received += data
        if size is None and len(received) >= _HEADER.size:
            size, = _HEADER.unpack_from(received)
            if size > PAYLOAD_LIMIT:
                break
    if size is None or len(received) != _HEADER.size + size:  # cancelled (or a broken parent)
        channel.close()
        for fd in fds:
            os.close(fd)
        if prepared is not None:
            prepared.cancel()
        return 0
    status = work(bytes(received[_HEADER.size:]), fds, report_fd, prepared, channel)
    if learned is not None:  # the work is done and answered: at the lowest priority, for the next child
        os.setpriority(os.PRIO_PROCESS, 0, _LOWEST)
        learned[0].store(learned[1], prefault.written_pages())
    return status
