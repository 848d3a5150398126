"""The host's GPU inventory and the facts read fresh at each start: pure values shared by discovery and planning.

Discovery builds an ``Inventory`` (or loads it from the inventory cache) and
reads ``LiveFacts`` beside it; the planner only reads both. The split is by how
fast a fact changes: the ``Inventory`` holds what only changes with the driver
(NVML's answers, the driver's files, the GPU nodes) and is cached; ``LiveFacts``
holds what comes and goes while the driver stays (IMEX channels and gated
nodes, Xid errors, the MIG instances and their capability nodes), read at each
start without NVML. Host paths here are absolute paths on the host, already
resolved inside the configured driver/dev/proc roots.

A MIG device's UUID comes only from NVML, so the inventory keeps the MIG
devices NVML reported; ``narrow_to_live`` drops those the live layout no longer
has, and ``unseen_instances`` names live instances NVML was never asked about
(discovery asks it again when a start needs one; see gpuhook.discovery.cache).

``Inventory.to_dict``/``Inventory.from_dict`` are the JSON form the cache
stores. The cache is written by root, but ``from_dict`` still checks every
type: a damaged or foreign file must be a cache miss, never a traceback or a
half-filled inventory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def bus_key(pci_bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` or the kernel log's ``0000:18:00`` as one comparable key: ``0:18:00``."""
    domain, bus, device = pci_bus_id.split(".", 1)[0].split(":")
    return f"{int(domain, 16):x}:{bus.lower()}:{device.lower()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MigProfile:
    """One GPU-instance profile of a GPU, as nvidia-smi mig -lgip lists it."""

    #: "3g.20gb" (NVML's info.name without the leading "MIG ")
    name: str
    #: info.id: the id nvmlDeviceCreateGpuInstance takes
    profile_id: int
    #: info.sliceCount (compute slices)
    slices: int
    #: info.memorySizeMB
    memory_mib: int
    #: info.instanceCount: how many fit on an empty GPU
    instances: int


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
    #: total device memory in MiB (NVML's), where reported: MPS's default per-client limit is a share of it
    memory_mib: int | None = None
    #: MIG mode is enabled now (the current mode, not the pending one)
    mig_enabled: bool = False
    #: the GPU-instance profiles NVML lists for it, MIG mode on or off (empty: the GPU has no MIG)
    mig_profiles: tuple[MigProfile, ...] = ()

    def mig_profile(self, name: str) -> MigProfile | None:
        """The GPU-instance profile called exactly *name* ("3g.20gb"), if this GPU has one."""
        return next((p for p in self.mig_profiles if p.name == name), None)


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
    #: its GPU instance's profile name, "3g.20gb" ("" when NVML did not say)
    profile: str = ""


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class MigInstance:
    """A compute instance that exists now, as /proc/driver/nvidia/capabilities shows it (no NVML)."""

    #: the parent GPU's device minor (capabilities name GPUs by minor: ``gpu<minor>/mig/...``)
    gpu_minor: int
    gi: int
    ci: int


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
    #: the MIG devices NVML reported when the inventory was built (``narrow_to_live`` keeps those that still exist)
    mig_devices: tuple[MigDevice, ...] = ()
    #: the MIG instances that existed when NVML was asked: with mig_devices, what NVML has been asked about
    #: (an instance it did not report stays unreported, rather than sending every start back to NVML)
    mig_layout: tuple[MigInstance, ...] = ()
    #: /proc/driver/nvidia-caps/mig-minors for this host's GPUs: ("gpu0/gi7/access", 66), ("config", 1), ...
    #: (the driver lists every capability it can grant, existing or not: it changes only with the driver)
    mig_minors: tuple[tuple[str, int], ...] = ()

    def nvml_library(self) -> Path | None:
        """The driver's libnvidia-ml, by the absolute path discovery found it at (MIG and the metrics use NVML)."""
        return next((f.host_path for f in self.libraries if f.name.startswith("libnvidia-ml.so.")), None)

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
                      "persistence": g.persistence, "memory_mib": g.memory_mib, "mig_enabled": g.mig_enabled,
                      "mig_profiles": [_profile_dict(p) for p in g.mig_profiles]}
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
                             "ci": m.ci, "name": m.name, "profile": m.profile} for m in self.mig_devices],
            "mig_layout": [[i.gpu_minor, i.gi, i.ci] for i in self.mig_layout],
            "mig_minors": [[name, minor] for name, minor in self.mig_minors],
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
            mig_layout=_items(data, "mig_layout", _instance),
            mig_minors=_items(data, "mig_minors", _name_and_minor),
            proc_driver=None if proc is None else ProcDriver(
                host_dir=_path(proc, "host_dir"),
                files=_items(proc, "files", _name_and_text),
                gpu_dirs=_items(proc, "gpu_dirs", _str),
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveNeeds:
    """Which live facts a start reads (each costs a few reads at every start; none costs NVML)."""

    #: IMEX channels and gated nodes (the request names IMEX channels or NVIDIA_<NAME>=enabled)
    extra_nodes: bool = False
    #: the kernel log's Xid errors (the health policy looks at them)
    xids: bool = False
    #: the MIG layout and capability nodes (the request may select MIG devices or MIG capabilities)
    mig: bool = False
    #: the host's MPS pipe directory (the request asks for compute)
    mps: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveFacts:
    """What is read fresh at every GPU start, without NVML, and never cached."""

    #: IMEX channels and the feature-gated devices (GDS, MOFED, NVSwitch, GDRCopy): they come and go with
    #: modules, independent of the driver
    extra_nodes: tuple[HostDevice, ...] = ()
    #: critical Xid errors in the kernel log, per PCI bus key (``bus_key``)
    xid_errors: tuple[tuple[str, int], ...] = ()
    #: the compute instances under /proc/driver/nvidia/capabilities now; None: not read (MIG not asked for)
    mig_instances: frozenset[MigInstance] | None = None
    #: /dev/nvidia-caps/nvidia-capN nodes (name "nvidia-caps/nvidia-capN"): made as MIG instances are
    caps_nodes: tuple[HostDevice, ...] = ()
    #: the host's MPS pipe directory (name: its path, the same in the container), while an MPS daemon has one
    mps_pipe: DriverFile | None = None
    #: the /dev/shm the MPS daemon shares with its clients (gpuhook's daemons only; name "/dev/shm")
    mps_shm: DriverFile | None = None


def mig_instance(inventory: Inventory, mig: MigDevice) -> MigInstance:
    """The live-layout name of one of *inventory*'s MIG devices."""
    return MigInstance(gpu_minor=inventory.gpus[mig.parent_index].minor, gi=mig.gi, ci=mig.ci)


def narrow_to_live(inventory: Inventory, live: LiveFacts) -> Inventory:
    """*inventory* with only the MIG devices that exist now, numbered per parent as NVML would number them.

    NVML's ``G:M`` is a device's position among its parent's existing MIG devices, so a destroyed
    instance moves the later ones down. Idempotent; unchanged when the layout was not read.
    """
    if live.mig_instances is None:
        return inventory
    kept: list[MigDevice] = []
    positions: dict[int, int] = {}
    for mig in inventory.mig_devices:
        if mig_instance(inventory, mig) not in live.mig_instances:
            continue
        position = positions.get(mig.parent_index, 0)
        positions[mig.parent_index] = position + 1
        kept.append(mig if mig.index == position else replace(mig, index=position))
    if tuple(kept) == inventory.mig_devices:
        return inventory
    return replace(inventory, mig_devices=tuple(kept))


def unseen_instances(inventory: Inventory, live: LiveFacts) -> tuple[MigInstance, ...]:
    """Live MIG instances on *inventory*'s GPUs that NVML was never asked about (only NVML knows their UUIDs)."""
    if live.mig_instances is None:
        return ()
    minors = {gpu.minor for gpu in inventory.gpus}
    seen = {*inventory.mig_layout, *(mig_instance(inventory, m) for m in inventory.mig_devices)}
    return tuple(sorted(i for i in live.mig_instances if i.gpu_minor in minors and i not in seen))


# --- JSON form helpers (strict: bool is not an int, paths are absolute) -----------------------


def _device_dict(node: HostDevice) -> dict[str, Any]:
    """A HostDevice as JSON data."""
    return {"name": node.name, "host_path": str(node.host_path), "major": node.major, "minor": node.minor}


def _profile_dict(profile: MigProfile) -> dict[str, Any]:
    """A MigProfile as JSON data."""
    return {"name": profile.name, "profile_id": profile.profile_id, "slices": profile.slices,
            "memory_mib": profile.memory_mib, "instances": profile.instances}


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
               health=_items(data, "health", _str), persistence=_get(data, "persistence", (bool, type(None))),
               memory_mib=_get(data, "memory_mib", (int, type(None))),
               mig_enabled=_get(data, "mig_enabled", bool), mig_profiles=_items(data, "mig_profiles", _profile))


def _profile(data: Any) -> MigProfile:
    """A MigProfile entry."""
    return MigProfile(name=_get(data, "name", str), profile_id=_get(data, "profile_id", int),
                      slices=_get(data, "slices", int), memory_mib=_get(data, "memory_mib", int),
                      instances=_get(data, "instances", int))


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
                     name=_get(data, "name", str), profile=_get(data, "profile", str))


def _name_and_minor(value: Any) -> tuple[str, int]:
    """A [name, minor] pair."""
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], int) or isinstance(value[1], bool):
        raise ValueError("inventory: expected a [name, minor] pair")
    return _str(value[0]), value[1]


def _instance(value: Any) -> MigInstance:
    """A [gpu minor, gi, ci] triple."""
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ValueError("inventory: expected a [gpu minor, gi, ci] triple")
    return MigInstance(gpu_minor=value[0], gi=value[1], ci=value[2])
