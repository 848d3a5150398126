"""A child forked before its work is known, so that the work does not wait for the fork.

Forking a large process copies its page tables: in a VM that is milliseconds per fork. An idle
gpuhookd worker forks its apply child ahead (which forks its own ldconfig child ahead, and waits);
the request hands it the plan and fds over a socketpair, and from there each child runs exactly
the code a freshly forked one would. Before the work, the parent may send hints (the apply child:
the container's rootfs, whose libraries it reads while the worker plans); a hint only ever reads,
and one that fails is ignored. Only gpuhookd uses this: a hook process forks at once.

(Pre-faulting all of the children's memory with MADV_POPULATE_WRITE saved ~5 ms per request on a
quiet machine but cost ~25 ms of CPU and ~15 MiB per prepared process, and measured slower under
load in ``make bench``: only the pages the last child of its kind wrote are copied in, ``learned``.)
"""

from __future__ import annotations

import contextlib
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
    #: (payload, fds) -> None: reading that makes the work quicker, before the work is known; changes nothing
    #: and leaves the fds open (they are closed after it)
    Hint = Callable[[bytes, list[int]], None]

#: the payload (a pickled plan) stays far below this; the limit only bounds a broken parent
PAYLOAD_LIMIT = 64 << 20
#: a frame's kind and the payload's length, sent before it (the channel stays open after the work's payload)
_HEADER = struct.Struct("<cQ")
_HINT, _WORK = b"h", b"w"
MAX_FDS = 8
#: the nice value a child takes once its work is answered (gpuhookd's spares prepare at it too)
_LOWEST = 19


class ChildAhead:
    """A forked child waiting for its work; ``start`` hands it over (once)."""

    def __init__(self, work: Work, *, priority: int, close: Sequence[int] = (),
                 prepare: Prepare | None = None, learned: tuple[prefault.Learned, prefault.Role] | None = None,
                 hint: Hint | None = None) -> None:
        """Fork now. The child closes *close* (its parent's fds it must not hold), runs
        ``prepare(its own fds to keep out, priority)`` (to fork its own child ahead), copies in the
        pages its predecessors of that role wrote (*learned*), takes the nice value *priority* (it was
        forked by an idle process at the lowest), waits (running ``hint(payload, fds)`` for each hint
        sent before the work), then runs ``work(payload, fds, report_fd, prepared)``, keeps the pages it
        wrote as that role's newest and exits with its status."""
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
                status = _wait_for_work(child_end, write_fd, work, parent, priority, prepare, learned, hint)
            except BaseException as err:  # noqa: BLE001 - say why (the journal), never unwind into the forker
                os.write(2, f"gpuhookd: a child forked ahead failed: {err!r}\n".encode())
            finally:
                os._exit(status)
        child_end.close()
        os.close(write_fd)
        self.pid = pid
        self._channel: socket.socket | None = parent_end
        self._report_fd = read_fd

    def hint(self, payload: bytes, fds: Sequence[int]) -> None:
        """Send the child a hint (its ``hint`` runs it while the work is not yet known); raises OSError."""
        if self._channel is None:
            raise RuntimeError("this child was already started or cancelled")
        _send_frame(self._channel, _HINT, payload, fds)

    def start(self, payload: bytes, fds: Sequence[int]) -> tuple[int, int, socket.socket]:
        """Send *payload* and *fds* to the child; (its pid, the fd its report arrives on, the channel).

        The payload goes length first, so the channel stays open both ways after it: the child
        sees its EOF only when the caller closes it, or dies."""
        channel, self._channel = self._channel, None
        if channel is None:
            raise RuntimeError("this child was already started or cancelled")
        try:
            _send_frame(channel, _WORK, payload, fds)
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


def _send_frame(channel: socket.socket, kind: bytes, payload: bytes, fds: Sequence[int]) -> None:
    """One frame: its kind and length, the payload; *fds* ride on its first byte."""
    framed = _HEADER.pack(kind, len(payload)) + payload
    sent = channel.sendmsg([framed], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdpass.pack_fds(fds))])
    if sent < len(framed):
        # Not sendall(b""): a child that has its whole payload may already have gone on (an exec
        # closes the channel), and a zero-length send to a closed peer fails with EPIPE.
        channel.sendall(framed[sent:])


def _wait_for_work(channel: socket.socket, report_fd: int, work: Work, parent: int, priority: int,
                   prepare: Prepare | None, learned: tuple[prefault.Learned, prefault.Role] | None,
                   hint: Hint | None) -> int:
    """The child's side: prepare, wait for the payload (or EOF: cancelled), taking hints meanwhile, run the
    work."""
    process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the process that forked us
    if os.getppid() != parent:
        return 0
    prepared = prepare((channel.fileno(), report_fd), priority) if prepare is not None else None
    if learned is not None:
        prefault.populate(learned[0].load(learned[1]))  # after prepare's fork, which would share the copies
    os.setpriority(os.PRIO_PROCESS, 0, priority)  # prepared: wake for the work at full priority
    while (frame := _read_frame(channel)) is not None and frame[0] == _HINT:
        _, payload, fds = frame
        if hint is not None:
            with contextlib.suppress(Exception):  # only ever a head start: the work does it all again
                hint(payload, fds)
        for fd in fds:  # the hint's to use, not to close
            os.close(fd)
    if frame is None:  # cancelled (or a broken parent)
        channel.close()
        if prepared is not None:
            prepared.cancel()
        return 0
    _, payload, fds = frame
    status = work(payload, fds, report_fd, prepared, channel)
    if learned is not None:  # the work is done and answered: at the lowest priority, for the next child
        os.setpriority(os.PRIO_PROCESS, 0, _LOWEST)
        learned[0].store(learned[1], prefault.written_pages())
    return status


def _read_frame(channel: socket.socket) -> tuple[bytes, bytes, list[int]] | None:
    """The next frame: (kind, payload, the fds that came with it); None at EOF, or for a broken one. Reads
    exactly the frame (its header, then its payload), so no byte of the next one is taken with it."""
    fds: list[int] = []
    header = _receive(channel, _HEADER.size, fds)
    kind, size = _HEADER.unpack(header) if header is not None else (b"", 0)
    payload = _receive(channel, size, fds) if kind in (_HINT, _WORK) and size <= PAYLOAD_LIMIT else None
    if payload is None:  # EOF first, or a broken parent
        for fd in fds:
            os.close(fd)
        return None
    return kind, payload, fds


def _receive(channel: socket.socket, size: int, fds: list[int]) -> bytes | None:
    """Exactly *size* bytes (the fds that arrive with them added to *fds*), or None at EOF first."""
    if size == 0:
        return b""
    data = bytearray()
    while len(data) < size:
        chunk, ancillary, _, _ = channel.recvmsg(size - len(data), socket.CMSG_SPACE(MAX_FDS * 4),
                                                 socket.MSG_CMSG_CLOEXEC)
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += fdpass.unpack_fds(raw)
        if not chunk:
            return None
        data += chunk
    return bytes(data)

