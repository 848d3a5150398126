"""RootfsChanges.commit: the parent's word to an apply child holding its changes."""

from __future__ import annotations

import socket
import time

import pytest

from gpuhook.apply import _COMMIT, _KEPT, ApplyReport, RootfsChanges
from gpuhook.errors import ApplyError


def _changes(deadline_in: float) -> tuple[RootfsChanges, socket.socket]:
    ours, child = socket.socketpair()
    return RootfsChanges(ApplyReport(), "/rootfs", ours, time.monotonic() + deadline_in), child


def test_with_time_to_spare_the_word_alone_commits() -> None:
    """The child waits for the word until after our deadline: it keeps them, its answer is not awaited."""
    changes, child = _changes(60)
    changes.commit()  # the child says nothing: no wait
    assert child.recv(1) == _COMMIT
    assert child.recv(1) == b""  # and our end is closed


def test_near_the_deadline_the_childs_word_is_awaited() -> None:
    changes, child = _changes(0.5)
    child.send(_KEPT)
    changes.commit()
    assert child.recv(1) == _COMMIT


def test_near_the_deadline_a_child_that_undid_them_is_an_error() -> None:
    changes, child = _changes(0.5)
    child.close()  # it gave up waiting (or died) and undid the changes
    with pytest.raises(ApplyError, match="did not keep its changes"):
        changes.commit()
