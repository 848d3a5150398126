"""A child forked before its work is known (apply.ahead.ChildAhead): hints first, then the work, over one channel."""

from __future__ import annotations

import json
import os
import socket

import pytest

from gpuhook.apply.ahead import ChildAhead

#: what the child's hints saw, in the child (it runs the hints and the work in one process)
_SEEN: list[list[str]] = []


def _hint(payload: bytes, fds: list[int]) -> None:
    if payload == b"fail":
        raise RuntimeError("a hint that fails")
    _SEEN.append([payload.decode(), *(os.read(fd, 64).decode() for fd in fds)])


def _work(payload: bytes, fds: list[int], report_fd: int, prepared: ChildAhead | None,
          channel: socket.socket) -> int:
    os.write(report_fd, json.dumps({"hints": _SEEN, "work": [payload.decode(), *(os.read(fd, 64).decode()
                                                                                for fd in fds)]}).encode())
    os.close(report_fd)
    channel.close()
    return 0


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe holding *data* (its write end closed)."""
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    return read_end


def _report(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def test_hints_arrive_in_order_with_their_fds_then_the_work_a_failing_hint_does_not_stop_it() -> None:
    child = ChildAhead(_work, priority=os.getpriority(os.PRIO_PROCESS, 0), hint=_hint)
    sent = [_pipe_with(b"first fd"), _pipe_with(b"second fd"), _pipe_with(b"work fd")]
    child.hint(b"one", [sent[0]])
    child.hint(b"fail", [])
    child.hint(b"two", [sent[1]])
    pid, report_fd, channel = child.start(b"the work" * 1000, [sent[2]])  # larger than a header's read
    for fd in sent:
        os.close(fd)
    try:
        report = json.loads(_report(report_fd))
    finally:
        channel.close()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert report == {"hints": [["one", "first fd"], ["two", "second fd"]], "work": ["the work" * 1000, "work fd"]}


def test_a_child_given_hints_but_no_work_exits_without_it() -> None:
    """Cancelled after a hint (the start was refused before its plan): the child exits, the work never runs."""
    child = ChildAhead(_work, priority=os.getpriority(os.PRIO_PROCESS, 0), hint=_hint)
    child.hint(b"one", [])
    pid = child.pid
    child.cancel()  # closes the channel and reaps it: a child still waiting would hang here
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # gone
