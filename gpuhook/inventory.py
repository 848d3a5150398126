"""The host's GPU inventory: pure values shared by discovery and planning.

Discovery builds an ``Inventory`` once per container start; the planner only
reads it. Host paths here are absolute paths on the host, already resolved
inside the configured driver/dev/proc roots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One physical GPU as NVML enumerates it."""

    index: int
    uuid: str
    minor: int
    pci_bus_id: str
    model: str
    brand: str = ""
    arch: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostDevice:
    """A character device node on the host (under the dev root)."""

    name: str
    host_path: Path
    major: int
    minor: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverFile:
    """A driver file on the host: a library, binary, firmware blob or IPC socket."""

    name: str
    host_path: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcDriver:
    """The host's /proc/driver/nvidia: the text files NVIDIA copies, and per-GPU dirs."""

    host_dir: Path
    files: tuple[tuple[str, str], ...]
    gpu_dirs: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Inventory:
    """Everything about the host's driver that planning needs."""

    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...]
    gpu_nodes: tuple[HostDevice, ...]
    control_nodes: tuple[HostDevice, ...]
    libraries: tuple[DriverFile, ...]
    binaries: tuple[DriverFile, ...]
    firmware: tuple[DriverFile, ...]
    ipc: tuple[DriverFile, ...]
    proc_driver: ProcDriver | None = None

    def gpu_node(self, minor: int) -> HostDevice | None:
        """The host's /dev/nvidia<minor>, if it exists."""
        return next((n for n in self.gpu_nodes if n.minor == minor), None)
