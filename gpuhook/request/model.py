"""Value types of a parsed GPU request."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpuhook.request.quick import DEVICE_LIST_DIR
from gpuhook.request.requirements import Requirement


class Capability(enum.StrEnum):
    """The NVIDIA_DRIVER_CAPABILITIES names (nvidia-toolkit.md §2.3)."""

    COMPUTE = "compute"
    COMPAT32 = "compat32"
    GRAPHICS = "graphics"
    UTILITY = "utility"
    VIDEO = "video"
    DISPLAY = "display"
    NGX = "ngx"


ALL_CAPABILITIES = frozenset(Capability)
DEFAULT_CAPABILITIES = frozenset({Capability.UTILITY, Capability.COMPUTE})


@dataclass(frozen=True, slots=True)
class GpuIndex:
    """A GPU by NVML enumeration index (``0``)."""

    index: int

    def __str__(self) -> str:
        return str(self.index)


@dataclass(frozen=True, slots=True)
class GpuUuid:
    """A GPU by UUID (``GPU-…``); matched case-insensitively, full length."""

    uuid: str

    def __str__(self) -> str:
        return self.uuid


@dataclass(frozen=True, slots=True)
class MigUuid:
    """A MIG device by UUID (``MIG-…`` or the legacy ``MIG-GPU-<uuid>/<gi>/<ci>``)."""

    uuid: str

    def __str__(self) -> str:
        return self.uuid


@dataclass(frozen=True, slots=True)
class MigIndex:
    """The M-th MIG device of GPU G (``G:M``), in enumeration order."""

    gpu: int
    mig: int

    def __str__(self) -> str:
        return f"{self.gpu}:{self.mig}"


DeviceId = GpuIndex | GpuUuid | MigUuid | MigIndex


@dataclass(frozen=True, slots=True, kw_only=True)
class MigAsk:
    """``mig=PROFILE[#NAME]``: a MIG instance of a GPU-instance profile, reused if one is free, else made.

    It is made (or reused) at the start, held while the container runs and, if gpuhook made it,
    destroyed when the container ends.
    """

    #: a GPU-instance profile name as ``nvidia-smi mig -lgip`` shows it (``3g.20gb``, ``1g.5gb+me``)
    profile: str
    #: ``#NAME``: names the instance while it exists (one holder per name and GPU)
    name: str | None = None
    #: the GPU token right before it; None: any MIG-enabled GPU with room, least used first
    gpu: GpuIndex | GpuUuid | None = None

    def __str__(self) -> str:
        where = f"{self.gpu}," if self.gpu is not None else ""
        return f"{where}mig={self.profile}" + (f"#{self.name}" if self.name else "")


class RequestSource(enum.StrEnum):
    """Where a request's device list came from (the hook's four in NVIDIA's priority order); leads its messages."""

    CDI_ANNOTATIONS = "CDI annotations"
    VOLUME_MOUNTS = f"volume mounts under {DEVICE_LIST_DIR}"
    VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
    LEGACY_IMAGE = "the legacy CUDA_VERSION image rule"
    #: nvidia-container-cli configure --device (ctr run --gpus)
    DEVICE_OPTION = "--device"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuRequest:
    """A container's resolved request; ``all_devices``, ``count`` free GPUs, or the listed ``devices``.

    A ``count`` request is placed at the start (``sharing.allocate``), which turns it into the
    listed GPUs it picked before anything is planned.

    ``NVIDIA_VISIBLE_DEVICES=none`` is a request with no devices: the driver's
    files and control nodes are injected, no ``/dev/nvidiaN``.
    """

    all_devices: bool
    devices: tuple[DeviceId, ...]
    capabilities: frozenset[Capability]
    #: ``count=N`` / ``any``: this many GPUs free under their policies (devices is then empty)
    count: int | None = None
    #: ``mig=PROFILE[#NAME]``: MIG instances to make or reuse at the start (``sharing.allocate`` turns each
    #: into the MigUuid it gets, before anything is planned)
    mig_asks: tuple[MigAsk, ...] = ()
    requirements: tuple[Requirement, ...] = ()
    #: NVIDIA_IMEX_CHANNELS: channel ids for /dev/nvidia-caps-imex-channels/channelN
    imex_channels: tuple[int, ...] = ()
    #: NVIDIA_GDS / _MOFED / _NVSWITCH / _GDRCOPY set to "enabled" (lower-case names)
    gated: frozenset[str] = frozenset()
    #: NVIDIA_MIG_CONFIG_DEVICES=all / NVIDIA_MIG_MONITOR_DEVICES=all (privileged containers only)
    mig_config: bool = False
    mig_monitor: bool = False
    source: RequestSource = RequestSource.VISIBLE_DEVICES
    #: the raw value the devices came from, for error messages
    raw: str = ""
