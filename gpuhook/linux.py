"""The Linux syscalls that Python 3.11's standard library lacks, through ctypes.

This is the only module that calls libc through ctypes. Rules it enforces
(security.md §3.2 "Known ctypes hazards"):

* A raw C call stops at the first NUL byte, so a path with an embedded NUL
  would silently be truncated ("etc/os-release\\0../../x" opens
  etc/os-release). Every path is refused here if it contains one.
* errno is read with ``use_errno=True`` + ``ctypes.get_errno()`` and raised as
  ``OSError`` carrying the path.
* ``setns`` has different numbers per architecture (308 on x86_64, 268 on
  aarch64), so it goes through libc's wrapper; the mount-API syscalls are
  >= 424 and share one number on every architecture.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# Generic syscall numbers (identical on x86_64 and aarch64 from 424 on).
SYS_OPEN_TREE: Final = 428
SYS_MOVE_MOUNT: Final = 429
SYS_FSOPEN: Final = 430
SYS_FSCONFIG: Final = 431
SYS_FSMOUNT: Final = 432
SYS_CLOSE_RANGE: Final = 436
SYS_OPENAT2: Final = 437
SYS_MOUNT_SETATTR: Final = 442

# openat2(2) resolve flags.
RESOLVE_NO_XDEV: Final = 0x01
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_BENEATH: Final = 0x08
RESOLVE_IN_ROOT: Final = 0x10

# open_tree(2) / move_mount(2) / mount_setattr(2) / fsmount(2).
OPEN_TREE_CLONE: Final = 1
OPEN_TREE_CLOEXEC: Final = os.O_CLOEXEC
AT_EMPTY_PATH: Final = 0x1000
AT_RECURSIVE: Final = 0x8000
AT_SYMLINK_NOFOLLOW: Final = 0x100
MOVE_MOUNT_F_EMPTY_PATH: Final = 0x04
MOVE_MOUNT_T_EMPTY_PATH: Final = 0x40
MOUNT_ATTR_RDONLY: Final = 0x01
MOUNT_ATTR_NOSUID: Final = 0x02
MOUNT_ATTR_NODEV: Final = 0x04
MOUNT_ATTR_NOEXEC: Final = 0x08
FSOPEN_CLOEXEC: Final = 1
FSMOUNT_CLOEXEC: Final = 1
FSCONFIG_SET_STRING: Final = 1
FSCONFIG_CMD_CREATE: Final = 6

CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWNET: Final = 0x40000000
MS_REC: Final = 0x4000
MS_PRIVATE: Final = 1 << 18
PR_SET_PDEATHSIG: Final = 1
PR_SET_DUMPABLE: Final = 4
PR_CAPBSET_DROP: Final = 24
PR_SET_NO_NEW_PRIVS: Final = 38
CAP_LAST_CAP: Final = 63
MNT_DETACH: Final = 2
CLOSE_RANGE_CLOEXEC: Final = 1 << 2


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _path(path: str) -> bytes:
    """Encode a path for C, refusing the NUL byte that C would truncate at."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError(f"path contains a NUL byte: {path!r}")
    return raw


def _check(result: int, what: str) -> int:
    """Raise OSError(errno) for a failed call, else return its result."""
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


_openat2_missing: list[bool] = []


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2): open *path* relative to *dir_fd* under the *resolve* rules.

    Kernels before 5.6 (or a seccomp profile that hides the syscall) answer
    ENOSYS; then the O_PATH walker below gives the same semantics for the
    flags gpuhook uses.
    """
    if not _openat2_missing:
        how = _OpenHow(flags=flags | os.O_CLOEXEC, mode=0, resolve=resolve)
        fd = _syscall(SYS_OPENAT2, dir_fd, _path(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0 or ctypes.get_errno() != errno.ENOSYS:
            return _check(fd, path)
        _openat2_missing.append(True)
    return walk_in_root(dir_fd, path, flags, resolve)


MAXSYMLINKS: Final = 40  # the kernel's limit on symlinks followed in one lookup


def walk_in_root(root_fd: int, path: str, flags: int, resolve: int) -> int:
    """Userspace ``RESOLVE_IN_ROOT``: one component at a time with O_PATH|O_NOFOLLOW.

    Symlinks are read and re-walked from *root_fd* (absolute) or the current
    directory (relative), ``..`` never climbs above *root_fd*, and the final
    object is reopened through ``/proc/self/fd`` so it is exactly the one that
    was checked. Supports RESOLVE_IN_ROOT and RESOLVE_NO_SYMLINKS (magic links
    read as ordinary paths, which stay inside the root).
    """
    if not _path(path):
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


def open_tree(dir_fd: int, path: str, flags: int) -> int:
    """open_tree(2): a detached mount (with OPEN_TREE_CLONE) of *path*."""
    return _check(_syscall(SYS_OPEN_TREE, dir_fd, _path(path), flags), path)


def move_mount(from_fd: int, to_fd: int, *, what: str) -> None:
    """move_mount(2) the detached tree *from_fd* onto the object *to_fd* refers to."""
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    _check(_syscall(SYS_MOVE_MOUNT, from_fd, b"", to_fd, b"", flags), what)


def mount_setattr(fd: int, attr_set: int, *, recursive: bool = False, what: str) -> None:
    """mount_setattr(2) on the mount *fd* refers to (detached or attached)."""
    attr = _MountAttr(attr_set=attr_set)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_syscall(SYS_MOUNT_SETATTR, fd, b"", flags, ctypes.byref(attr), ctypes.sizeof(attr)), what)


def fsmount_tmpfs(options: dict[str, str], attr: int) -> int:
    """A new, detached tmpfs (fsopen/fsconfig/fsmount) with *options* and mount *attr*."""
    fs_fd = _check(_syscall(SYS_FSOPEN, b"tmpfs", FSOPEN_CLOEXEC), "fsopen tmpfs")
    try:
        for key, value in options.items():
            _check(_syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_SET_STRING, _path(key), _path(value), 0), key)
        _check(_syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig create")
        return _check(_syscall(SYS_FSMOUNT, fs_fd, FSMOUNT_CLOEXEC, attr), "fsmount tmpfs")
    finally:
        os.close(fs_fd)


def setns(fd: int, nstype: int) -> None:
    """setns(2) through libc (its number differs per architecture)."""
    _check(_libc.setns(fd, nstype), f"setns fd {fd}")


def enter_mount_view(mnt_fd: int, root_fd: int) -> None:
    """Join the mount namespace *mnt_fd* (unless already in it), then make *root_fd* the root and cwd.

    gpuhookd's workers take the hook's view of the host this way: every later path resolves
    as it would in the hook process.
    """
    if not same_namespace(mnt_fd, "mnt"):
        setns(mnt_fd, CLONE_NEWNS)  # the kernel checks that the fd is a mount namespace
    os.fchdir(root_fd)
    os.chroot(".")
    os.chdir("/")


def same_namespace(fd: int, name: str) -> bool:
    """Whether the namespace file *fd* is our own namespace of type *name* (``pid``, ``user``, ...)."""
    return _identity(os.fstat(fd)) == _identity(os.stat(f"/proc/self/ns/{name}"))


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def unshare(flags: int) -> None:
    """unshare(2) (``os.unshare`` arrives in Python 3.12)."""
    _check(_libc.unshare(flags), "unshare")


def make_mounts_private() -> None:
    """mount --make-rprivate / in the current mount namespace."""
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / rprivate")


def prctl(option: int, arg: int) -> int:
    """prctl(2) with one argument."""
    return _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def drop_bounding_set(keep: frozenset[int]) -> None:
    """Drop every capability except *keep* from the bounding set, so that even root's next
    execve cannot regain them (capabilities(7): P'(permitted) is limited by the bounding set)."""
    for cap in range(CAP_LAST_CAP + 1):
        if cap in keep:
            continue
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) < 0 and ctypes.get_errno() != 22:
            _check(-1, f"drop capability {cap}")  # EINVAL (22) = no such capability on this kernel


def umount_detach(path: str) -> None:
    """umount2(path, MNT_DETACH)."""
    _check(_libc.umount2(_path(path), MNT_DETACH), path)


def close_range_cloexec(first: int) -> None:
    """Mark every fd >= *first* close-on-exec (close_range(2), Linux 5.11)."""
    _check(_syscall(SYS_CLOSE_RANGE, first, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC), "close_range")


#: statx(2) is not one of the unified numbers either; STATX_MNT_ID arrived in Linux 5.8.
SYS_STATX: Final = {"x86_64": 332, "aarch64": 291}.get(os.uname().machine, 332)
STATX_MNT_ID: Final = 0x1000
_STATX_SIZE: Final = 256  # struct statx
_STATX_MNT_ID_OFFSET: Final = 144  # __u64 stx_mnt_id, after stx_dev_minor


def mount_id(fd: int) -> int:
    """The id of the mount *fd* lives on: statx's stx_mnt_id (one syscall), else fdinfo's mnt_id."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _syscall(SYS_STATX, fd, b"", AT_EMPTY_PATH, STATX_MNT_ID, buf) == 0:
        mask = int.from_bytes(buf.raw[:4], "little")
        if mask & STATX_MNT_ID:
            return int.from_bytes(buf.raw[_STATX_MNT_ID_OFFSET : _STATX_MNT_ID_OFFSET + 8], "little")
    return fdinfo_mount_id(fd)


def fdinfo_mount_id(fd: int) -> int:
    """``mnt_id`` in /proc/self/fdinfo (Linux 3.15), for kernels before statx's STATX_MNT_ID."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(0, "no mnt_id in fdinfo", str(fd))


def shared_mount_ids() -> frozenset[int]:
    """Ids of the mounts in our namespace that are in a shared peer group (mountinfo "shared:N")."""
    shared = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split(" - ", 1)[0].split()
            if any(tag.startswith("shared:") for tag in fields[6:]):
                shared.add(int(fields[0]))
    return frozenset(shared)


def fd_path(fd: int) -> str:
    """The path the kernel reports for *fd* (for verification and messages)."""
    return os.readlink(f"/proc/self/fd/{fd}")


# --- bpf(2), for cgroup v2 device programs ---------------------------------------------------

#: bpf(2) is not one of the unified >= 424 numbers.
SYS_BPF: Final = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine, 321)
BPF_PROG_LOAD: Final = 5
BPF_PROG_ATTACH: Final = 8
BPF_PROG_GET_FD_BY_ID: Final = 13
BPF_OBJ_GET_INFO_BY_FD: Final = 15
BPF_PROG_QUERY: Final = 16
BPF_PROG_TYPE_CGROUP_DEVICE: Final = 15
BPF_CGROUP_DEVICE: Final = 6
BPF_F_ALLOW_MULTI: Final = 2
BPF_F_REPLACE: Final = 4
_ATTR_SIZE: Final = 144
_INFO_SIZE: Final = 232  # struct bpf_prog_info up to the fields we read, zero-padded


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
    """One bpf(2) call with a filled ``union bpf_attr``."""
    return _check(_syscall(SYS_BPF, cmd, attr, _ATTR_SIZE), what)


def _attr(*fields: tuple[int, str, int]) -> ctypes.Array[ctypes.c_char]:
    """A zeroed bpf_attr with (offset, struct format, value) fields set."""
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    for offset, fmt, value in fields:
        struct.pack_into(fmt, attr, offset, value)
    return attr


def bpf_query_device_programs(cgroup_fd: int) -> list[int]:
    """Ids of the BPF_CGROUP_DEVICE programs attached to a cgroup directory."""
    ids = (ctypes.c_uint32 * 64)()
    attr = _attr((0, "<I", cgroup_fd), (4, "<I", BPF_CGROUP_DEVICE), (16, "<Q", ctypes.addressof(ids)), (24, "<I", 64))
    _bpf(BPF_PROG_QUERY, attr, "BPF_PROG_QUERY")
    count = struct.unpack_from("<I", attr, 24)[0]
    return list(ids[:count])


def bpf_program_fd(prog_id: int) -> int:
    """An fd for the program with id *prog_id*."""
    return _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "<I", prog_id)), f"BPF_PROG_GET_FD_BY_ID {prog_id}")


def bpf_program_instructions(prog_fd: int) -> bytes:
    """The program's (verifier-translated) instructions, as the kernel reports them."""
    info = ctypes.create_string_buffer(_INFO_SIZE)
    attr = _attr((0, "<I", prog_fd), (4, "<I", _INFO_SIZE), (8, "<Q", ctypes.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "BPF_OBJ_GET_INFO_BY_FD")
    length = struct.unpack_from("<I", info, 20)[0]  # xlated_prog_len
    insns = ctypes.create_string_buffer(length)
    info = ctypes.create_string_buffer(_INFO_SIZE)
    struct.pack_into("<I", info, 20, length)
    struct.pack_into("<Q", info, 32, ctypes.addressof(insns))  # xlated_prog_insns
    attr = _attr((0, "<I", prog_fd), (4, "<I", _INFO_SIZE), (8, "<Q", ctypes.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "BPF_OBJ_GET_INFO_BY_FD")
    return insns.raw[:length]


def bpf_load_device_program(insns: bytes, name: bytes = b"gpuhook_dev") -> int:
    """Load a BPF_PROG_TYPE_CGROUP_DEVICE program; the verifier's log is in the error."""
    code = ctypes.create_string_buffer(insns, len(insns))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = _attr(
        (0, "<I", BPF_PROG_TYPE_CGROUP_DEVICE), (4, "<I", len(insns) // 8), (8, "<Q", ctypes.addressof(code)),
        (16, "<Q", ctypes.addressof(license_)), (24, "<I", 1), (28, "<I", len(log)), (32, "<Q", ctypes.addressof(log)),
        (68, "<I", BPF_CGROUP_DEVICE),
    )
    struct.pack_into("16s", attr, 48, name[:15])
    try:
        return _bpf(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")
    except OSError as err:
        tail = log.value.decode("ascii", "replace").strip().splitlines()[-3:]
        raise OSError(err.errno, f"{err.strerror}: {' / '.join(tail)}", "BPF_PROG_LOAD") from err


def bpf_replace_device_program(cgroup_fd: int, new_fd: int, old_fd: int) -> None:
    """Atomically swap *old_fd* for *new_fd* on the cgroup (BPF_F_ALLOW_MULTI | BPF_F_REPLACE)."""
    attr = _attr((0, "<I", cgroup_fd), (4, "<I", new_fd), (8, "<I", BPF_CGROUP_DEVICE),
                 (12, "<I", BPF_F_ALLOW_MULTI | BPF_F_REPLACE), (16, "<I", old_fd))
    _bpf(BPF_PROG_ATTACH, attr, "BPF_PROG_ATTACH")
