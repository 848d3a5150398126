"""Fixtures shared by every test directory."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host
from integration.relay import install_relay


def readable_host(tmp_path_factory: pytest.TempPathFactory, name: str, *, gpus: int) -> FakeHost:
    """A simulated host with *gpus* GPUs; world-readable so unprivileged commands can read it."""
    parent = tmp_path_factory.mktemp(name)
    for path in (parent, *parent.parents):
        if path == Path("/tmp"):
            break
        path.chmod(0o755)
    return create_host(parent / "host", gpus=gpus)


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """A simulated 4-GPU host; world-readable so unprivileged commands can read it."""
    return readable_host(tmp_path_factory, "fakehost", gpus=4)


@pytest.fixture(scope="session")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpuhook-relay, built from relay/gpuhook-relay.c, beside the ``gpuhook`` launcher it falls back to."""
    return install_relay(tmp_path_factory.mktemp("relay") / "bin", sys.executable)


@pytest.fixture(scope="session", autouse=True)
def no_mps_daemon_left() -> Iterator[None]:
    """Issue 17: no MPS control daemon a test (or gpuhook for it) started outlives the test session."""
    before = set(_mps_daemons())
    yield
    left = [pid for pid in _mps_daemons() if pid not in before]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"MPS control daemons left running after the tests (now killed): {left}"


def _mps_daemons() -> list[int]:
    """The pids of running (not zombie) nvidia-cuda-mps-control processes."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and "(nvidia-cuda-mps" in stat and stat.rsplit(")", 1)[1].split()[0] not in "ZX":
            found.append(int(entry))
    return found
