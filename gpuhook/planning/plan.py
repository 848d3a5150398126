"""The plan: every change the hook will make to one container, as plain values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceNode:
    """A character device to create at *path* in the container (mknod, not a bind mount)."""

    path: str
    major: int
    minor: int
    mode: int = 0o666


@dataclass(frozen=True, slots=True, kw_only=True)
class BindMount:
    """A host file bind-mounted read-only, nosuid, nodev at *target* in the container."""

    source: str
    target: str
    noexec: bool = False
    #: a directory (mounted on a directory made at *target*) rather than a file
    directory: bool = False
    #: read-write: the MPS pipe directory, whose clients make their pipes in it (NVIDIA's too, since 1.18.2)
    writable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Symlink:
    """A symlink at *path* in the container pointing to *target* (created only if absent)."""

    path: str
    target: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcDriverMount:
    """A read-only tmpfs over the container's /proc/driver/nvidia (nvc_mount.c mount_procfs).

    It holds copies of the host's files, with ``ModifyDeviceFiles: 0`` so NVML in
    the container never tries to mknod device nodes, and the selected GPUs'
    ``gpus/<bus id>`` directories bind-mounted from the host.
    """

    target: str
    files: tuple[tuple[str, str], ...]
    gpu_dirs: tuple[tuple[str, str], ...]  # (host dir, name under gpus/)
    #: MIG capability files: (host file, path under /proc/driver/nvidia), e.g. capabilities/gpu0/mig/gi7/access
    cap_files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupRule:
    """One device-cgroup allow rule, always exact: ``c MAJOR:MINOR rw``."""

    major: int
    minor: int
    access: str = "rw"

    def __str__(self) -> str:
        return f"c {self.major}:{self.minor} {self.access}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ldconfig:
    """Rebuild the container's ld.so.cache so the injected libraries resolve."""

    dirs: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaCompat:
    """Use the image's CUDA forward-compatibility libraries when they are newer than the host driver.

    At apply time the image's *directory* is listed (names only; nothing in it is
    read, loaded or mounted on the host side); if it holds a ``libcuda.so.<major>.*``
    with a major above *host_major*, the directory goes first in the container's
    linker configuration, as NVIDIA's ``cuda-compat-mode=ldconfig`` does.
    """

    directory: str
    host_major: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    """Something the request could use that this host does not have."""

    what: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything to apply to one container, in apply order."""

    gpus: tuple[str, ...]
    devices: tuple[DeviceNode, ...]
    mounts: tuple[BindMount, ...]
    symlinks: tuple[Symlink, ...]
    proc_driver: ProcDriverMount | None
    cgroup_rules: tuple[CgroupRule, ...]
    ldconfig: Ldconfig | None
    cuda_compat: CudaCompat | None = None
    skipped: tuple[Skipped, ...] = ()
    #: things the operator should know (an unhealthy GPU used under ``unhealthy_gpus: warn``)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (for ``gpuhook plan`` and the log)."""
        data = dataclasses.asdict(self)
        data["cgroup_rules"] = [str(r) for r in self.cgroup_rules]
        if self.proc_driver is not None:
            data["proc_driver"]["files"] = [name for name, _ in self.proc_driver.files]
        return data
