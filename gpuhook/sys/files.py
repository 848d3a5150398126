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
import stat
from pathlib import Path


def is_trusted(st: os.stat_result, *, directory: bool) -> bool:
    """Owned by root or by us, the expected type, and writable by nobody else: a file whose contents
    decide what runs as root (a cache of host paths, an answer about the host's ldconfig)."""
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind_ok and st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def open_trusted_dir(directory: Path, what: str) -> int:
    """An O_PATH fd of *directory*; raises PermissionError unless only root (or we) can write it."""
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    if not is_trusted(os.fstat(fd), directory=True):
        os.close(fd)
        raise PermissionError(f"{directory} is writable by others than root; not used for {what}")
    return fd


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
