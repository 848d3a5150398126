"""Atomic file replacement: a reader sees the old file or the new one, never half of either.

Writes (the caller's own files: caches, specs, engine configuration), no ctypes. The new
contents go to a private temporary file in the same directory (so the rename is atomic),
created ``O_EXCL|O_NOFOLLOW`` relative to a directory fd (so the directory opened is the
one written), given its mode, then renamed over the target. Nothing is fsync'd: none of
the callers needs it (a cache on tmpfs, a spec the runtime reads at once, a config the
administrator re-checks with ``--dry-run``), and a torn file after a crash is rebuilt.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def replace_at(dir_fd: int, name: str, data: bytes, *, mode: int) -> None:
    """Atomically replace the file *name* in the directory *dir_fd* with *data*, permissions *mode*; raises OSError.

    On failure the temporary file is removed and the old file, if any, is untouched.
    """
    temp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)  # exact, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):  # never created, or already renamed
            os.unlink(temp, dir_fd=dir_fd)
        raise


def replace_file(path: Path, data: bytes, *, mode: int) -> None:
    """Atomically replace *path* with *data*, permissions *mode* (its directory must exist); raises OSError."""
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_at(dir_fd, path.name, data, mode=mode)
    finally:
        os.close(dir_fd)
