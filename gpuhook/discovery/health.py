"""Critical Xid errors from the kernel log, without NVML.

The driver reports GPU faults as ``NVRM: Xid (PCI:0000:18:00): 79, ...`` kernel
messages. NVML only offers them as live events, so a hook that starts after the
fact (and, with a valid inventory cache, never calls NVML) reads the kernel's
log instead, through ``<dev_root>/dev/kmsg``. As NVIDIA's device plugin does,
every Xid counts as critical except those an application causes by itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from gpuhook.inventory import bus_key

#: Xids caused by the application, not the GPU (k8s-device-plugin's default skip list).
APPLICATION_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
_XID: Final = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\): (\d+)")
_MAX_LOG: Final = 8 << 20


def parse_xids(log: str) -> tuple[tuple[str, int], ...]:
    """The critical (bus key, Xid) pairs in kernel-log text, in order, without repeats."""
    found = dict.fromkeys(
        (bus_key(f"{m[1]}:{m[2]}:{m[3]}"), int(m[4])) for m in _XID.finditer(log) if int(m[4]) not in APPLICATION_XIDS
    )
    return tuple(found)


def read_xids(dev_root: Path) -> tuple[tuple[str, int], ...]:
    """Critical Xids in ``<dev_root>/dev/kmsg`` (the whole ring buffer; bounded in size)."""
    try:
        fd = os.open(dev_root / "dev" / "kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ()  # no kernel log to read (e.g. inside a container): nothing is known
    chunks, size = [], 0
    try:
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
    finally:
        os.close(fd)
    return parse_xids(b"".join(chunks).decode("utf-8", "replace"))
