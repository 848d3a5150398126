"""Safe changes inside a container's root filesystem, which the image author controls.

Every path is resolved with the rootfs as the root (openat2 ``RESOLVE_IN_ROOT``):
``..`` and absolute symlinks stop at the rootfs, so an image cannot point a
mount target at a host file (CVE-2024-0132/0134 were string joins resolved on
the host). Runtime-owned trees (``/dev``, ``/proc``) additionally refuse every
symlink. Final components are created with ``O_EXCL|O_NOFOLLOW`` / ``mknodat``
and then checked, and mounts attach by fd and are verified after attaching.

Each change is recorded so that a failure can undo all of them: a refused
container must leave no file, node or mount behind.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Final

from gpuhook.errors import ApplyError
from gpuhook.sys import mountinfo, pathrs, syscalls

_IN_ROOT: Final = pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS
_RUNTIME_OWNED: Final = ("dev", "proc")
_MAX_STEPS: Final = 64
_NEW_FILE: Final = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC


def _resolve_flags(path: str) -> int:
    """IN_ROOT, plus NO_SYMLINKS under the runtime-owned /dev and /proc."""
    top = PurePosixPath(path).parts[1] if len(PurePosixPath(path).parts) > 1 else ""
    return _IN_ROOT | (pathrs.RESOLVE_NO_SYMLINKS if top in _RUNTIME_OWNED else 0)


def _exclusively(make: Callable[[], None]) -> bool:
    """Run an O_EXCL-style creation; False if the object already existed."""
    try:
        make()
    except FileExistsError:
        return False
    return True


class RootFs:
    """A container rootfs held by fd, with an undo log of every change made through it."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._shared: frozenset[int] | None = None
        # Directories already resolved, by container path: one plan puts many files into a few
        # directories. Safe to reuse because everything mounted through this object is mounted
        # over a regular file, which cannot change how a directory path resolves.
        self._dirs: dict[str, int] = {}

    # -- lookups ---------------------------------------------------------------------------------

    def open(self, path: str, flags: int = os.O_PATH) -> int:
        """Open the container *path* inside the root (symlinks followed, confined); raises OSError."""
        return pathrs.openat2(self.root_fd, path.lstrip("/") or ".", flags, _resolve_flags(path))

    def try_open(self, path: str, flags: int = os.O_PATH) -> int | None:
        """Like open(), but None when the path does not exist."""
        try:
            return self.open(path, flags)
        except FileNotFoundError:
            return None

    def directory(self, path: str) -> int:
        """An O_PATH fd of the directory *path*, creating missing components (mode 0755).

        A dangling symlink on the way is followed inside the root and the
        directories it names are created there (runc's MkdirAllInRoot), so an
        image's absolute symlink can never lead outside the rootfs.
        """
        if (known := self._dirs.get(path)) is not None:
            return known
        asked = path
        for _ in range(_MAX_STEPS):
            try:
                fd = self._dirs[asked] = self.open(path, os.O_PATH | os.O_DIRECTORY)
                return fd
            except FileNotFoundError:
                path = self._create_next(path)
            except OSError as err:
                raise ApplyError("open directory", path, errno_=err.errno) from err
        raise ApplyError("open directory", path, detail="too many missing components or symlinks")

    def _create_next(self, path: str) -> str:
        """Create the first missing component of *path*; returns the path to retry."""
        parts = PurePosixPath(path).parts[1:]
        depth = len(parts) - 1
        while depth > 0 and self.try_open("/" + "/".join(parts[:depth]), os.O_PATH | os.O_DIRECTORY) is None:
            depth -= 1
        parent = "/" + "/".join(parts[:depth])
        parent_fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        name = parts[depth]
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            # Present but unopenable: a dangling symlink. Continue from its target, inside the root.
            target = os.readlink(name, dir_fd=parent_fd)
            rest = parts[depth + 1 :]
            base = PurePosixPath(target) if target.startswith("/") else PurePosixPath(parent, target)
            return posixpath.normpath(str(PurePosixPath("/", base, *rest)))
        except OSError as err:
            raise ApplyError("mkdir", f"{parent.rstrip('/')}/{name}", errno_=err.errno) from err
        self._record(f"rmdir {parent.rstrip('/')}/{name}", lambda: os.rmdir(name, dir_fd=parent_fd))
        return path

    # -- changes ---------------------------------------------------------------------------------

    def mount_target(self, path: str) -> int:
        """An O_PATH fd of a regular file at *path* to mount over; created if absent."""
        parent = PurePosixPath(path).parent
        name = PurePosixPath(path).name
        dir_fd = self.directory(str(parent))
        try:
            if _exclusively(lambda: os.close(os.open(name, _NEW_FILE, 0o644, dir_fd=dir_fd))):
                self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
            fd = pathrs.openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, pathrs.RESOLVE_NO_SYMLINKS)
        except OSError as err:
            raise ApplyError("create mount target", path, errno_=err.errno) from err
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ApplyError("create mount target", path,
                             detail="exists in the image and is not a regular file; refusing to mount over it")
        return fd

    def mknod(self, path: str, major: int, minor: int, mode: int) -> None:
        """Create the character device *path*; an identical existing node is accepted."""
        parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        dir_fd = self.directory(parent)
        rdev = os.makedev(major, minor)
        try:
            os.mknod(name, stat.S_IFCHR | mode, rdev, dir_fd=dir_fd)
            self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
        except FileExistsError:
            pass
        except OSError as err:
            raise ApplyError("mknod", path, errno_=err.errno) from err
        # Check what is there now, through one fd: it must be exactly our device, never a symlink
        # (runc mknodDevice), and a mode fix goes through that same fd, so a swap after the check
        # cannot redirect the chmod to a host file.
        try:
            fd = pathrs.openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, pathrs.RESOLVE_NO_SYMLINKS)
        except OSError as err:
            raise ApplyError("mknod", path, errno_=err.errno) from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISCHR(st.st_mode) or st.st_rdev != rdev:
                raise ApplyError("mknod", path, detail=f"exists and is not the character device {major}:{minor}")
            if stat.S_IMODE(st.st_mode) != mode:
                os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create (or replace) the regular file *path* with *data*; never writes through a symlink."""
        parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        dir_fd = self.directory(parent)
        try:
            old = pathrs.openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, pathrs.RESOLVE_NO_SYMLINKS)
        except FileNotFoundError:
            pass
        else:
            kind = os.fstat(old).st_mode
            os.close(old)
            if stat.S_ISDIR(kind):
                raise ApplyError("write", path, detail="exists in the image and is a directory")
            os.unlink(name, dir_fd=dir_fd)  # a file or a symlink: the link itself goes, never its target
        fd = os.open(name, _NEW_FILE, mode, dir_fd=dir_fd)
        self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    def symlink(self, path: str, target: str) -> bool:
        """Create *path* → *target* unless something already exists there; True if created."""
        parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        dir_fd = self.directory(parent)
        try:
            os.symlink(target, name, dir_fd=dir_fd)
        except FileExistsError:
            return False
        except OSError as err:
            raise ApplyError("symlink", path, errno_=err.errno) from err
        self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
        return True

    def attach(self, tree_fd: int, target_fd: int, path: str) -> None:
        """move_mount the detached *tree_fd* onto *target_fd*, then verify the result."""
        want = os.fstat(tree_fd)
        parent = mountinfo.mount_id(target_fd)
        if self._shared is None:
            self._shared = mountinfo.shared_mount_ids(mountinfo.read_mountinfo())
        if parent in self._shared:
            # A mount under a shared mount propagates to its peers, which can be in the host's
            # namespace (rootfsPropagation "shared"): the host would see the driver files appear.
            raise ApplyError("mount", path, detail="is on a shared mount (rootfsPropagation shared?); "
                             "mounting there would propagate to the host. Use rslave or private propagation")
        try:
            syscalls.move_mount(tree_fd, target_fd, what=path)
        except OSError as err:
            raise ApplyError("mount", path, errno_=err.errno) from err
        # After move_mount, *tree_fd* is the attached mount itself: undo through it, never by path
        # (which a racing rename could point elsewhere).
        self._record(f"umount {path}", lambda: syscalls.umount_detach(f"/proc/self/fd/{tree_fd}"))
        # Re-resolve from the root: *path* must now show the mounted object, on exactly our mount.
        try:
            check = self.open(path, os.O_PATH | os.O_NOFOLLOW)
        except OSError as err:
            raise ApplyError("mount", path, errno_=err.errno, detail="gone after mounting") from err
        try:
            got, got_mount = os.fstat(check), mountinfo.mount_id(check)
        finally:
            os.close(check)
        if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino) or got_mount != mountinfo.mount_id(tree_fd):
            raise ApplyError("mount", path, detail="after mounting, the path does not show the mounted file")

    # -- undo ------------------------------------------------------------------------------------

    def _record(self, what: str, undo: Callable[[], None]) -> None:
        """Remember how to undo one change."""
        self._undo.append((what, undo))

    def rollback(self) -> list[str]:
        """Undo every recorded change, newest first; returns what could not be undone."""
        failed = []
        for what, undo in reversed(self._undo):
            try:
                undo()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    failed.append(f"{what}: {err.strerror}")
        self._undo.clear()
        return failed
