"""MIG on the simulated host: profiles per model, GPU instance layout, capability minors.

A MIG-enabled GPU is split into GPU instances (GIs) of 1, 2, 3, 4 or 7 of its
7 compute slices (and some of its 8 memory slices); each GI here holds one
compute instance (CI 0), and each such pair is one MIG device with its own
MIG-... UUID.  Access to a GI or CI is granted through the nvidia-caps
character devices, whose minors the driver publishes in
/proc/driver/nvidia-caps/mig-minors.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .models import MIB, FakeGpu

COMPUTE_SLICES = 7
MEMORY_SLICES = 8
# nvmlDeviceGetMaxMigDeviceCount on a MIG-enabled GPU.
MAX_MIG_DEVICES = COMPUTE_SLICES
# The driver reserves capabilities for 15 GPU instances of 8 compute instances each.
MAX_GPU_INSTANCES = 15
MAX_COMPUTE_INSTANCES = 8
# The driver's mig-minors table always covers NV_MAX_DEVICES GPUs.
DRIVER_MAX_GPUS = 32

CONFIG_MINOR = 1
MONITOR_MINOR = 2
_FIRST_GPU_MINOR = 3
_MINORS_PER_GI = 1 + MAX_COMPUTE_INSTANCES
_MINORS_PER_GPU = MAX_GPU_INSTANCES * _MINORS_PER_GI

# DeviceFileMode of the capability files (and so of the /dev/nvidia-caps
# nodes): mig/config is root-only, everything else is world-readable.
CONFIG_MODE = 0o400
ACCESS_MODE = 0o444

# GPU instance ids the driver hands out, by compute slices: 7g is 0, 4g is 1,
# 3g are 1-2, 2g are 3-6 and 1g are 7-14, the lowest free one first.
_GI_IDS = {
    7: (0,),
    4: (1,),
    3: (1, 2),
    2: (3, 4, 5, 6),
    1: tuple(range(7, 15)),
}

_PROFILE_RE = re.compile(r"([0-9]+)g\.([0-9]+)gb(\+me)?")
_CI_PROFILE_RE = re.compile(r"[0-9]+c\.[0-9]+g\.[0-9]+gb")


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile, e.g. 3g.40gb: 3 compute and 4 memory slices."""

    name: str
    slices: int
    memory_slices: int
    media: bool  # +me: the instance also gets the media engines (one per GPU)


def _profiles(slice_gb: int, *names: str) -> tuple[MigProfile, ...]:
    """Tabulates profiles for a GPU whose memory slices hold slice_gb GB each."""
    table = []
    for name in names:
        match = _PROFILE_RE.fullmatch(name)
        assert match is not None, name
        slices, gb = int(match.group(1)), int(match.group(2))
        table.append(MigProfile(name, slices, gb // slice_gb, match.group(3) is not None))
    return tuple(table)


_PROFILES_80GB = _profiles(10, "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
_PROFILES_40GB = _profiles(5, "1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")

# The GPU instance profiles nvidia-smi mig -lgip lists, per model.
MIG_PROFILES: dict[str, tuple[MigProfile, ...]] = {
    "NVIDIA H100 80GB HBM3": _PROFILES_80GB,
    "NVIDIA H100 PCIe": _PROFILES_80GB,
    "NVIDIA A100-SXM4-80GB": _PROFILES_80GB,
    "NVIDIA A100-SXM4-40GB": _PROFILES_40GB,
}


@dataclass(frozen=True, slots=True)
class FakeMigDevice:
    """One MIG device: a GPU instance with its one compute instance."""

    parent_index: int  # the GPU's NVML index
    index: int  # on the parent, in creation order (nvmlDeviceGetMigDeviceHandleByIndex)
    uuid: str  # MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    gi: int  # GPU instance id
    ci: int  # compute instance id
    profile: str  # e.g. 1g.10gb
    gi_cap_minor: int  # /dev/nvidia-caps/nvidia-cap<minor> granting the GI
    ci_cap_minor: int  # ... and the CI
    parent_minor: int  # the GPU's device minor, which names it in capability paths
    name: str  # as NVML reports it: "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    memory_total: int  # bytes

    @property
    def gi_cap(self) -> str:
        """The GI's name in mig-minors, e.g. gpu0/gi7/access."""
        return f"gpu{self.parent_minor}/gi{self.gi}/access"

    @property
    def ci_cap(self) -> str:
        """The CI's name in mig-minors, e.g. gpu0/gi7/ci0/access."""
        return f"gpu{self.parent_minor}/gi{self.gi}/ci{self.ci}/access"

    @property
    def gi_proc_path(self) -> str:
        """The GI's file under /proc/driver/nvidia/capabilities."""
        return f"gpu{self.parent_minor}/mig/gi{self.gi}/access"

    @property
    def ci_proc_path(self) -> str:
        """The CI's file under /proc/driver/nvidia/capabilities."""
        return f"gpu{self.parent_minor}/mig/gi{self.gi}/ci{self.ci}/access"


def gi_minor(gpu_minor: int, gi: int) -> int:
    """The nvidia-caps minor of gpu<gpu_minor>/gi<gi>/access."""
    return _FIRST_GPU_MINOR + gpu_minor * _MINORS_PER_GPU + gi * _MINORS_PER_GI


def ci_minor(gpu_minor: int, gi: int, ci: int) -> int:
    """The nvidia-caps minor of gpu<gpu_minor>/gi<gi>/ci<ci>/access."""
    return gi_minor(gpu_minor, gi) + 1 + ci


def mig_minors(gpu_count: int) -> str:
    """/proc/driver/nvidia-caps/mig-minors: every capability the driver can grant.

    The driver lists NV_MAX_DEVICES (32) GPUs whatever is installed; a
    simulated host with more GPUs gets rows for all of them.
    """
    lines = [f"config {CONFIG_MINOR}", f"monitor {MONITOR_MINOR}"]
    for gpu in range(max(DRIVER_MAX_GPUS, gpu_count)):
        for gi in range(MAX_GPU_INSTANCES):
            lines.append(f"gpu{gpu}/gi{gi}/access {gi_minor(gpu, gi)}")
            lines += [f"gpu{gpu}/gi{gi}/ci{ci}/access {ci_minor(gpu, gi, ci)}" for ci in range(MAX_COMPUTE_INSTANCES)]
    return "\n".join(lines) + "\n"


def capability_file(minor: int, mode: int) -> str:
    """A /proc/driver/nvidia/capabilities file (nv-caps.c: nv_cap_procfs_read)."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def mig_uuid(driver: str, gpu_index: int, gi: int, ci: int) -> str:
    """A stable MIG device UUID per (driver, GPU, GI, CI), formatted like NVML's."""
    digest = hashlib.sha256(f"gpuhook-fakehost-mig:{driver}:{gpu_index}:{gi}:{ci}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _model_profiles(gpu: FakeGpu) -> tuple[MigProfile, ...]:
    """The MIG profiles of gpu's model, or a ValueError if it has none."""
    table = MIG_PROFILES.get(gpu.name)
    if table is None:
        raise ValueError(
            f"GPU {gpu.index} ({gpu.name}) has no MIG profiles; MIG-capable models: {', '.join(MIG_PROFILES)}"
        )
    return table


def _lookup_profile(gpu: FakeGpu, name: str) -> MigProfile:
    """The profile called name on gpu's model, or a ValueError that says what exists."""
    table = _model_profiles(gpu)
    if _CI_PROFILE_RE.fullmatch(name):
        raise ValueError(
            f"{name!r} is a compute instance profile; only GPU instance profiles (one compute instance each) "
            "are simulated"
        )
    for profile in table:
        if profile.name == name:
            return profile
    known = ", ".join(profile.name for profile in table)
    raise ValueError(f"{gpu.name} has no MIG profile {name!r}; its profiles are {known}")


def _layout(gpu: FakeGpu, names: Sequence[str]) -> list[tuple[MigProfile, int]]:
    """Places the profiles in order: (profile, GPU instance id) each, or a ValueError."""
    profiles = [_lookup_profile(gpu, name) for name in names]
    where = f"MIG layout {','.join(names)} on GPU {gpu.index} ({gpu.name})"
    slices = sum(profile.slices for profile in profiles)
    if slices > COMPUTE_SLICES:
        raise ValueError(f"{where} needs {slices} compute slices; a GPU has {COMPUTE_SLICES}")
    memory = sum(profile.memory_slices for profile in profiles)
    if memory > MEMORY_SLICES:
        raise ValueError(f"{where} needs {memory} memory slices; a GPU has {MEMORY_SLICES}")
    if sum(profile.media for profile in profiles) > 1:
        raise ValueError(f"{where} has more than one +me profile; a GPU has one set of media engines")
    placed: list[tuple[MigProfile, int]] = []
    taken: set[int] = set()
    for profile in profiles:
        free = [gi for gi in _GI_IDS[profile.slices] if gi not in taken]
        if not free:
            holders = ", ".join(f"{p.name} (gi {gi})" for p, gi in placed if gi in _GI_IDS[profile.slices])
            raise ValueError(
                f"{where} does not fit: no GPU instance id is left for {profile.name} after {holders}; "
                "list larger profiles first"
            )
        taken.add(free[0])
        placed.append((profile, free[0]))
    return placed


def make_mig_devices(
    gpus: tuple[FakeGpu, ...], layouts: Mapping[int, Sequence[str]], driver: str
) -> tuple[FakeMigDevice, ...]:
    """The MIG devices of every GPU in layouts (GPU index -> profile names), GPU by GPU."""
    devices = []
    for index in sorted(layouts):
        if not 0 <= index < len(gpus):
            raise ValueError(f"--mig names GPU {index}, but the host has GPUs 0-{len(gpus) - 1}")
        gpu = gpus[index]
        # Only GPUs with MIG profiles can be put in MIG mode, even with no instances.
        _model_profiles(gpu)
        for position, (profile, gi) in enumerate(_layout(gpu, layouts[index])):
            ci = 0
            devices.append(
                FakeMigDevice(
                    parent_index=gpu.index,
                    index=position,
                    uuid=mig_uuid(driver, gpu.index, gi, ci),
                    gi=gi,
                    ci=ci,
                    profile=profile.name,
                    gi_cap_minor=gi_minor(gpu.minor, gi),
                    ci_cap_minor=ci_minor(gpu.minor, gi, ci),
                    parent_minor=gpu.minor,
                    name=f"{gpu.name} MIG {profile.name}",
                    memory_total=_memory_mib(gpu, profile) * MIB,
                )
            )
    return tuple(devices)


def _memory_mib(gpu: FakeGpu, profile: MigProfile) -> int:
    """A MIG device's memory: its share of the GPU's, in the driver's 256 MiB steps."""
    share = gpu.memory_total // MIB * profile.memory_slices // MEMORY_SLICES
    return share // 256 * 256


def normalise_layouts(mig: Mapping[int, Sequence[str] | str] | None) -> dict[int, tuple[str, ...]]:
    """create_host's mig argument as GPU index -> profile names; a string is comma-separated."""
    layouts: dict[int, tuple[str, ...]] = {}
    for index, profiles in (mig or {}).items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"mig keys are GPU indices, got {index!r}")
        names: Iterable[str] = profiles.split(",") if isinstance(profiles, str) else profiles
        layouts[index] = tuple(names)
    return layouts
