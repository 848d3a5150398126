"""Rebuild the container's ld.so.cache with the *host's* ldconfig.

NVIDIA's CVE-2024-0136/0137 came from running a container-provided ldconfig,
and runs that loaded the container's libraries. Here:

* the binary is the configured host ldconfig, opened by fd *before* entering
  the container's mount namespace and run with fexecve, so nothing in the
  container can replace it;
* it must be statically linked: a dynamic one would load its interpreter and
  libc from the container after chroot;
* it runs chrooted into the rootfs, inside the container's mount namespace
  (ldconfig in the host namespace only sees the empty mount targets, see
  runtime-lab.md §7), with a clean environment and resource limits.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from gpuhook.errors import ApplyError

_PT_INTERP: Final = 3
_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
#: libnvidia-container's limits for its ldconfig child (nvc_ldcache.c), with a larger file size:
#: an image with many libraries can have a cache over 1 MiB.
_LIMITS: Final = (
    (resource.RLIMIT_CPU, 10),
    (resource.RLIMIT_AS, 2 << 30),
    (resource.RLIMIT_NOFILE, 64),
    (resource.RLIMIT_FSIZE, 64 << 20),
)


def open_ldconfig(path: Path) -> int:
    """Open the host ldconfig for fexecve, refusing a dynamically linked one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise ApplyError("open ldconfig", str(path), errno_=err.errno) from err
    try:
        if _has_interpreter(fd):
            raise ApplyError(
                "open ldconfig", str(path),
                detail="is dynamically linked; it would load libraries from the container. "
                "Set `ldconfig:` to a static ldconfig (Debian and Ubuntu's /sbin/ldconfig is static)",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _has_interpreter(fd: int) -> bool:
    """True if the ELF file has a PT_INTERP program header (is dynamically linked)."""
    header = os.pread(fd, 64, 0)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
        raise ApplyError("open ldconfig", f"fd {fd}", detail="is not a 64-bit ELF executable")
    endian = "<" if header[5] == 1 else ">"
    phoff, = struct.unpack_from(endian + "Q", header, 32)
    phentsize, phnum = struct.unpack_from(endian + "HH", header, 54)
    table = os.pread(fd, phentsize * phnum, phoff)
    return any(
        struct.unpack_from(endian + "I", table, i * phentsize)[0] == _PT_INTERP for i in range(phnum)
    )


def run_ldconfig(ldconfig_fd: int, root_fd: int, dirs: Sequence[str], *, timeout: float) -> None:
    """Run ldconfig chrooted at *root_fd*; raises ApplyError with its output on failure."""
    argv = ["ldconfig", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *dirs]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child
        try:
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            os.fchdir(root_fd)
            os.chroot(".")
            os.chdir("/")
            for limit, value in _LIMITS:
                resource.setrlimit(limit, (value, value))
            os.execve(ldconfig_fd, argv, _ENV)
        finally:
            os._exit(127)
    os.close(write_fd)
    output, status = _wait(pid, read_fd, timeout)
    if status != 0:
        why = f"exited with status {status}" if status >= 0 else f"killed by signal {-status}"
        raise ApplyError("ldconfig", " ".join(dirs), detail=f"{why}: {output.strip()[-500:]}")


def _wait(pid: int, read_fd: int, timeout: float) -> tuple[str, int]:
    """Collect the child's output and exit status, killing it after *timeout*."""
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([read_fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)  # past the deadline: the run is refused below
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace"), os.waitstatus_to_exitcode(status)
