"""gpuhookd's watch on lease holders: a lease is released the moment its container's init exits.

docker ``--gpus`` (and ``ctr --gpus``) register no poststop, so without this a lease would stay
until the next start's reclaim. The daemon's parent keeps a pidfd per holder in the ledger (a
pidfd turns readable when its process exits) and selects on them beside its workers; it
re-reads the ledger when a worker ends (it may have taken a lease) and, for leases others took
(an in-process hook, ``nvidia-container-cli``), when the ledger file changed, checked once a
second. Each release is the ledger's own transaction (``service.release_gone``), which checks
the holder again, so a watch that is late or wrong releases nothing that still runs.
"""

from __future__ import annotations

import os
import time

from gpuhook import service
from gpuhook.daemon.server import OwnConfig, say
from gpuhook.errors import GpuHookError
from gpuhook.sharing.ledger import Holder
from gpuhook.sys.procstat import start_ticks

#: How often the ledger file is checked for leases the daemon's workers did not take.
POLL_SECONDS = 1.0


class HolderWatch:
    """The pidfds of the holders in the ledger of the daemon's config."""

    __slots__ = ("_checked", "_config", "_seen", "_watched")

    def __init__(self, config: OwnConfig) -> None:
        self._config = config
        self._watched: dict[int, tuple[str, Holder]] = {}  # pidfd -> (container id, holder)
        self._seen: tuple[int, int] | None = None  # the ledger file's (inode, mtime) when last read
        self._checked = -POLL_SECONDS  # time.monotonic() of the last look at the ledger file

    def fds(self) -> list[int]:
        """The pidfds to select on."""
        return list(self._watched)

    def refresh(self, *, force: bool = False) -> None:
        """Watch every holder in the ledger: when *force*d, else at most once per POLL_SECONDS and
        only if the file changed (every write renames a new file in)."""
        if not force and time.monotonic() - self._checked < POLL_SECONDS:
            return
        self._checked = time.monotonic()
        try:
            config = self._config.load(False)
            state_dir = config.state_dir
            if state_dir is None:
                return
            identity = _identity(service.ledger_path(state_dir))
            if identity == self._seen and not force:
                return
            self._seen = identity
            wanted = {(lease.container_id, lease.holder) for lease in service.lease_holders(config)}
        except GpuHookError as err:
            say(f"cannot watch lease holders: {err}")
            return
        for fd, watched in list(self._watched.items()):
            if watched not in wanted:  # released by poststop, by hand or by a reclaim
                del self._watched[fd]
                os.close(fd)
        current = set(self._watched.values())
        gone: list[str] = []
        for container_id, holder in wanted - current:
            pidfd = _pidfd(holder)
            if pidfd is None:
                gone.append(container_id)
            else:
                self._watched[pidfd] = (container_id, holder)
        for container_id in gone:
            self._release(container_id)

    def exited(self, fd: int) -> None:
        """*fd*'s holder exited: release its lease."""
        container_id, _ = self._watched.pop(fd)
        os.close(fd)
        self._release(container_id)

    def _release(self, container_id: str) -> None:
        try:
            service.release_gone(self._config.load(False), container_id)
        except GpuHookError as err:
            say(f"cannot release the lease of {container_id}: {err}")


def _identity(path: os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _pidfd(holder: Holder) -> int | None:
    """A pidfd on *holder*, or None if it no longer runs (checked after opening, so the pid is its own)."""
    try:
        fd = os.pidfd_open(holder.pid)
    except OSError:
        return None
    if start_ticks(holder.pid) != holder.start:
        os.close(fd)
        return None
    return fd

