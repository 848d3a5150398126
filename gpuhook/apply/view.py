"""Entering the hook's view of the host: how a gpuhookd worker becomes the hook it serves.

The hook passes fds of its mount, cgroup, pid and user namespaces and of its root
(``gpuhook.daemon.trust`` has already checked they are the hook's own). The pid and user
namespaces cannot be entered by a forked worker and need not be: the OCI state's pid and the
container's ids are numbers in them, so the worker must already share them, or it declines.
The mount and cgroup namespaces and the root are taken, so every later path (bundle, rootfs,
driver root, cache) and the container's cgroup resolve as in the hook process.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuhook.sys import pathrs, syscalls


def enter_client_view(fds: Sequence[int]) -> str:
    """Enter the hook's mount and cgroup namespaces and root; or why not ('' when entered).

    An fd that is not the namespace it claims (a regular file, a network namespace) is refused
    by the kernel (EINVAL): that is a decline, never a dead worker.
    """
    mnt, cgroup, pid, user, root = fds
    for fd, name in ((pid, "pid"), (user, "user")):
        if not pathrs.same_namespace(fd, name):
            return (f"the hook runs in another {name} namespace than gpuhookd; "
                    "the OCI state's pid would name another process here")
    try:
        if not pathrs.same_namespace(cgroup, "cgroup"):
            syscalls.setns(cgroup, syscalls.CLONE_NEWCGROUP)  # the kernel checks that fd is a cgroup namespace
        syscalls.enter_mount_view(mnt, root)
    except OSError as err:
        return f"cannot enter the hook's view: {err.strerror or err} (an fd that is not its namespace or root)"
    return ""
