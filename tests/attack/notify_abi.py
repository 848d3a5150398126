"""The seccomp user-notification ABI (x86_64) that pinpoint.py and killat.py share: constants and structs.

Both run as ``python -I SCRIPT`` (so this directory is not on their path: each adds it) and stop a
traced process at one syscall through ``SECCOMP_RET_USER_NOTIF``.
"""

from __future__ import annotations

import ctypes

libc = ctypes.CDLL(None, use_errno=True)
SYS_SECCOMP = 317
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
AUDIT_ARCH_X86_64 = 0xC000003E
PR_SET_NO_NEW_PRIVS = 38


class SockFilter(ctypes.Structure):
    """struct sock_filter."""

    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    """struct sock_fprog."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


class SeccompData(ctypes.Structure):
    """struct seccomp_data."""

    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("instruction_pointer", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class Notif(ctypes.Structure):
    """struct seccomp_notif."""

    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", SeccompData)]


class NotifResp(ctypes.Structure):
    """struct seccomp_notif_resp."""

    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def _iowr(nr: int, size: int) -> int:
    """The _IOWR('!', nr, size) ioctl number."""
    return (3 << 30) | (size << 16) | (ord("!") << 8) | nr


NOTIF_RECV = _iowr(0, ctypes.sizeof(Notif))
NOTIF_SEND = _iowr(1, ctypes.sizeof(NotifResp))
