"""The mutating half of ``gpuhook.sys``: the mount API, namespaces, the bounding set and bpf(2).

Everything here changes mounts, namespaces, capabilities or cgroup programs, so only the
executors (``gpuhook.apply``) use it; readers use ``pathrs`` and ``mountinfo``.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Final

from gpuhook.sys._libc import AT_EMPTY_PATH, check, encode_path, libc, syscall
from gpuhook.sys.pathrs import same_namespace
from gpuhook.sys.process import PR_CAPBSET_DROP

# Generic syscall numbers (identical on x86_64 and aarch64 from 424 on).
SYS_OPEN_TREE: Final = 428
SYS_MOVE_MOUNT: Final = 429
SYS_FSOPEN: Final = 430
SYS_FSCONFIG: Final = 431
SYS_FSMOUNT: Final = 432
SYS_MOUNT_SETATTR: Final = 442

# open_tree(2) / move_mount(2) / mount_setattr(2) / fsmount(2).
OPEN_TREE_CLONE: Final = 1
OPEN_TREE_CLOEXEC: Final = os.O_CLOEXEC
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
MNT_DETACH: Final = 2
CAP_LAST_CAP: Final = 63
_EINVAL: Final = 22


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


# --- the mount API ----------------------------------------------------------------------------


def open_tree(dir_fd: int, path: str, flags: int) -> int:
    """open_tree(2): a detached mount (with OPEN_TREE_CLONE) of *path*."""
    return check(syscall(SYS_OPEN_TREE, dir_fd, encode_path(path), flags), path)


def move_mount(from_fd: int, to_fd: int, *, what: str) -> None:
    """move_mount(2) the detached tree *from_fd* onto the object *to_fd* refers to."""
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    check(syscall(SYS_MOVE_MOUNT, from_fd, b"", to_fd, b"", flags), what)


def mount_setattr(fd: int, attr_set: int, *, recursive: bool = False, what: str) -> None:
    """mount_setattr(2) on the mount *fd* refers to (detached or attached)."""
    attr = _MountAttr(attr_set=attr_set)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    check(syscall(SYS_MOUNT_SETATTR, fd, b"", flags, ctypes.byref(attr), ctypes.sizeof(attr)), what)


def fsmount_tmpfs(options: dict[str, str], attr: int) -> int:
    """A new, detached tmpfs (fsopen/fsconfig/fsmount) with *options* and mount *attr*."""
    fs_fd = check(syscall(SYS_FSOPEN, b"tmpfs", FSOPEN_CLOEXEC), "fsopen tmpfs")
    try:
        for key, value in options.items():
            check(syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_SET_STRING, encode_path(key), encode_path(value), 0), key)
        check(syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig create")
        return check(syscall(SYS_FSMOUNT, fs_fd, FSMOUNT_CLOEXEC, attr), "fsmount tmpfs")
    finally:
        os.close(fs_fd)


def umount_detach(path: str) -> None:
    """umount2(path, MNT_DETACH)."""
    check(libc.umount2(encode_path(path), MNT_DETACH), path)


def make_mounts_private() -> None:
    """mount --make-rprivate / in the current mount namespace."""
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / rprivate")


# --- namespaces -------------------------------------------------------------------------------


def setns(fd: int, nstype: int) -> None:
    """setns(2) through libc (its number differs per architecture)."""
    check(libc.setns(fd, nstype), f"setns fd {fd}")


def unshare(flags: int) -> None:
    """unshare(2) (``os.unshare`` arrives in Python 3.12)."""
    check(libc.unshare(flags), "unshare")


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


# --- capabilities -----------------------------------------------------------------------------


def drop_bounding_set(keep: frozenset[int]) -> None:
    """Drop every capability except *keep* from the bounding set, so that even root's next
    execve cannot regain them (capabilities(7): P'(permitted) is limited by the bounding set)."""
    for cap in range(CAP_LAST_CAP + 1):
        if cap in keep:
            continue
        if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) < 0 and ctypes.get_errno() != _EINVAL:
            check(-1, f"drop capability {cap}")  # EINVAL = no such capability on this kernel: nothing to drop


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
    return check(syscall(SYS_BPF, cmd, attr, _ATTR_SIZE), what)


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
