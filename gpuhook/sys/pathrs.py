"""Read-only path resolution inside a root: openat2 ``RESOLVE_IN_ROOT`` and its userspace walker.

The read-only half of ``gpuhook.sys``: nothing here changes the filesystem, so discovery
may use it. ``..`` and absolute symlinks stop at the root fd, which is how a container
image (or a driver root under ``/run/nvidia/driver``) is looked into without string joins.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from typing import Final

from gpuhook.sys._libc import check, encode_path, syscall

SYS_OPENAT2: Final = 437  # one of the unified >= 424 numbers

# openat2(2) resolve flags.
RESOLVE_NO_XDEV: Final = 0x01
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_BENEATH: Final = 0x08
RESOLVE_IN_ROOT: Final = 0x10

MAXSYMLINKS: Final = 40  # the kernel's limit on symlinks followed in one lookup


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_HOW_SIZE: Final = ctypes.sizeof(_OpenHow)
#: The open_how structs in use, by (flags, resolve): a start opens a few hundred paths with a handful of
#: combinations, and the kernel only reads the struct.
_HOWS: dict[tuple[int, int], ctypes._CArgObject] = {}


def _how(flags: int, resolve: int) -> ctypes._CArgObject:
    """A reference to the open_how for *flags* and *resolve*, made once."""
    if (known := _HOWS.get((flags, resolve))) is None:
        known = _HOWS[flags, resolve] = ctypes.byref(_OpenHow(flags=flags, mode=0, resolve=resolve))
    return known


_openat2_missing: list[bool] = []
#: Lookups retried on EAGAIN: a busy host's mounts and renames, not an attacker, cause it, and
#: each retry is one syscall.
EAGAIN_RETRIES: Final = 64


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2): open *path* relative to *dir_fd* under the *resolve* rules.

    Kernels before 5.6 (or a seccomp profile that hides the syscall) answer
    ENOSYS; then the O_PATH walker below gives the same semantics for the
    flags gpuhook uses. EAGAIN is the kernel's "a mount or rename happened
    anywhere on the system while a '..' was resolved in the root" (openat2(2)):
    the lookup is simply tried again, up to ``EAGAIN_RETRIES`` times.
    """
    if not _openat2_missing:
        how = _how(flags | os.O_CLOEXEC, resolve)
        raw = encode_path(path)
        for _ in range(EAGAIN_RETRIES):
            fd = syscall(SYS_OPENAT2, dir_fd, raw, how, _HOW_SIZE)
            if fd >= 0 or ctypes.get_errno() != errno.EAGAIN:
                break
        if fd >= 0 or ctypes.get_errno() != errno.ENOSYS:
            return check(fd, path)
        _openat2_missing.append(True)
    return walk_in_root(dir_fd, path, flags, resolve)


def walk_in_root(root_fd: int, path: str, flags: int, resolve: int) -> int:
    """Userspace ``RESOLVE_IN_ROOT``: one component at a time with O_PATH|O_NOFOLLOW.

    Symlinks are read and re-walked from *root_fd* (absolute) or the current
    directory (relative), ``..`` never climbs above *root_fd*, and the final
    object is reopened through ``/proc/self/fd`` so it is exactly the one that
    was checked. Supports RESOLVE_IN_ROOT and RESOLVE_NO_SYMLINKS (magic links
    read as ordinary paths, which stay inside the root).
    """
    if not encode_path(path):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)  # as the kernel: "" needs AT_EMPTY_PATH
    parts = [p for p in path.split("/") if p not in ("", ".")]
    stack = [os.dup(root_fd)]
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode) and (parts or not flags & os.O_NOFOLLOW):
                target = os.readlink(name, dir_fd=stack[-1])
                os.close(fd)
                links += 1
                if resolve & RESOLVE_NO_SYMLINKS or links > MAXSYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                if target.startswith("/"):
                    for old in stack[1:]:
                        os.close(old)
                    del stack[1:]
                parts[:0] = [p for p in target.split("/") if p not in ("", ".")]
                continue
            if parts and not stat.S_ISDIR(mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            stack.append(fd)
        return _reopen(stack.pop(), flags, path)
    finally:
        for fd in stack:
            os.close(fd)


def _reopen(fd: int, flags: int, path: str) -> int:
    """Turn the walker's O_PATH fd into one opened with *flags*."""
    if flags & os.O_DIRECTORY and not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    if flags & os.O_PATH:
        return fd
    try:
        return os.open(f"/proc/self/fd/{fd}", (flags & ~os.O_NOFOLLOW) | os.O_CLOEXEC)
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """The path the kernel reports for *fd* (for verification and messages)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def same_namespace(fd: int, name: str) -> bool:
    """Whether the namespace file *fd* is our own namespace of type *name* (``pid``, ``user``, ...)."""
    return _identity(os.fstat(fd)) == _identity(os.stat(f"/proc/self/ns/{name}"))


def _identity(st: os.stat_result) -> tuple[int, int]:
    """(device, inode): what tells two namespace files apart."""
    return st.st_dev, st.st_ino
