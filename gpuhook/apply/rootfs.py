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

import contextlib
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
#: an empty file to mount over, created read-only: nothing is ever written through it
_NEW_TARGET: Final = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDONLY | os.O_CLOEXEC


def _names(path: str) -> list[str]:
    """The names in a container path (slashes collapsed, '.' dropped, as PurePosixPath's parts after the
    root). String work: one start splits a few hundred paths."""
    return [name for name in path.split("/") if name and name != "."]


def _split(path: str) -> tuple[str, str]:
    """A container path's parent directory and last name."""
    names = _names(path)
    return "/" + "/".join(names[:-1]), names[-1] if names else ""


def _resolve_flags(path: str) -> int:
    """IN_ROOT, plus NO_SYMLINKS under the runtime-owned /dev and /proc."""
    names = _names(path)
    return _IN_ROOT | (pathrs.RESOLVE_NO_SYMLINKS if names and names[0] in _RUNTIME_OWNED else 0)


class RootFs:
    """A container rootfs held by fd, with an undo log of every change made through it."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._undo: list[tuple[str, Callable[[], None]]] = []
        #: what keeping the changes takes: unlinking the image's files that were set aside
        self._on_commit: list[Callable[[], None]] = []
        self._shared: frozenset[int] | None = None
        self._mounts: tuple[mountinfo.MountInfo, ...] | None = None
        # Directories already resolved, by container path: one plan puts many files into a few
        # directories. Safe to reuse because everything mounted through this object is mounted
        # over a regular file, which cannot change how a directory path resolves.
        self._dirs: dict[str, int] = {}
        #: the directories whose links ``make_link``/``remove_link`` changed, by (st_dev, st_ino, mount id)
        self._link_dirs: dict[tuple[int, int, int], int] = {}

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
        parts = _names(path)
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
        parent, name = _split(path)
        dir_fd = self.directory(parent)
        try:
            # The usual case, a file we create: its fd is the target (regular by construction), no lookup again.
            created = os.open(name, _NEW_TARGET, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as err:
            raise ApplyError("create mount target", path, errno_=err.errno) from err
        else:
            self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
            return created
        try:
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
        parent, name = _split(path)
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
        """Create (or replace) the regular file *path* with *data*; never writes through a symlink.
        A file already holding exactly *data* is left as it is; another one is set aside (an undo
        puts it back)."""
        parent, name = _split(path)
        dir_fd = self.directory(parent)
        try:
            old = pathrs.openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, pathrs.RESOLVE_NO_SYMLINKS)
        except FileNotFoundError:
            pass
        else:
            try:
                kind = os.fstat(old).st_mode
                if stat.S_ISDIR(kind):
                    raise ApplyError("write", path, detail="exists in the image and is a directory")
                if _small_contents(old, len(data)) == data:
                    return
            finally:
                os.close(old)
            self._set_aside(dir_fd, name, path)  # a file or a symlink: the link itself, never its target
        fd = os.open(name, _NEW_FILE, mode, dir_fd=dir_fd)
        self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    def remove_if(self, path: str, limit: int, wanted: Callable[[bytes], bool]) -> bool:
        """Remove the regular file *path* (at most *limit* bytes) if ``wanted(its contents)``; an undo
        puts it back. Nothing but a regular file is opened, and no final symlink followed. True if removed."""
        parent, name = _split(path)
        dir_fd = self._existing_dir(parent)
        if dir_fd is None:
            return False
        try:
            try:
                fd = pathrs.openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, pathrs.RESOLVE_NO_SYMLINKS)
            except (FileNotFoundError, NotADirectoryError):
                return False
            try:
                contents = _small_contents(fd, limit)
            finally:
                os.close(fd)
            if contents is None or not wanted(contents):
                return False
            self._set_aside(os.dup(dir_fd), name, path)
        finally:
            os.close(dir_fd)
        return True

    def save_aside(self, path: str) -> None:
        """Keep the image's *path* (a file or a symlink, not followed) as it is now, for an undo to put
        back whatever replaces it; if absent, an undo removes what appears there."""
        parent, name = _split(path)
        dir_fd = self._existing_dir(parent)
        if dir_fd is None:
            return
        hidden = _hidden_name(name)
        try:
            os.link(name, hidden, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
            return
        except OSError as err:
            os.close(dir_fd)
            raise ApplyError("save", path, errno_=err.errno, detail="before ldconfig replaces it") from err
        self._record(f"restore {path}", lambda: _put_back(dir_fd, hidden, name))
        self._on_commit.append(lambda: os.unlink(hidden, dir_fd=dir_fd))

    def watch_links(self, path: str, prefixes: tuple[str, ...]) -> None:
        """Remember the symlinks named ``<prefix>*`` in the directory *path*, for an undo to take back
        those that appear or change afterwards (ldconfig makes the SONAME links of the libraries
        mounted there). Names only, one directory read: a start pays no more."""
        try:
            dir_fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        with os.scandir(dir_fd) as entries:
            names = {e.name for e in entries}
        before = {n: os.readlink(n, dir_fd=dir_fd) for n in names if n.startswith(prefixes) and _is_link(dir_fd, n)}

        def undo() -> None:
            for name in os.listdir(dir_fd):
                if not name.startswith(prefixes) or not _is_link(dir_fd, name):
                    continue
                if name not in names:
                    os.unlink(name, dir_fd=dir_fd)
                elif name in before and os.readlink(name, dir_fd=dir_fd) != before[name]:
                    os.unlink(name, dir_fd=dir_fd)
                    os.symlink(before[name], name, dir_fd=dir_fd)

        self._record(f"take back the links ldconfig made in {path}", undo)

    def _existing_dir(self, path: str) -> int | None:
        """An O_PATH fd of the directory *path*, or None when there is none to open (absent, a
        symlink loop, not a directory): then nothing of ours can be in it either."""
        try:
            return self.open(path, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            return None

    def _set_aside(self, dir_fd: int, name: str, path: str) -> None:
        """Rename *name* to a hidden name in *dir_fd*: gone until an undo renames it back; a commit unlinks it."""
        hidden = _hidden_name(name)
        try:
            os.rename(name, hidden, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as err:
            raise ApplyError("remove", path, errno_=err.errno) from err
        self._record(f"restore {path}", lambda: _put_back(dir_fd, hidden, name))
        self._on_commit.append(lambda: os.unlink(hidden, dir_fd=dir_fd))

    def symlink(self, path: str, target: str) -> bool:
        """Create *path* → *target* unless something already exists there; True if created."""
        parent, name = _split(path)
        dir_fd = self.directory(parent)
        try:
            os.symlink(target, name, dir_fd=dir_fd)
        except FileExistsError:
            return False
        except OSError as err:
            raise ApplyError("symlink", path, errno_=err.errno) from err
        self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=dir_fd))
        return True

    def remove_link(self, dir_fd: int, name: str, path: str) -> None:
        """Remove the symlink *name* in *dir_fd* (nothing else); an undo makes it again. Raises OSError."""
        target = os.readlink(name, dir_fd=dir_fd)
        kept = self._link_dir(dir_fd)
        os.unlink(name, dir_fd=dir_fd)
        self._record(f"restore the link {path}", lambda: os.symlink(target, name, dir_fd=kept))

    def make_link(self, dir_fd: int, name: str, target: str, path: str) -> None:
        """Create the symlink *name* → *target* in *dir_fd*; an undo removes it. Raises OSError."""
        kept = self._link_dir(dir_fd)
        os.symlink(target, name, dir_fd=dir_fd)
        self._record(f"remove {path}", lambda: os.unlink(name, dir_fd=kept))

    def _link_dir(self, dir_fd: int) -> int:
        """The directory *dir_fd* held for the undo of its links: one fd per directory (and mount), however many
        links change there (a large image changes hundreds), closed once the changes are kept or undone."""
        st = os.fstat(dir_fd)
        key = (st.st_dev, st.st_ino, mountinfo.mount_id(dir_fd))
        if (kept := self._link_dirs.get(key)) is None:
            kept = self._link_dirs[key] = os.dup(dir_fd)
        return kept

    def mounts(self) -> tuple[mountinfo.MountInfo, ...]:
        """This namespace's mounts, read once."""
        if self._mounts is None:
            self._mounts = mountinfo.read_mountinfo()
        return self._mounts

    def attach(self, tree_fd: int, target_fd: int, path: str) -> None:
        """move_mount the detached *tree_fd* onto *target_fd*, then verify the result."""
        want = os.fstat(tree_fd)
        parent = mountinfo.mount_id(target_fd)
        if self._shared is None:
            self._shared = mountinfo.shared_mount_ids(self.mounts())
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

    def commit(self) -> list[str]:
        """Keep every change: drop the undo log and the files set aside; returns what could not be dropped."""
        failed = []
        for drop in self._on_commit:
            try:
                drop()
            except OSError as err:
                failed.append(err.strerror or str(err))
        self._on_commit.clear()
        self._undo.clear()
        self._close_link_dirs()
        return failed


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
        self._on_commit.clear()
        self._close_link_dirs()
        return failed

    def _close_link_dirs(self) -> None:
        for fd in self._link_dirs.values():
            os.close(fd)
        self._link_dirs.clear()


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


def _hidden_name(name: str) -> str:
    """A name beside *name* that nothing in the image can have guessed."""
    return f".{name}.gpuhook-{os.urandom(6).hex()}"


def _put_back(dir_fd: int, hidden: str, name: str) -> None:
    """Rename *hidden* back to *name*, replacing what is there now (a rename between two links of one
    file does nothing, so the hidden one is then unlinked)."""
    os.rename(hidden, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(hidden, dir_fd=dir_fd)


def _small_contents(fd: int, limit: int) -> bytes | None:
    """The contents of the regular file *fd* (O_PATH) if it has at most *limit* bytes, else None.
    Only a regular file is ever opened for reading: a FIFO or a device from the image could block."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    readable = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(readable).st_mode):
            return None
        return os.read(readable, limit + 1)
    finally:
        os.close(readable)
