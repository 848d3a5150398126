"""Who gpuhookd serves: a caller that could do the work itself, sending its own view of the host.

gpuhookd runs as full root. A request makes it change a container (mounts, device nodes, the
device cgroup, ldconfig) in a view of the host the request names, so serving a caller that has
less power than that would lend it the daemon's (a confused deputy: a container's uid 0 with
the socket reachable and no capabilities). A caller is served only when every check holds:

1. its ``SO_PEERCRED`` uid is 0, and it is pinned by a pidfd (``SO_PEERPIDFD``, else
   ``pidfd_open`` of its pid) that is checked alive again after the checks, so every ``/proc``
   read below was of the process that connected;
2. it lives in the daemon's user and pid namespaces (its capabilities mean what ours mean, and
   the OCI state's pid names the same process for both);
3. its effective capabilities (``CapEff``) cover every capability the work uses (``REQUIRED``);
4. the namespace fds and root fd it sent are its own (``/proc/<pid>/ns/*`` and
   ``/proc/<pid>/root``, by (st_dev, st_ino)): the view the worker enters is the caller's;
5. for GPU work: the config file the caller would read (its ``--config``, else its
   ``$GPUHOOK_CONFIG``, else the default) is the daemon's own (``check_config``): the settings,
   log file and driver roots come from the daemon's configuration, never from the caller;
6. for GPU work: the OCI state's pid is alive and in a mount namespace that is neither the
   daemon's nor the hook's (``check_container``): a container being created, not a host process.

Anything else is ``declined``: the hook then does the work itself, with its own power.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

#: The capabilities the GPU work uses, by number (linux/capability.h) and why.
REQUIRED = {
    "CAP_DAC_OVERRIDE": 1,  # ldconfig writes the rootfs's ld.so.cache (the only capability its sandbox keeps)
    "CAP_SETPCAP": 8,  # the ldconfig sandbox drops the bounding set
    "CAP_SYS_CHROOT": 18,  # setns into a mount namespace, chroot into the hook's root and the rootfs
    "CAP_SYS_PTRACE": 19,  # /proc/<container pid>/ns and root of a process with full capabilities
    "CAP_SYS_ADMIN": 21,  # setns, open_tree/move_mount, mount_setattr, bpf, devices.allow
    "CAP_MKNOD": 27,  # the device nodes
}
_MASK = sum(1 << bit for bit in REQUIRED.values())
#: In the order the client sends them (``client.NAMESPACES``), then the root.
NAMESPACES = ("mnt", "cgroup", "pid", "user")
_SO_PEERPIDFD = 77  # Linux 6.5; the socket module names it from Python 3.13


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a connection: its uid, its pid here, a pidfd pinning it."""

    uid: int
    pid: int
    pidfd: int


def peer_of(conn: socket.socket) -> Peer:
    """The connecting process, pinned by a pidfd; raises OSError (the caller closes ``pidfd``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)  # struct ucred {pid, uid, gid}
    pid, uid = int.from_bytes(creds[0:4], sys.byteorder), int.from_bytes(creds[4:8], sys.byteorder)
    try:
        # The kernel's pidfd of the process that connected: no window in which its pid is reused.
        pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:  # older kernels: pin it now and check it is still alive after the checks
        pidfd = os.pidfd_open(pid) if pid > 0 else -1
    return Peer(uid=uid, pid=pid, pidfd=pidfd)


def check_caller(peer: Peer, fds: Sequence[int]) -> str:
    """'' when *peer* may be served with the view *fds* (mnt, cgroup, pid, user, root); else why not."""
    if peer.uid != 0:
        return f"peer uid {peer.uid} is not root"
    if peer.pidfd < 0:
        return "the peer's pid is unknown (it connected from another pid namespace)"
    try:
        reason = _check(peer.pid, fds)
        # Still the process that connected: every /proc/<pid> read above was of it.
        signal.pidfd_send_signal(peer.pidfd, 0)
    except ProcessLookupError:
        return f"the peer (pid {peer.pid}) exited during the checks"
    except OSError as err:
        return f"the peer (pid {peer.pid}) cannot be inspected: {err.strerror or err}"
    return reason


def _check(pid: int, fds: Sequence[int]) -> str:
    """The namespace, capability and view checks of the module docstring, against ``/proc/<pid>``."""
    proc = f"/proc/{pid}"
    theirs = {name: _identity(os.stat(f"{proc}/ns/{name}")) for name in NAMESPACES}
    for name, why in (("user", "its capabilities would not be the daemon's"),
                      ("pid", "the OCI state's pid would name another process here")):
        if theirs[name] != _identity(os.stat(f"/proc/self/ns/{name}")):
            return f"the hook runs in another {name} namespace than gpuhookd; {why}"
    lacking = _lacking(_effective_caps(proc))
    if lacking:
        return (f"the hook (pid {pid}) lacks {', '.join(lacking)}; gpuhookd serves only a caller that could "
                "do the work itself (run the hook as the runtime runs it, with full root capabilities)")
    *namespaces, root = fds
    for name, fd in zip(NAMESPACES, namespaces, strict=True):
        if _identity(os.fstat(fd)) != theirs[name]:
            return f"the {name} namespace fd the hook sent is not its own {name} namespace (pid {pid})"
    if _identity(os.fstat(root)) != _identity(os.stat(f"{proc}/root")):
        return f"the root fd the hook sent is not its own root (pid {pid})"
    return ""


def _effective_caps(proc: str) -> int:
    """The ``CapEff`` mask in ``<proc>/status`` (read raw: this runs for every container start)."""
    fd = os.open(f"{proc}/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.read(fd, 1 << 16)  # ~1.5 KiB; procfs gives a read this size the whole file
    finally:
        os.close(fd)
    start = status.find(b"\nCapEff:")
    if start < 0:
        raise OSError(0, "no CapEff line in its status")
    return int(status[start + 8 : status.index(b"\n", start + 8)], 16)


def _lacking(caps: int) -> list[str]:
    """The REQUIRED capabilities missing from *caps*."""
    if caps & _MASK == _MASK:
        return []
    return [name for name, bit in REQUIRED.items() if not caps >> bit & 1]


def _identity(st: os.stat_result) -> tuple[int, int]:
    """(device, inode): what tells two namespace files, or two directories, apart."""
    return st.st_dev, st.st_ino


def check_config(caller: str, own: str) -> str:
    """'' when the caller's effective config path *caller* is the daemon's *own*; else why not."""
    if os.path.normpath(caller) == os.path.normpath(own) and os.path.isabs(caller):
        return ""
    return (f"the hook's config {caller!r} is not gpuhookd's ({own!r}); gpuhookd serves only its own "
            "configuration (start it with GPUHOOK_CONFIG or --config naming the same file)")


def check_container(pid: object, hook_mnt_fd: int) -> str:
    """'' when the OCI state's *pid* is a live process in a mount namespace of its own; else why not.

    With the caller's checks holding it could enter any process itself, so this guards against a
    state that names a host process (mounts would land in the host's view), not against the caller.
    """
    if type(pid) is not int or pid <= 1:
        return ""  # the start refuses it with its own message
    try:
        theirs = _identity(os.stat(f"/proc/{pid}/ns/mnt"))
    except OSError as err:
        return f"the OCI state's pid {pid} cannot be inspected: {err.strerror or err}"
    if theirs in (_identity(os.stat("/proc/self/ns/mnt")), _identity(os.fstat(hook_mnt_fd))):
        return (f"the OCI state's pid {pid} shares the mount namespace of gpuhookd or of the hook: it is not a "
                "container being created (run gpuhook as a prestart or createRuntime hook)")
    return ""
