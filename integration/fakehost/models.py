"""GPU models, per-GPU identities and the mock NVML topology file."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mig import FakeMigDevice, MigProfile

# NVML brand enum values (nvmlBrandType_t; pynvml.NVML_BRAND_*).  Kept here
# rather than imported so that building a host does not need pynvml.
NVML_BRAND_TESLA = 2
NVML_BRAND_GEFORCE = 5
NVML_BRAND_NVIDIA = 14

NVIDIA_PCI_VENDOR = 0x10DE
MIB = 1024 * 1024

# NVML bounds a device name by NVML_DEVICE_NAME_BUFFER_SIZE (64, NUL included).
MAX_MODEL_NAME = 63
# The mock NVML's fixed device table (MOCK_MAX_GPUS in mocknvml.c).
MAX_GPUS = 64

# Buses of the eight GPUs of a DGX H100; further GPUs go to further PCI
# domains, which also exercises consumers that assume domain 0.
_DGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

_VERSION_RE = re.compile(r"[0-9]+\.[0-9]+(\.[0-9]+)?")
_CUDA_RE = re.compile(r"([0-9]+)\.([0-9])")


@dataclass(frozen=True, slots=True)
class GpuModel:
    """What NVML reports for one kind of GPU."""

    name: str
    compute_capability: tuple[int, int]
    memory_mib: int
    brand: int
    pci_device: int
    pci_subsystem: int
    mig_capable: bool
    vbios: str


# Columns: name, compute capability, memory MiB (as nvidia-smi shows it), brand,
# PCI device id, PCI subsystem id, MIG capable, VBIOS version.
_DC = NVML_BRAND_TESLA  # data-centre parts report the Tesla brand
_MODELS = {
    model.name: model
    for model in (
        GpuModel("NVIDIA H100 80GB HBM3", (9, 0), 81559, _DC, 0x2330, 0x16C1, True, "96.00.99.00.01"),
        GpuModel("NVIDIA H100 PCIe", (9, 0), 81559, _DC, 0x2331, 0x1626, True, "96.00.30.00.01"),
        GpuModel("NVIDIA A100-SXM4-80GB", (8, 0), 81920, _DC, 0x20B2, 0x1463, True, "92.00.45.00.03"),
        GpuModel("NVIDIA H200", (9, 0), 143771, _DC, 0x2335, 0x18BE, True, "96.00.AF.00.01"),
        GpuModel("NVIDIA A100-SXM4-40GB", (8, 0), 40960, _DC, 0x20B0, 0x134F, True, "92.00.19.00.01"),
        GpuModel("NVIDIA A10G", (8, 6), 23028, _DC, 0x2237, 0x152F, False, "94.02.75.00.01"),
        GpuModel("NVIDIA L4", (8, 9), 23034, _DC, 0x27B8, 0x16CA, False, "95.04.29.00.06"),
        GpuModel("Tesla V100-SXM2-16GB", (7, 0), 16384, _DC, 0x1DB1, 0x1212, False, "88.00.4F.00.09"),
        GpuModel("Tesla T4", (7, 5), 15360, _DC, 0x1EB8, 0x12A2, False, "90.04.38.00.03"),
        GpuModel(
            "NVIDIA GeForce RTX 4090",
            (8, 9),
            24564,
            NVML_BRAND_GEFORCE,
            0x2684,
            0x165B,
            False,
            "95.02.18.80.5F",
        ),
    )
}

KNOWN_MODELS: tuple[str, ...] = tuple(_MODELS)


def lookup_model(name: str) -> GpuModel:
    """Returns the table entry for name, or a generic Ampere-class part."""
    known = _MODELS.get(name)
    if known is not None:
        return known
    # Unknown names still get a self-consistent, plausible device.
    return GpuModel(name, (8, 0), 16384, NVML_BRAND_NVIDIA, 0x2000, 0x0000, False, "00.00.00.00.01")


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One simulated GPU, as NVML and procfs describe it."""

    index: int
    uuid: str
    minor: int
    pci_bus_id: str  # NVML form: 00000000:18:00.0
    name: str
    compute_capability: tuple[int, int]
    memory_total: int  # bytes
    brand: int
    pci_device_id: int  # NVML form: (device << 16) | vendor
    pci_subsystem_id: int
    mig_capable: bool
    vbios: str
    mig_enabled: bool = False  # MIG mode on (create_host's mig argument)

    @property
    def proc_bus_id(self) -> str:
        """The bus id as /proc/driver/nvidia/gpus names it: 0000:18:00.0."""
        domain, rest = self.pci_bus_id.split(":", 1)
        return f"{int(domain, 16):04x}:{rest.lower()}"

    @property
    def device_path(self) -> str:
        """The device node, relative to dev_root."""
        return f"/dev/nvidia{self.minor}"


def validate_driver_version(version: str) -> str:
    """Rejects anything that is not a dotted driver version like 550.54.15."""
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"driver version must look like 550.54.15, got {version!r}")
    return version


def encode_cuda_version(version: str) -> int:
    """Encodes CUDA X.Y the way NVML does: 12.4 -> 12040."""
    match = _CUDA_RE.fullmatch(version)
    if match is None:
        raise ValueError(f"CUDA version must look like 12.4, got {version!r}")
    return int(match.group(1)) * 1000 + int(match.group(2)) * 10


def validate_model_name(name: str) -> str:
    """Keeps names that fit NVML's buffer and every text file they land in."""
    if not name or name != name.strip() or len(name) > MAX_MODEL_NAME:
        raise ValueError(f"model name must be 1-{MAX_MODEL_NAME} characters without outer blanks: {name!r}")
    if not all(" " <= ch <= "~" for ch in name):
        raise ValueError(f"model name must be printable ASCII: {name!r}")
    return name


def gpu_uuid(driver: str, index: int) -> str:
    """A stable UUID per (driver, index), formatted like NVML's."""
    digest = hashlib.sha256(f"gpuhook-fakehost:{driver}:{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def make_gpus(count: int, driver: str, model: GpuModel) -> tuple[FakeGpu, ...]:
    """Builds count identical GPUs with distinct identities; minor = index."""
    if not 1 <= count <= MAX_GPUS:
        raise ValueError(f"--gpus must be between 1 and {MAX_GPUS}, got {count}")
    gpus = []
    for index in range(count):
        domain, bus = divmod(index, len(_DGX_BUSES))
        gpus.append(
            FakeGpu(
                index=index,
                uuid=gpu_uuid(driver, index),
                minor=index,
                pci_bus_id=f"{domain:08X}:{_DGX_BUSES[bus]:02X}:00.0",
                name=model.name,
                compute_capability=model.compute_capability,
                memory_total=model.memory_mib * MIB,
                brand=model.brand,
                pci_device_id=(model.pci_device << 16) | NVIDIA_PCI_VENDOR,
                pci_subsystem_id=(model.pci_subsystem << 16) | NVIDIA_PCI_VENDOR,
                mig_capable=model.mig_capable,
                vbios=model.vbios,
            )
        )
    return tuple(gpus)


def nvml_version(driver: str) -> str:
    """NVML's own version string: the NVML major, then the driver version."""
    return f"12.{driver}"


def _mig_state(gpu: FakeGpu) -> str:
    """The topology's mig column: MIG not supported, supported but off, or on."""
    if gpu.mig_enabled:
        return "enabled"
    return "disabled" if gpu.mig_capable else "none"


def _mig_records(gpu: FakeGpu, driver: str, mig_devices: tuple[FakeMigDevice, ...]) -> list[str]:
    """A MIG-capable GPU's profile table and, in MIG mode, its admin-made placements and MIG device UUIDs.

    The mock NVML creates and destroys instances from these (mig.py's tables
    are the one source), so it never computes a profile or a UUID itself.
    """
    from .mig import MAX_COMPUTE_INSTANCES, MAX_GPU_INSTANCES, MIG_PROFILES, mig_uuid

    profiles: tuple[MigProfile, ...] = MIG_PROFILES.get(gpu.name, ())
    lines = [
        f"giprofile {gpu.index} {p.index} {p.profile_id} {p.slices} {p.memory_slices} {p.instances} {p.memory_mib}"
        f" {p.sms} {p.copy_engines} {p.decoders} {p.encoders} {p.jpegs} {p.ofas}"
        f" {','.join(map(str, p.starts))} {p.name}"
        for p in profiles
    ]
    if not gpu.mig_enabled or not profiles:
        return lines
    lines += [
        f"migplacement {gpu.index} {mig.gi} {mig.profile_index} {mig.placement_start}"
        for mig in mig_devices
        if mig.parent_index == gpu.index and mig.placement_start >= 0
    ]
    lines += [
        f"miguuid {gpu.index} {gi} {ci} {mig_uuid(driver, gpu.index, gi, ci)}"
        for gi in range(MAX_GPU_INSTANCES)
        for ci in range(MAX_COMPUTE_INSTANCES)
    ]
    return lines


def render_topology(
    driver: str, cuda: str, gpus: tuple[FakeGpu, ...], mig_devices: tuple[FakeMigDevice, ...] = ()
) -> str:
    """The topology file mocknvml.c parses (format documented there)."""
    lines = [
        "mock-nvml-topology 1",
        "# Read by libnvidia-ml (integration/fakehost/mocknvml.c).  gpu columns:",
        "# index minor uuid bus-id pci-device-id pci-subsystem-id cc memory-bytes",
        "#   brand mig(none|disabled|enabled) persistence(0|1) name...",
        "# mig columns (after their GPU, in creation order):",
        "# gpu-index index-on-gpu gpu-instance-id compute-instance-id uuid memory-bytes name...",
        f"driver {driver}",
        f"nvml {nvml_version(driver)}",
        f"cuda {encode_cuda_version(cuda)}",
    ]
    for gpu in gpus:
        major, minor = gpu.compute_capability
        lines.append(
            f"gpu {gpu.index} {gpu.minor} {gpu.uuid} {gpu.pci_bus_id} 0x{gpu.pci_device_id:08x}"
            f" 0x{gpu.pci_subsystem_id:08x} {major}.{minor} {gpu.memory_total} {gpu.brand}"
            f" {_mig_state(gpu)} 1 {gpu.name}"
        )
        lines += [
            f"mig {mig.parent_index} {mig.index} {mig.gi} {mig.ci} {mig.uuid} {mig.memory_total} {mig.name}"
            for mig in mig_devices
            if mig.parent_index == gpu.index
        ]
        lines += _mig_records(gpu, driver, mig_devices)
    return "\n".join(lines) + "\n"
