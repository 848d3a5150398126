"""Critical Xid errors from the kernel log, without NVML.

The driver reports GPU faults as ``NVRM: Xid (PCI:0000:18:00): 79, ...`` kernel
messages. NVML only offers them as live events, so a hook that starts after the
fact (and, with a valid inventory cache, never calls NVML) reads the kernel's
log instead, through ``<dev_root>/dev/kmsg``. As NVIDIA's device plugin does,
every Xid counts as critical except those an application causes by itself.

/dev/kmsg hands out one record per read(2): the whole ring buffer costs ~2 µs a record
(``make bench`` times its machine's own log), ~3 ms for a full 128 KiB buffer of a busy
container host's lines and ~25 ms for a 1 MiB one, on every GPU start. gpuhookd reads it once
instead (``XidLog``): each record as it arrives, by whichever process of the pool comes first, the
critical Xids read so far kept where all of them see them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Final

from gpuhook.inventory import bus_key

#: Xids caused by the application, not the GPU (k8s-device-plugin's default skip list).
APPLICATION_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
_XID: Final = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\): (\d+)")
_MAX_LOG: Final = 8 << 20
#: the XidLog a gpuhookd pool shares (``share``), or None: every start reads the whole log
_shared: XidLog | None = None


def parse_xids(log: str) -> tuple[tuple[str, int], ...]:
    """The critical (bus key, Xid) pairs in kernel-log text, in order, without repeats."""
    found = dict.fromkeys(
        (bus_key(f"{m[1]}:{m[2]}:{m[3]}"), int(m[4])) for m in _XID.finditer(log) if int(m[4]) not in APPLICATION_XIDS
    )
    return tuple(found)


def read_xids(dev_root: Path) -> tuple[tuple[str, int], ...]:
    """Critical Xids in ``<dev_root>/dev/kmsg``: those the pool's ``XidLog`` has read, else the whole ring
    buffer's (bounded in size)."""
    if _shared is not None and _shared.dev_root == dev_root:
        with contextlib.suppress(OSError, ValueError):  # never seen: then the log is read whole, as by a hook
            return _shared.read_new()
    try:
        fd = os.open(dev_root / "dev" / "kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ()  # no kernel log to read (e.g. inside a container): nothing is known
    try:
        return parse_xids(read_records(fd).decode("utf-8", "replace"))
    finally:
        os.close(fd)


def read_records(fd: int) -> bytes:
    """What *fd* holds from where it is to its end (at most ``_MAX_LOG`` bytes)."""
    chunks, size = [], 0
    while size < _MAX_LOG:
        try:
            chunk = os.read(fd, 65536)  # /dev/kmsg returns one record per read
        except BlockingIOError:
            break  # the end of the ring buffer
        except BrokenPipeError:
            continue  # records were overwritten while reading: go on with the next one
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class XidLog:
    """The kernel log's critical Xids, read once for a pool of processes forked after it is made.

    It holds ``<dev_root>/dev/kmsg`` open: the kernel keeps one read position per open file, which
    every forked process shares, so each record is read by exactly one of them. What was read is
    kept in a memfd they share too (the critical Xids as JSON), under a POSIX lock (one owner per
    process): ``read_new`` takes the lock, reads the records no one has read yet and returns every
    critical Xid read since the log was opened, which then began with the whole ring buffer. An Xid
    so stays known while gpuhookd runs, even after the ring has dropped its record (a fault the ring
    forgets under a busy host's log lines is not a repair). The daemon calls ``read_new`` whenever
    the log has records (``fileno``), so that none is overwritten unread.
    """

    def __init__(self, dev_root: Path) -> None:
        """Open the log of *dev_root* and read the ring buffer; raises OSError, ValueError for a log that is not
        the kernel's (a character device: only that one hands each record to one reader)."""
        self.dev_root = dev_root
        self._log = os.open(dev_root / "dev" / "kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISCHR(os.fstat(self._log).st_mode):
                raise ValueError(f"{dev_root / 'dev' / 'kmsg'} is not a character device")
            self._state = os.memfd_create("gpuhook-xids", os.MFD_CLOEXEC)
        except BaseException:
            os.close(self._log)
            raise
        self.read_new()

    def fileno(self) -> int:
        """The log, readable while it has records no process of the pool has read."""
        return self._log

    def read_new(self) -> tuple[tuple[str, int], ...]:
        """Read the records that came since the last read (by any process of the pool); every critical Xid read
        so far, in the order first read. Raises OSError (ValueError for a state no process wrote)."""
        import fcntl  # gpuhookd only: a hook reads the whole log

        fcntl.lockf(self._state, fcntl.LOCK_EX)
        try:
            stored = os.pread(self._state, os.fstat(self._state).st_size, 0)
            known = [(bus, xid) for bus, xid in json.loads(stored or b"[]")]
            new = read_records(self._log)
            if not new:
                return tuple(known)
            found = tuple(dict.fromkeys((*known, *parse_xids(new.decode("utf-8", "replace")))))
            data = json.dumps(found).encode()  # never shorter than before: the set only grows
            os.pwrite(self._state, data, 0)
            os.ftruncate(self._state, len(data))
            return found
        finally:
            fcntl.lockf(self._state, fcntl.LOCK_UN)


def share(log: XidLog | None) -> None:
    """Have ``read_xids`` of *log*'s dev_root ask *log* (gpuhookd, before it forks its workers); None: stop."""
    global _shared  # noqa: PLW0603 - one per process, set once by the daemon, inherited by its forks
    _shared = log
