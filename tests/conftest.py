"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """A simulated 4-GPU host; world-readable so unprivileged commands can read it."""
    parent = tmp_path_factory.mktemp("fakehost")
    for path in (parent, *parent.parents):
        if path == Path("/tmp"):
            break
        path.chmod(0o755)
    return create_host(parent / "host", gpus=4)
