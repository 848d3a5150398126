"""Rebuild the container's ld.so.cache with the *host's* ldconfig, sandboxed.

NVIDIA's CVE-2024-0136/0137 came from running a container-provided ldconfig,
CVE-2024-0135 from a host binary a container could rewrite through
``/proc/<pid>/exe``, and CVE-2025-23267 from ldconfig following links the image
planted. Here:

* the binary is the configured host ldconfig, copied into a sealed memfd
  (no write, grow, shrink or further seals) *before* the hook enters the
  container, and run with fexecve: nothing in the container can replace or
  modify it;
* it must be statically linked: a dynamic one would load its interpreter and
  libc from the container after chroot;
* it runs in a fresh mount namespace and the container's own network, IPC and UTS namespaces
  (fresh ones where the container shares the host's), with ``/proc``,
  ``/sys`` and ``/dev`` of the rootfs hidden under empty read-only tmpfs (an
  ``include /proc/1/root/...`` in the image's ld.so.conf would otherwise reach
  the host), chrooted into the rootfs, with no_new_privs, a bounding set of
  only CAP_DAC_OVERRIDE (as libnvidia-container keeps), a clean environment
  and resource limits;
* it runs inside the container's mount namespace: ldconfig in the host
  namespace only sees the empty mount targets (runtime-lab.md §7).
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import select
import signal
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn

from gpuhook.apply import ldscan
from gpuhook.apply.children import wait_child
from gpuhook.errors import ApplyError, SpecError
from gpuhook.sys import pathrs, process, syscalls

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket

    from gpuhook.apply.ahead import ChildAhead

_PT_INTERP: Final = 3
_AT_EMPTY_PATH: Final = 0x1000
_MAX_BINARY: Final = 64 << 20
_CAP_DAC_OVERRIDE: Final = 1
_SEALS: Final = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_HIDDEN: Final = ("proc", "sys", "dev")
#: FIFOs and the like set aside for one ldconfig run: more than any image needs (each is a mount)
_MAX_COVERED: Final = 256
#: ldconfig's deadline: it takes ~30 ms over a host's 1100 libraries, so 5 s leaves a 100-fold margin for
#: a large image on a loaded host, while a start stuck anyway (an image changed from outside while it
#: ran) holds its gpuhookd worker for 5 s, not half the start's timeout (15 s)
LDCONFIG_DEADLINE_S: Final = 5.0
_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
#: ldconfig's open files: glibc's parse_conf holds each file of an include chain open while it reads the
#: next (a recursion with no depth limit of its own), so this limit is how deep a chain is read, here as
#: for an ldconfig run by hand (the kernel's default soft limit); ``ldwrite`` reads as deep
OPEN_FILES: Final = 1024
#: what ldconfig holds open besides: its stdin, stdout and stderr (``_exec_sandboxed`` closes the rest)
STANDARD_FILES: Final = 3
#: the kernel's highest fd (fs.nr_open's default): every fd an unprivileged limit allows is below it
_NR_OPEN: Final = 1 << 20
#: libnvidia-container's limits for its ldconfig child (nvc_ldcache.c), with a larger file size (an image
#: with many libraries can have a cache over 1 MiB) and glibc's include depth (``OPEN_FILES``).
_LIMITS: Final = (
    (resource.RLIMIT_CPU, 10),
    (resource.RLIMIT_AS, 2 << 30),
    (resource.RLIMIT_NOFILE, OPEN_FILES),
    (resource.RLIMIT_FSIZE, 64 << 20),
)


#: Sealed copies made ahead of time (gpuhookd, before it forks workers), by the binary's
#: (st_dev, st_ino, st_size, st_mtime_ns): a replaced or rewritten ldconfig is copied afresh.
_SEALED: dict[tuple[int, int, int, int], int] = {}


def seal_ahead(path: Path) -> None:
    """Keep a sealed copy of *path* for the processes this one forks; raises ApplyError."""
    fd = _open(path)
    try:
        _SEALED[_identity(os.fstat(fd))] = _checked_copy(fd, str(path))
    finally:
        os.close(fd)


def open_ldconfig(path: Path) -> int:
    """A sealed memfd copy of the host ldconfig, refusing a dynamically linked one."""
    fd = _open(path)
    try:
        if (ahead := _SEALED.get(_identity(os.fstat(fd)))) is not None:
            return os.dup(ahead)  # checked when it was made, and nothing can change a sealed memfd
        return _checked_copy(fd, str(path))
    finally:
        os.close(fd)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise ApplyError("open ldconfig", str(path), errno_=err.errno) from err


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _checked_copy(fd: int, shown: str) -> int:
    """Refuse a dynamically linked binary, else copy it into a sealed memfd."""
    if _has_interpreter(fd, shown):
        raise ApplyError(
            "open ldconfig", shown,
            detail="is dynamically linked; it would load libraries from the container. "
            "Set `ldconfig:` to a static ldconfig (Debian and Ubuntu's /sbin/ldconfig is static)",
        )
    return _sealed_copy(fd, shown)


def _sealed_copy(fd: int, shown: str) -> int:
    """Copy *fd* into a memfd and seal it against every change."""
    size = os.fstat(fd).st_size
    if size > _MAX_BINARY:
        raise ApplyError("open ldconfig", shown, detail=f"is {size} bytes; larger than any ldconfig")
    memfd = os.memfd_create("gpuhook-ldconfig", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        offset = 0
        while offset < size:
            sent = os.sendfile(memfd, fd, offset, size - offset)
            if sent == 0:
                raise ApplyError("open ldconfig", shown, detail="changed size while being copied")
            offset += sent
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(memfd)
        raise
    return memfd


def _has_interpreter(fd: int, shown: str) -> bool:
    """True if the ELF file has a PT_INTERP program header (is dynamically linked)."""
    header = os.pread(fd, 64, 0)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
        raise ApplyError("open ldconfig", shown, detail="is not a 64-bit ELF executable")
    endian = "<" if header[5] == 1 else ">"
    phoff, = struct.unpack_from(endian + "Q", header, 32)
    phentsize, phnum = struct.unpack_from(endian + "HH", header, 54)
    table = os.pread(fd, phentsize * phnum, phoff)
    return any(
        struct.unpack_from(endian + "I", table, i * phentsize)[0] == _PT_INTERP for i in range(phnum)
    )


def run_ldconfig(ldconfig_fd: int, root_fd: int, dirs: Sequence[str], *, pidfd: int, fresh: int, timeout: float,
                 ahead: ChildAhead | None = None, abort_fd: int | None = None) -> None:
    """Run ldconfig chrooted at *root_fd*, in the namespaces of the container *pidfd* names (fresh
    ones for the CLONE_NEW* flags in *fresh*: those it shares with the host); raises ApplyError
    with its output on failure.

    *ahead*: a child forked in advance by ``fork_ldconfig_ahead`` (gpuhookd), which first joins
    the container's mount namespace; otherwise a child is forked now, in it already. *abort_fd*:
    the channel to the hook (or worker) we work for: its closing (that process was killed) kills
    ldconfig at once.
    """
    argv = ["ldconfig", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *dirs]
    if abort_fd is not None and _readable(abort_fd):
        # Gone already (killed during an earlier step): ldconfig would write a cache the undo must
        # then chase; it is not started at all.
        raise ApplyError("ldconfig", " ".join(dirs), detail="not started: the process that started this start has gone")
    if ahead is not None:
        payload = "\0".join((str(fresh), *argv)).encode()
        pid, read_fd, channel = ahead.start(payload, (pidfd, root_fd, ldconfig_fd))
        channel.close()  # ldconfig answers only through its output
    else:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked child
            _exec_sandboxed(ldconfig_fd, root_fd, pidfd, fresh, argv, write_fd)
        os.close(write_fd)
    result = wait_child(pid, read_fd, timeout, abort_fd=abort_fd)
    if result.abandoned:
        raise ApplyError("ldconfig", " ".join(dirs), detail="stopped: the process that started this start has gone")
    output, status = result.output.decode("utf-8", "replace"), result.status
    if result.timed_out:
        raise ApplyError("ldconfig", " ".join(dirs), detail=(
            f"timed out after {timeout:g} s (it takes milliseconds): something in the image's /etc/ld.so.conf, "
            f"its includes or its library directories blocked it (changed while it ran?); {output.strip()[-300:]}"
        ).rstrip("; "))
    if status != 0:
        why = f"killed by signal {-status}" if status is not None and status < 0 else f"exited with status {status}"
        raise ApplyError("ldconfig", " ".join(dirs), detail=f"{why}: {output.strip()[-500:]}")


def _readable(fd: int) -> bool:
    """Whether *fd* is readable now (poll: select() refuses an fd past 1023, which a large start can hold)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def update_ldcache(ldconfig: Path, rootfs: Path, dirs: Sequence[str], *, timeout: float) -> None:
    """Run the host's sealed *ldconfig* over *dirs* in *rootfs*, from inside the container's namespaces.

    For the CDI createContainer hook, which the runtime already runs in the container's mount
    namespace (where the host's namespaces cannot be told apart): ldconfig joins ours, a no-op,
    and always gets fresh network, IPC and UTS namespaces. Raises ApplyError or SpecError.
    """
    ldconfig_fd = open_ldconfig(ldconfig)
    try:
        try:
            root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise SpecError(f"cannot open the container rootfs {rootfs}: {err.strerror}") from err
        try:
            own = os.pidfd_open(os.getpid())
            try:
                fresh = syscalls.CLONE_NEWNET | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS
                run_ldconfig(ldconfig_fd, root_fd, dirs, pidfd=own, fresh=fresh,
                             timeout=min(timeout, LDCONFIG_DEADLINE_S))
            finally:
                os.close(own)
        finally:
            os.close(root_fd)
    finally:
        os.close(ldconfig_fd)


def fork_ldconfig_ahead(close: Sequence[int], priority: int) -> ChildAhead:
    """The ldconfig child, forked before it is needed (by gpuhookd's apply child while idle)."""
    from gpuhook.apply.ahead import ChildAhead

    return ChildAhead(_ldconfig_from_payload, priority=priority, close=close)


def _ldconfig_from_payload(payload: bytes, fds: list[int], out_fd: int, _: ChildAhead | None,
                           channel: socket.socket) -> int:
    """Join the container's mount namespace (fds: its pidfd, the rootfs, the sealed ldconfig), then
    run the sandboxed ldconfig exactly as a child forked inside it would."""
    pidfd, root_fd, ldconfig_fd = fds
    fresh, *argv = payload.decode().split("\0")
    channel.close()
    try:
        syscalls.setns(pidfd, syscalls.CLONE_NEWNS)
    except OSError as err:
        os.write(out_fd, f"cannot start ldconfig: {err}".encode())
        return 127
    _exec_sandboxed(ldconfig_fd, root_fd, pidfd, int(fresh), argv, out_fd)


def _exec_sandboxed(ldconfig_fd: int, root_fd: int, pidfd: int, fresh: int, argv: list[str], out_fd: int) -> NoReturn:
    """In the child: output to *out_fd*, the sandbox, then exec ldconfig (or report why not and exit 127)."""
    try:
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        _sandbox(root_fd, pidfd, fresh, conf=argv[2], dirs=argv[5:])
        os.execve(_only_standard_files(ldconfig_fd), argv, _ENV)
    except BaseException as err:  # noqa: BLE001 - report why the sandbox or exec failed, then die
        os.write(2, f"cannot start ldconfig: {err}".encode())
    finally:
        os._exit(127)


def _only_standard_files(ldconfig_fd: int) -> int:
    """Leave ldconfig its stdin (an empty pipe), stdout and stderr, and nothing this process inherited: its
    include depth is the open files it has left (``OPEN_FILES``), the same however the hook was started.
    Returns the sealed binary's fd for execve, past the standard ones (CLOEXEC: exec closes it)."""
    os.closerange(STANDARD_FILES, ldconfig_fd)  # first: the limit is set, and fds past it may be all there is
    os.closerange(max(ldconfig_fd + 1, STANDARD_FILES), _NR_OPEN)
    binary = ldconfig_fd
    if binary < STANDARD_FILES:  # stdin was closed, and the binary took its number
        binary = fcntl.fcntl(ldconfig_fd, fcntl.F_DUPFD_CLOEXEC, STANDARD_FILES)
    read_end, write_end = os.pipe()
    os.dup2(read_end, 0)
    os.set_inheritable(0, True)  # dup2 onto itself (fd 0 was free) keeps the pipe's CLOEXEC
    for fd in {read_end, write_end} - {0}:
        os.close(fd)
    return binary


def _sandbox(root_fd: int, pidfd: int, fresh: int, *, conf: str, dirs: Sequence[str]) -> None:
    """The container's namespaces and a private mount namespace, hidden /proc /sys /dev, nothing
    that can block ldconfig, chroot, limits, no privileges to gain (in the child)."""
    process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the step that waits for us
    # The container's network, IPC and UTS namespaces (CVE-2024-0137 ran ldconfig in the host's
    # network namespace): ldconfig reaches nothing the container cannot. Joining them is free, where
    # a new network namespace per start costs the kernel a teardown each time; only those the
    # container shares with the host (--net=host, ...) are created fresh.
    syscalls.setns(pidfd, syscalls.CLONE_NEWNET | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS)
    # unshare moves our cwd (not our fds) into the new namespace's copy of the tree, so stand in
    # the rootfs first and re-open it afterwards: mounts must target the new namespace.
    os.fchdir(root_fd)
    syscalls.unshare(syscalls.CLONE_NEWNS | fresh)
    syscalls.make_mounts_private()
    root_fd = _nodev_root(os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    hidden = (syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV
              | syscalls.MOUNT_ATTR_NOEXEC)
    for name in _HIDDEN:
        try:
            target = pathrs.openat2(root_fd, name, os.O_PATH | os.O_DIRECTORY, pathrs.RESOLVE_NO_SYMLINKS)
        except OSError:
            continue  # absent (or not a plain dir): nothing there to hide
        syscalls.move_mount(syscalls.fsmount_tmpfs({"mode": "0555", "size": "4k"}, hidden), target, what=name)
    os.chroot(".")
    os.chdir("/")
    _cover(ldscan.blocking_paths(conf, dirs))
    for limit, value in _LIMITS:
        resource.setrlimit(limit, (value, value))
    process.prctl(process.PR_SET_NO_NEW_PRIVS, 1)
    syscalls.drop_bounding_set(frozenset({_CAP_DAC_OVERRIDE}))


def _nodev_root(root_fd: int) -> int:
    """Make every mount at and under *root_fd* (in our private namespace) nodev, so that no device
    node in the image can be opened (a tty or a tape blocks or acts on open); the root to use."""
    try:
        syscalls.mount_setattr(root_fd, syscalls.MOUNT_ATTR_NODEV, recursive=True, what="the rootfs")
        return root_fd
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    # Not a mount of its own (runc makes it one, another runtime may not): bind it onto itself.
    flags = syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC | syscalls.AT_RECURSIVE | _AT_EMPTY_PATH
    tree = syscalls.open_tree(root_fd, "", flags)
    syscalls.mount_setattr(tree, syscalls.MOUNT_ATTR_NODEV, recursive=True, what="the rootfs")
    syscalls.move_mount(tree, root_fd, what="the rootfs")
    os.fchdir(tree)
    return tree


def _cover(paths: Sequence[str]) -> None:
    """Mount an empty read-only file over each of *paths* (FIFOs and the like ldconfig would open),
    in our namespace only: ldconfig reads nothing there, and the image is unchanged."""
    if not paths:
        return
    if len(paths) > _MAX_COVERED:
        raise ApplyError("ldconfig", paths[0], detail=(
            f"the image has {len(paths)} FIFOs or other special files where ldconfig reads its configuration "
            f"and libraries (at most {_MAX_COVERED} are set aside); remove them from the image"))
    empty = syscalls.fsmount_tmpfs({"mode": "0555", "size": "4k"}, syscalls.MOUNT_ATTR_NOSUID
                                   | syscalls.MOUNT_ATTR_NODEV | syscalls.MOUNT_ATTR_NOEXEC)
    os.close(os.open("empty", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444, dir_fd=empty))
    syscalls.mount_setattr(empty, syscalls.MOUNT_ATTR_RDONLY, what="an empty file")
    for path in paths:
        # O_PATH opens nothing: a FIFO is not waited on, a node not opened.
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            clone = syscalls.open_tree(empty, "empty", syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
            syscalls.move_mount(clone, target, what=path)
            os.close(clone)
        finally:
            os.close(target)
    os.close(empty)
