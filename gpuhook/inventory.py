"""The host's GPU inventory: pure values shared by discovery and planning.

Discovery builds an ``Inventory`` (or loads it from the inventory cache); the
planner only reads it. Host paths here are absolute paths on the host, already
resolved inside the configured driver/dev/proc roots.

``Inventory.to_dict``/``Inventory.from_dict`` are the JSON form the cache
stores. The cache is written by root, but ``from_dict`` still checks every
type: a damaged or foreign file must be a cache miss, never a traceback or a
half-filled inventory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def bus_key(pci_bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` or the kernel log's ``0000:18:00`` as one comparable key: ``0:18:00``."""
    domain, bus, device = pci_bus_id.split(".", 1)[0].split(":")
    return f"{int(domain, 16):x}:{bus.lower()}:{device.lower()}"


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
    #: problems NVML reported when the inventory was built (retired pages or row remapping pending/failed)
    health: tuple[str, ...] = ()
    #: persistence mode, when NVML reports it (off: every NVML start pays the driver's initialisation)
    persistence: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MigDevice:
    """A MIG device: one compute instance of one GPU instance on a parent GPU."""

    parent_index: int
    #: position among the parent's MIG devices in NVML's enumeration (the M of "G:M")
    index: int
    uuid: str
    gi: int
    ci: int
    name: str = ""


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
    #: the 32-bit copies of the libraries (i386 on x86_64), for compat32
    libraries32: tuple[DriverFile, ...] = ()
    #: config files the driver installs (Vulkan ICD, EGL vendor, OpenCL ICD); name = path in the container
    configs: tuple[DriverFile, ...] = ()
    #: IMEX channels and the feature-gated devices (GDS, MOFED, NVSwitch, GDRCopy); read fresh on each
    #: start that asks for them, never cached (they come and go with modules, independent of the driver)
    extra_nodes: tuple[HostDevice, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    #: /proc/driver/nvidia-caps/mig-minors for this host's GPUs: ("gpu0/gi7/access", 66), ("config", 1), ...
    mig_minors: tuple[tuple[str, int], ...] = ()
    #: /dev/nvidia-caps/nvidia-capN nodes (name "nvidia-caps/nvidia-capN")
    caps_nodes: tuple[HostDevice, ...] = ()
    #: critical Xid errors in the kernel log, per PCI bus id ("0000:18:00"); read fresh, never cached
    xid_errors: tuple[tuple[str, int], ...] = ()

    def gpu_node(self, minor: int) -> HostDevice | None:
        """The host's /dev/nvidia<minor>, if it exists."""
        return next((n for n in self.gpu_nodes if n.minor == minor), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (paths as strings); ``from_dict`` reads it back unchanged."""
        proc = self.proc_driver
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "gpus": [{"index": g.index, "uuid": g.uuid, "minor": g.minor, "pci_bus_id": g.pci_bus_id,
                      "model": g.model, "brand": g.brand, "arch": g.arch, "health": list(g.health),
                      "persistence": g.persistence}
                     for g in self.gpus],
            "gpu_nodes": [_device_dict(n) for n in self.gpu_nodes],
            "control_nodes": [_device_dict(n) for n in self.control_nodes],
            "libraries": [_file_dict(f) for f in self.libraries],
            "binaries": [_file_dict(f) for f in self.binaries],
            "firmware": [_file_dict(f) for f in self.firmware],
            "ipc": [_file_dict(f) for f in self.ipc],
            "configs": [_file_dict(f) for f in self.configs],
            "libraries32": [_file_dict(f) for f in self.libraries32],
            "mig_devices": [{"parent_index": m.parent_index, "index": m.index, "uuid": m.uuid, "gi": m.gi,
                             "ci": m.ci, "name": m.name} for m in self.mig_devices],
            "mig_minors": [[name, minor] for name, minor in self.mig_minors],
            "caps_nodes": [_device_dict(n) for n in self.caps_nodes],
            "proc_driver": None if proc is None else {
                "host_dir": str(proc.host_dir),
                "files": [[name, text] for name, text in proc.files],
                "gpu_dirs": list(proc.gpu_dirs),
            },
        }

    @classmethod
    def from_dict(cls, data: Any) -> Inventory:
        """Rebuild an inventory from ``to_dict`` output; raises ValueError on anything else."""
        proc: dict[str, Any] | None = _get(data, "proc_driver", (dict, type(None)))
        return cls(
            driver_version=_get(data, "driver_version", str),
            cuda_version=_get(data, "cuda_version", str),
            gpus=_items(data, "gpus", _gpu),
            gpu_nodes=_items(data, "gpu_nodes", _device),
            control_nodes=_items(data, "control_nodes", _device),
            libraries=_items(data, "libraries", _file),
            binaries=_items(data, "binaries", _file),
            firmware=_items(data, "firmware", _file),
            ipc=_items(data, "ipc", _file),
            configs=_items(data, "configs", _file),
            libraries32=_items(data, "libraries32", _file),
            mig_devices=_items(data, "mig_devices", _mig),
            mig_minors=_items(data, "mig_minors", _name_and_minor),
            caps_nodes=_items(data, "caps_nodes", _device),
            proc_driver=None if proc is None else ProcDriver(
                host_dir=_path(proc, "host_dir"),
                files=_items(proc, "files", _name_and_text),
                gpu_dirs=_items(proc, "gpu_dirs", _str),
            ),
        )


# --- JSON form helpers (strict: bool is not an int, paths are absolute) -----------------------


def _device_dict(node: HostDevice) -> dict[str, Any]:
    """A HostDevice as JSON data."""
    return {"name": node.name, "host_path": str(node.host_path), "major": node.major, "minor": node.minor}


def _file_dict(item: DriverFile) -> dict[str, Any]:
    """A DriverFile as JSON data."""
    return {"name": item.name, "host_path": str(item.host_path)}


def _get(data: Any, key: str, kind: type[T] | tuple[type, ...]) -> T:
    """``data[key]``, which must be of *kind* (a bool never passes for an int)."""
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"inventory: missing {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"inventory: {key!r} has the wrong type ({type(value).__name__})")
    return value  # type: ignore[return-value]  # checked against kind just above


def _path(data: Any, key: str) -> Path:
    """An absolute host path."""
    value = _get(data, key, str)
    if not value.startswith("/"):
        raise ValueError(f"inventory: {key!r} is not an absolute path: {value!r}")
    return Path(value)


def _items(data: Any, key: str, decode: Callable[[Any], T]) -> tuple[T, ...]:
    """A list of entries, each decoded by *decode*."""
    return tuple(decode(item) for item in _get(data, key, list))


def _str(value: Any) -> str:
    """A string list entry."""
    if not isinstance(value, str):
        raise ValueError(f"inventory: expected a string, got {type(value).__name__}")
    return value


def _name_and_text(value: Any) -> tuple[str, str]:
    """A [name, text] pair."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("inventory: expected a [name, text] pair")
    return _str(value[0]), _str(value[1])


def _gpu(data: Any) -> Gpu:
    """A Gpu entry."""
    return Gpu(index=_get(data, "index", int), uuid=_get(data, "uuid", str), minor=_get(data, "minor", int),
               pci_bus_id=_get(data, "pci_bus_id", str), model=_get(data, "model", str),
               brand=_get(data, "brand", str), arch=_get(data, "arch", str),
               health=_items(data, "health", _str), persistence=_get(data, "persistence", (bool, type(None))))


def _device(data: Any) -> HostDevice:
    """A HostDevice entry."""
    return HostDevice(name=_get(data, "name", str), host_path=_path(data, "host_path"),
                      major=_get(data, "major", int), minor=_get(data, "minor", int))


def _file(data: Any) -> DriverFile:
    """A DriverFile entry."""
    return DriverFile(name=_get(data, "name", str), host_path=_path(data, "host_path"))


def _mig(data: Any) -> MigDevice:
    """A MigDevice entry."""
    return MigDevice(parent_index=_get(data, "parent_index", int), index=_get(data, "index", int),
                     uuid=_get(data, "uuid", str), gi=_get(data, "gi", int), ci=_get(data, "ci", int),
                     name=_get(data, "name", str))


def _name_and_minor(value: Any) -> tuple[str, int]:
    """A [name, minor] pair."""
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], int) or isinstance(value[1], bool):
        raise ValueError("inventory: expected a [name, minor] pair")
    return _str(value[0]), value[1]
