"""Fixtures shared by every test directory."""

from __future__ import annotations

import sys
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
