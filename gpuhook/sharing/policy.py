"""The per-GPU sharing policy, decoded from either of its two syntaxes into one model.

``gpus:`` in gpuhook.yaml (lower-case keys) and the JSON device file that GPU-partitioning
guides give for nvidia-container-cli (``device_policy:``; ``{"Devices": [{"DeviceID": ...}]}``)
say the same things, so both decode to a ``Policy`` here, refusing unknown keys and
contradictions with a message that names the key. Which host GPU an entry names (an index, a
UUID or a PCI bus id) is only known against an inventory: ``Policy.resolve``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpuhook.errors import ConfigError
from gpuhook.inventory import Gpu
from gpuhook.request.model import Capability
from gpuhook.request.grammar import MIG_PROFILE


class Sharing(enum.StrEnum):
    """How many containers may hold one GPU at once."""

    #: any number (NVIDIA's behaviour); leases only say who holds it
    UNLIMITED = "unlimited"
    #: one container at a time
    EXCLUSIVE = "exclusive"
    #: at most ``replicas`` containers at once (time-slicing)
    SHARED = "shared"
    #: at most ``replicas`` containers at once, as clients of one MPS daemon
    MPS = "mps"


#: The sharing modes that take ``replicas``.
COUNTED: Final = frozenset({Sharing.SHARED, Sharing.MPS})
MAX_REPLICAS: Final = 1024
ALL_DEVICES: Final = "all"
_INDEX_RE: Final = re.compile(r"[0-9]{1,4}")
_UUID_RE: Final = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
#: NVML's bus id (``00000000:18:00.0``) or the short lspci form (``0000:18:00.0``, ``18:00.0``)
_PCI_RE: Final = re.compile(r"(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
_PROFILE_RE: Final = re.compile(MIG_PROFILE)


@dataclass(frozen=True, slots=True, kw_only=True)
class MigMode:
    """``MIGMode``: give a request for this GPU a MIG instance of ``instance`` (MIG on demand)."""

    enable: bool
    instance: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MpsLimits:
    """``mps``: what each client of the GPU's MPS daemon may use (None: the GPU's share per replica)."""

    #: of the GPU's SMs, in percent (set_default_active_thread_percentage); None: 100 / replicas
    thread_percentage: float | None = None
    #: device memory a client may pin, in MiB (set_default_device_pinned_mem_limit); None: total / replicas
    memory_limit_mib: int | None = None
    #: the size of the /dev/shm tmpfs the daemon shares with its clients, in MiB; None: DEFAULT_SHM_SIZE_MIB
    shm_size_mib: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPolicy:
    """One GPU's rules (or the default's, for ``device: all``)."""

    #: as written: an index, a GPU UUID, a PCI bus id, or "all"
    device: str = ALL_DEVICES
    sharing: Sharing = Sharing.UNLIMITED
    #: shared/mps: at most this many containers at once; None for the others
    replicas: int | None = None
    #: the driver capabilities a container holding this GPU may be given; None: any
    capabilities: frozenset[Capability] | None = None
    mig: MigMode | None = None
    #: sharing mps: the clients' limits as written
    mps: MpsLimits | None = None

    @property
    def limit(self) -> int | None:
        """How many containers may hold it at once; None: no limit."""
        if self.sharing is Sharing.EXCLUSIVE:
            return 1
        return self.replicas if self.sharing in COUNTED else None

    def describe(self) -> str:
        """``exclusive``, ``shared (replicas 2)``, ...: how a message names the policy."""
        return f"{self.sharing} (replicas {self.replicas})" if self.replicas is not None else str(self.sharing)


UNLIMITED: Final = GpuPolicy()
#: An MPS GPU's /dev/shm (a tmpfs of its own) when its policy gives no ``mps.shm_size``: NVIDIA's device
#: plugin mounts 64 MiB for its MPS daemons.
DEFAULT_SHM_SIZE_MIB: Final = 64


def shm_size_mib(policy: GpuPolicy) -> int:
    """``sharing: mps``: the MiB of the /dev/shm tmpfs *policy*'s daemon shares with its clients."""
    assert policy.mps is not None
    return policy.mps.shm_size_mib or DEFAULT_SHM_SIZE_MIB


def client_limits(policy: GpuPolicy, gpu: Gpu) -> tuple[float, int]:
    """``sharing: mps``: (percent of the SMs, MiB of pinned memory) each client of *gpu*'s daemon gets: as
    written, else its share per replica (as NVIDIA's device plugin sets them); raises ConfigError."""
    assert policy.mps is not None and policy.replicas is not None
    threads = policy.mps.thread_percentage or round(100 / policy.replicas, 2)
    memory = policy.mps.memory_limit_mib
    if memory is None:
        if gpu.memory_mib is None:
            raise ConfigError(f"GPU {gpu.index} ({gpu.uuid}) is shared through MPS, but NVML reports no memory size "
                              "to divide among its replicas. Fix: set its mps.memory_limit (MiB, or like \"10G\")")
        memory = gpu.memory_mib // policy.replicas
    return threads, memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """Every GPU's rules: the listed entries, and the default for the rest."""

    entries: tuple[GpuPolicy, ...] = ()
    default: GpuPolicy = UNLIMITED
    #: where it was read from, for messages
    source: str = "the built-in default"

    @property
    def is_unlimited(self) -> bool:
        """True when no GPU has a limit or a capability rule (NVIDIA's behaviour everywhere)."""
        return all(p.sharing is Sharing.UNLIMITED and p.capabilities is None and p.mig is None
                   for p in (*self.entries, self.default))

    def resolve(self, gpus: Sequence[Gpu]) -> dict[int, GpuPolicy]:
        """Each host GPU's rules, by index; raises ConfigError for an entry no GPU matches or a GPU listed twice."""
        resolved: dict[int, GpuPolicy] = {}
        for entry in self.entries:
            gpu = next((g for g in gpus if names_gpu(entry.device, g)), None)
            if gpu is None:
                have = ", ".join(f"{g.index} ({g.uuid}, {g.pci_bus_id})" for g in gpus) or "none"
                raise ConfigError(f"{self.source}: device {entry.device!r} is not a GPU of this host; it has: {have}. "
                                  "Fix: name a GPU by index, UUID or PCI bus id, or remove the entry")
            if gpu.index in resolved:
                raise ConfigError(f"{self.source}: GPU {gpu.index} ({gpu.uuid}) is listed twice "
                                  f"(as {resolved[gpu.index].device!r} and {entry.device!r}); keep one entry")
            resolved[gpu.index] = entry
        return {g.index: resolved.get(g.index, self.default) for g in gpus}


#: No policy: every GPU unlimited (NVIDIA's behaviour).
NO_POLICY: Final = Policy()


def names_gpu(device: str, gpu: Gpu) -> bool:
    """Whether a policy entry's ``device`` (index, UUID or PCI bus id) is *gpu*."""
    if _INDEX_RE.fullmatch(device):
        return int(device) == gpu.index
    if device.upper().startswith("GPU-"):
        return device.casefold() == gpu.uuid.casefold()
    return _pci_key(device) == _pci_key(gpu.pci_bus_id)


def _pci_key(bus_id: str) -> tuple[int, int, int, int] | None:
    """A PCI bus id as numbers (domain, bus, device, function): NVML writes 8 domain digits, lspci 4."""
    match = _PCI_RE.fullmatch(bus_id)
    if match is None:
        return None
    return int(match[1] or "0", 16), int(match[2], 16), int(match[3], 16), int(match[4])


# --- decoding ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Keys:
    """One syntax's key names (the YAML list's or the JSON device file's)."""

    device: str
    sharing: str
    replicas: str
    capabilities: str
    mig: str
    mig_enable: str
    mig_instance: str
    mps: str
    mps_threads: str
    mps_memory: str
    mps_shm: str


YAML_KEYS: Final = _Keys("device", "sharing", "replicas", "capabilities", "mig", "enable", "instance",
                         "mps", "thread_percentage", "memory_limit", "shm_size")
FILE_KEYS: Final = _Keys("DeviceID", "Sharing", "Replicas", "Capabilities", "MIGMode", "Enable", "Instance",
                         "MPS", "ThreadPercentage", "MemoryLimit", "ShmSize")
_MEMORY_RE: Final = re.compile(r"([1-9][0-9]{0,8})([MGT])")


def decode_gpus(value: Any, *, source: str) -> Policy:
    """gpuhook.yaml's ``gpus:`` list."""
    return _decode_entries(value, YAML_KEYS, source=source, where="gpus")


def decode_device_file(value: Any, *, source: str) -> Policy:
    """The device-policy file: ``{"Devices": [{"DeviceID": ..., "Sharing": ..., ...}]}``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: expected an object with a \"Devices\" list, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k != "Devices")
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; expected only \"Devices\"")
    if "Devices" not in value:
        raise ConfigError(f"{source}: no \"Devices\" list")
    return _decode_entries(value["Devices"], FILE_KEYS, source=source, where="Devices")


def _decode_entries(value: Any, keys: _Keys, *, source: str, where: str) -> Policy:
    if not isinstance(value, list):
        raise ConfigError(f"{source}: {where} must be a list of GPU entries, got {type(value).__name__}")
    entries = [_decode_entry(item, keys, f"{source}: {where}[{n}]") for n, item in enumerate(value)]
    defaults = [e for e in entries if e.device == ALL_DEVICES]
    if len(defaults) > 1:
        raise ConfigError(f"{source}: {where} lists {keys.device} {ALL_DEVICES!r} {len(defaults)} times; keep one")
    listed = [e for e in entries if e.device != ALL_DEVICES]
    seen: dict[str, int] = {}
    for n, entry in enumerate(listed):
        key = _canonical(entry.device)
        if key in seen:
            raise ConfigError(f"{source}: {where} lists {keys.device} {entry.device!r} twice; keep one entry")
        seen[key] = n
    return Policy(entries=tuple(listed), default=defaults[0] if defaults else UNLIMITED, source=source)


def _canonical(device: str) -> str:
    """One spelling per device, so that a GPU listed twice in two spellings of one form is caught at load."""
    pci = _pci_key(device)
    return repr(pci) if pci is not None and not _INDEX_RE.fullmatch(device) else device.casefold()


def _decode_entry(item: Any, keys: _Keys, where: str) -> GpuPolicy:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where}: expected a mapping with {keys.device!r}, got {item!r}")
    known = (keys.device, keys.sharing, keys.replicas, keys.capabilities, keys.mig, keys.mps)
    unknown = sorted(str(k) for k in item if k not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    device = _device(item.get(keys.device), f"{where}.{keys.device}")
    sharing = _sharing(item.get(keys.sharing, Sharing.UNLIMITED.value), f"{where}.{keys.sharing}")
    replicas = item.get(keys.replicas)
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or not 1 <= replicas <= MAX_REPLICAS):
        raise ConfigError(f"{where}.{keys.replicas} must be a whole number from 1 to {MAX_REPLICAS}, got {replicas!r}")
    if sharing in COUNTED and replicas is None:
        raise ConfigError(f"{where}: {keys.sharing} {sharing.value!r} needs {keys.replicas}: N (how many containers "
                          "may hold the GPU at once)")
    if sharing not in COUNTED and replicas is not None:
        raise ConfigError(f"{where}: {keys.replicas} contradicts {keys.sharing} {sharing.value!r} (it limits only "
                          f"{' and '.join(repr(s.value) for s in sorted(COUNTED))}); remove it or change the sharing")
    mig = _mig(item.get(keys.mig), keys, f"{where}.{keys.mig}")
    mps = _mps(item.get(keys.mps), keys, f"{where}.{keys.mps}")
    if mps is not None and sharing is not Sharing.MPS:
        raise ConfigError(f"{where}: {keys.mps} contradicts {keys.sharing} {sharing.value!r}; set {keys.sharing}: "
                          f"mps (with {keys.replicas}) or remove it")
    if sharing is Sharing.MPS and mig is not None and mig.enable:
        raise ConfigError(f"{where}: {keys.sharing} 'mps' and {keys.mig} on one GPU: MPS runs on a whole GPU, and a "
                          "GPU in MIG mode is shared by its instances. Fix: keep one of them")
    return GpuPolicy(device=device, sharing=sharing, replicas=replicas,
                     capabilities=_capabilities(item.get(keys.capabilities), f"{where}.{keys.capabilities}"),
                     mig=mig, mps=MpsLimits() if sharing is Sharing.MPS and mps is None else mps)


def _nested(value: Any, names: tuple[str, ...], where: str) -> Mapping[str, Any] | None:
    """A nested mapping (``mig``, ``mps``) of at most the keys *names*, or None when absent."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping with {names[0]!r} and/or {names[1]!r}, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
    return value


def _mps(value: Any, keys: _Keys, where: str) -> MpsLimits | None:
    value = _nested(value, (keys.mps_threads, keys.mps_memory, keys.mps_shm), where)
    if value is None:
        return None
    threads, memory, shm = value.get(keys.mps_threads), value.get(keys.mps_memory), value.get(keys.mps_shm)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int | float)
                                or not 0 < threads <= 100):
        raise ConfigError(f"{where}.{keys.mps_threads} must be a percentage above 0 and at most 100, got {threads!r}")
    return MpsLimits(thread_percentage=None if threads is None else float(threads),
                     memory_limit_mib=None if memory is None else _mebibytes(memory, f"{where}.{keys.mps_memory}"),
                     shm_size_mib=None if shm is None else _mebibytes(shm, f"{where}.{keys.mps_shm}"))


def _mebibytes(value: Any, where: str) -> int:
    """A size (a memory limit, a tmpfs): MiB as a whole number, or ``10G`` / ``512M`` / ``1T``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = _MEMORY_RE.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise ConfigError(f"{where} must be MiB as a whole number (10240) or a size like \"10G\" or \"512M\", "
                          f"got {value!r}")
    return int(found[1]) << {"M": 0, "G": 10, "T": 20}[found[2]]


def _device(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9999:
        value = str(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        # YAML 1.1 reads an unquoted 18:00.0 (or 0000:18:00.0) as a base-60 number
        raise ConfigError(f"{where} is the number {value!r}: an unquoted PCI bus id reads as a number in YAML. "
                          'Fix: quote it, e.g. device: "0000:18:00.0"')
    if not isinstance(value, str) or not (value == ALL_DEVICES or _INDEX_RE.fullmatch(value)
                                          or _UUID_RE.fullmatch(value) or _PCI_RE.fullmatch(value)):
        raise ConfigError(f"{where} must be a GPU index (0), a GPU UUID (GPU-…), a PCI bus id (0000:18:00.0) "
                          f"or {ALL_DEVICES!r}, got {value!r}")
    return value


def _sharing(value: Any, where: str) -> Sharing:
    if not isinstance(value, str) or value not in {s.value for s in Sharing}:
        raise ConfigError(f"{where} must be one of {', '.join(s.value for s in Sharing)}, got {value!r}")
    return Sharing(value)


def _capabilities(value: Any, where: str) -> frozenset[Capability] | None:
    if value is None:
        return None
    names = {c.value for c in Capability}
    if not isinstance(value, list) or not all(isinstance(v, str) and (v in names or v == "all") for v in value):
        raise ConfigError(f"{where} must be a list of driver capabilities ({', '.join(sorted(names))}, or all), "
                          f"got {value!r}")
    return frozenset(Capability) if "all" in value else frozenset(Capability(v) for v in value)


def _mig(value: Any, keys: _Keys, where: str) -> MigMode | None:
    value = _nested(value, (keys.mig_enable, keys.mig_instance), where)
    if value is None:
        return None
    enable, instance = value.get(keys.mig_enable), value.get(keys.mig_instance)
    if not isinstance(enable, bool):
        raise ConfigError(f"{where}.{keys.mig_enable} must be true or false, got {enable!r}")
    if instance is not None and (not isinstance(instance, str) or not _PROFILE_RE.fullmatch(instance)):
        raise ConfigError(f"{where}.{keys.mig_instance} must be a GPU-instance profile as `nvidia-smi mig -lgip` "
                          f"names it (1g.10gb, 3g.40gb, 1g.10gb+me), got {instance!r}")
    if instance is not None and not enable:
        raise ConfigError(f"{where}: {keys.mig_instance} {instance!r} contradicts {keys.mig_enable}: false")
    return MigMode(enable=enable, instance=instance)
