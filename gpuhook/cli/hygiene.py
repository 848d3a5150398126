"""Process hygiene for a root hook started by a runtime with inputs it does not control.

* Tripwire: ``LD_*`` and ``PYTHON*`` variables act before Python's first line
  (NVIDIAScape, CVE-2025-23266, was ``LD_PRELOAD`` reaching a root hook), so
  they cannot be undone here; finding one means the registration is unsafe,
  and the hook refuses rather than carry on as if nothing happened.
* The working directory is the bundle (runc) or the rootfs (createContainer
  stages); nothing may depend on it, so the hook moves to ``/`` first.
* Inherited descriptors are marked close-on-exec so no helper inherits them.
* Stdin is read with a size cap and a deadline: a writer that never closes
  it must not hang the container start.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Mapping
from typing import BinaryIO, Final

from gpuhook import linux
from gpuhook.errors import ConfigError, SpecError

#: Harmless interpreter settings some daemons export; everything else PYTHON*/LD_* trips.
_ALLOWED: Final = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"})
STDIN_TIMEOUT: Final = 5.0


def check_environment(env: Mapping[str, str]) -> None:
    """Refuse to run with loader or interpreter variables in the hook's own environment."""
    found = sorted(k for k in env if (k.startswith(("LD_", "PYTHON"))) and k not in _ALLOWED)
    if found:
        raise ConfigError(
            f"the hook's environment sets {', '.join(found)}; they can inject code into a root process "
            "(CVE-2025-23266). Register the hook with an explicit env such as [\"PATH=/usr/sbin:/usr/bin:/sbin:/bin\"]"
        )


def settle_process() -> None:
    """Work from ``/`` and keep inherited descriptors out of every child."""
    os.chdir("/")
    linux.close_range_cloexec(3)


def read_bounded(stream: BinaryIO, *, limit: int, timeout: float = STDIN_TIMEOUT) -> bytes:
    """Read *stream* to EOF, at most *limit* + 1 bytes, giving up after *timeout* seconds."""
    fd = stream.fileno()
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SpecError(f"the OCI state on stdin did not arrive within {timeout:g} s (is stdin closed?)")
        chunk = os.read(fd, min(65536, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
