"""Reading the hook's inputs with bounds: stdin with a size cap and a deadline, config.json safely.

Import-light on purpose (the no-GPU fast path uses it): os, select, stat, time.
"""

from __future__ import annotations

import os
import select
import stat
import time

from gpuhook.errors import SpecError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO

STDIN_TIMEOUT = 5.0


def read_bounded(stream: BinaryIO, *, limit: int, timeout: float = STDIN_TIMEOUT) -> bytes:
    """Read *stream* to EOF, at most *limit* + 1 bytes, giving up after *timeout* seconds.

    A writer that never closes stdin must not hang the container start.
    """
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


def read_config_json(bundle: str, *, limit: int, root_fd: int | None = None) -> bytes:
    """``<bundle>/config.json``: never through a symlink, never a FIFO, at most *limit* bytes.

    *root_fd*: resolve *bundle* from this root instead of ours (gpuhookd, for gpuhook-relay: the
    hook's root, passed as an fd). A lookup from an fd walks the mounts of the namespace that fd
    belongs to, and RESOLVE_IN_ROOT keeps ``..`` and absolute symlinks inside it, so the bundle
    is found exactly as the hook process itself would find it.
    """
    path = f"{bundle}/config.json"
    if not bundle.startswith("/"):
        raise SpecError(f"the bundle {bundle!r} must be an absolute path")
    try:
        if root_fd is None:
            bundle_fd = os.open(bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            from gpuhook import linux

            bundle_fd = linux.openat2(root_fd, bundle.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY,
                                      linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS)
        try:
            # O_NOFOLLOW: never a symlink to a host file; O_NONBLOCK: a FIFO cannot hang the open.
            fd = os.open("config.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=bundle_fd)
        finally:
            os.close(bundle_fd)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise SpecError(f"cannot open {path}: {getattr(err, 'strerror', None) or err}") from err
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise SpecError(f"{path} is {st.st_size} bytes; the limit is {limit}")
        return handle.read(limit + 1)
