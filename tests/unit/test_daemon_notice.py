"""gpuhookd's side of gpuhook-relay's `no-gpu` notice (server.take_notice, and handle for one not yet whole).

Real unix sockets (a socketpair: its peer credentials are this root process's), a real config and log file.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from gpuhook.daemon import server, wire


@pytest.fixture
def own(tmp_path: Path) -> server.OwnConfig:
    if os.geteuid() != 0:
        pytest.fail("the notice is logged for root's only: run as root (make test does)")
    config = tmp_path / "gpuhook.yaml"
    config.write_text(f"log_file: {tmp_path / 'gpuhook.log'}\nlog_level: info\nstate_dir: null\n")
    return server.OwnConfig(str(config), required=True)


def _logged(own: server.OwnConfig) -> list[tuple[str, str, str]]:
    log = Path(own.path).parent / "gpuhook.log"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [(e["event"], e["container_id"], e["served_by"]) for e in events]


def test_a_whole_notice_is_logged_at_once(own: server.OwnConfig) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(wire.encode_request(wire.NO_GPU, [b"ctr-1"]))
        assert server.take_notice(ours, own) is True
    assert _logged(own) == [("no_gpu_requested", "ctr-1", "gpuhookd")]


@pytest.mark.parametrize("sent", [
    pytest.param(b"", id="nothing-yet"),
    pytest.param(b"gpuhookd/1 no-gpu 5\nctr", id="not-whole-yet"),
    pytest.param(b"gpuhookd/1 no-gpu 5\nctr-1 and more", id="longer-than-it-says"),
    pytest.param(wire.encode_request(b"ping", [b"0.1.0"]), id="a-ping"),
    pytest.param(b"gpuhookd/1 no-gpu 999\n" + b"c" * 999, id="longer-than-a-relays"),
])
def test_anything_else_is_left_to_the_request_path(own: server.OwnConfig, sent: bytes) -> None:
    """Nothing is read (the request path then reads it whole, or refuses it) and nothing is logged."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(sent)
        assert server.take_notice(ours, own) is False
        ours.setblocking(False)
        assert (ours.recv(4096) if sent else b"") == sent
    assert _logged(own) == []


def test_a_notice_not_whole_at_first_is_read_by_the_request_path(own: server.OwnConfig) -> None:
    """The relay's write can come after the worker's peek (a preempted relay): handle reads and logs it, no reply."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert server.take_notice(ours, own) is False
        theirs.sendall(wire.encode_request(wire.NO_GPU, [b"ctr-2"]))
        theirs.shutdown(socket.SHUT_WR)
        assert server.handle(ours, request_timeout=5, config=own) is None
        ours.close()  # as the worker does next
        theirs.settimeout(5)
        assert theirs.recv(4096) == b""  # no reply was sent: the relay has gone
    assert _logged(own) == [("no_gpu_requested", "ctr-2", "gpuhookd")]
