"""Make one syscall fail with EPERM, then exec a command: ``python -I seccomp_wrap.py NR -- ARGV...``.

Installs a classic-BPF seccomp filter (``prctl(PR_SET_NO_NEW_PRIVS)`` then
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``) that returns ``EPERM`` for x86_64 syscall NR and
allows everything else, then ``execv``s ARGV. The filter is inherited by every child, so gpuhook's
forked apply step meets the failure exactly where it makes that call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
# struct seccomp_data: int nr; __u32 arch; ...
_OFF_NR, _OFF_ARCH = 0, 4
_BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_RET_K = 0x06  # BPF_RET | BPF_K


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def install(nr: int) -> None:
    """Deny syscall *nr* with EPERM for this process and its descendants."""
    program = [
        _SockFilter(_BPF_LD_W_ABS, 0, 0, _OFF_ARCH),
        _SockFilter(_BPF_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),  # x86_64: go on; anything else: allow
        _SockFilter(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        _SockFilter(_BPF_LD_W_ABS, 0, 0, _OFF_NR),
        _SockFilter(_BPF_JEQ_K, 0, 1, nr),
        _SockFilter(_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM),
        _SockFilter(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*program)
    prog = _SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.cast(ctypes.byref(prog), ctypes.c_void_p), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main(argv: list[str]) -> int:
    """Install the filter and exec the command."""
    if os.uname().machine != "x86_64":
        raise SystemExit("seccomp_wrap.py: the syscall numbers here are x86_64's")
    split = argv.index("--")
    install(int(argv[0]))
    command = argv[split + 1:]
    os.execv(command[0], command)
    return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
