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

_CI_PROFILE_RE = re.compile(r"[0-9]+c\.[0-9]+g\.[0-9]+gb")


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile as NVML describes it (nvmlGpuInstanceProfileInfo_v2_t) and where it may go.

    The mock NVML reads these through the topology's giprofile records, so
    this table is the one source of truth for both sides.
    """

    name: str  # as nvidia-smi mig -lgip shows it, without "MIG "
    slices: int  # compute slices (sliceCount)
    memory_slices: int  # of the GPU's 8; also the placement size
    media: bool  # +me: the instance also gets the media engines (one set per GPU)
    index: int = 0  # NVML_GPU_INSTANCE_PROFILE_* (what nvmlDeviceGetGpuInstanceProfileInfo takes)
    profile_id: int = 0  # the driver's profile id (info.id; nvidia-smi's ID column; what create takes)
    instances: int = 0  # instanceCount: how many fit on an empty GPU
    memory_mib: int = 0  # memorySizeMB
    sms: int = 0  # multiprocessorCount
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0
    starts: tuple[int, ...] = ()  # legal placement starts, in memory slices (nvidia-smi mig -lgipp)


# NVML_GPU_INSTANCE_PROFILE_* (nvml.h / pynvml).
GI_1_SLICE, GI_2_SLICE, GI_3_SLICE, GI_4_SLICE, GI_7_SLICE = 0, 1, 2, 3, 4
GI_1_SLICE_REV1 = 7  # 1g with the media engines (+me)
GI_1_SLICE_REV2 = 9  # 1g with twice the memory
# The driver's profile ids, the same on every MIG GPU so far (nvidia-smi mig -lgip's ID column).
_IDS = {GI_1_SLICE: 19, GI_1_SLICE_REV1: 20, GI_1_SLICE_REV2: 15, GI_2_SLICE: 14, GI_3_SLICE: 9, GI_4_SLICE: 5,
        GI_7_SLICE: 0}
# Legal placements ({start}:size in memory slices), from NVIDIA's MIG user guide ("A100 MIG profiles",
# "H100 MIG profiles" and the nvidia-smi mig -lgipp listings there): 1g {0..6}:1, 1g with double
# memory {0,2,4,6}:2, 2g {0,2,4}:2, 3g {0,4}:4, 4g {0}:4, 7g {0}:8.
_STARTS = {GI_1_SLICE: tuple(range(7)), GI_1_SLICE_REV1: tuple(range(7)), GI_1_SLICE_REV2: (0, 2, 4, 6),
           GI_2_SLICE: (0, 2, 4), GI_3_SLICE: (0, 4), GI_4_SLICE: (0,), GI_7_SLICE: (0,)}
_SHAPE = {  # index: (compute slices, memory slices, instances)
    GI_1_SLICE: (1, 1, 7), GI_1_SLICE_REV1: (1, 1, 1), GI_1_SLICE_REV2: (1, 2, 4), GI_2_SLICE: (2, 2, 3),
    GI_3_SLICE: (3, 4, 2), GI_4_SLICE: (4, 4, 1), GI_7_SLICE: (7, 8, 1),
}
_ORDER = (GI_1_SLICE, GI_1_SLICE_REV1, GI_1_SLICE_REV2, GI_2_SLICE, GI_3_SLICE, GI_4_SLICE, GI_7_SLICE)
_Row = tuple[str, int, int, int, int, int, int, int]


def _table(*rows: _Row) -> tuple[MigProfile, ...]:
    """One model's profiles from (name, memory MiB, SMs, CE, DEC, ENC, JPEG, OFA) rows in -lgip order."""
    table = []
    for index, (name, memory, sms, ce, dec, enc, jpeg, ofa) in zip(_ORDER, rows, strict=True):
        slices, memory_slices, instances = _SHAPE[index]
        table.append(MigProfile(name, slices, memory_slices, name.endswith("+me"), index, _IDS[index], instances,
                                memory, sms, ce, dec, enc, jpeg, ofa, _STARTS[index]))
    return tuple(table)


# Memory (nvidia-smi mig -lgip's GiB is memorySizeMB / 1024), SMs and engines per profile.
# A100 40GB and 80GB: NVIDIA's MIG user guide, "A100 MIG profiles" and its -lgip listings.
_PROFILES_A100_40GB = _table(
    ("1g.5gb", 4864, 14, 1, 0, 0, 0, 0), ("1g.5gb+me", 4864, 14, 1, 1, 0, 1, 1),
    ("1g.10gb", 9856, 14, 1, 1, 0, 0, 0), ("2g.10gb", 9856, 28, 2, 1, 0, 0, 0),
    ("3g.20gb", 19968, 42, 3, 2, 0, 0, 0), ("4g.20gb", 19968, 56, 4, 2, 0, 0, 0),
    ("7g.40gb", 40192, 98, 7, 5, 0, 1, 1),
)
_PROFILES_A100_80GB = _table(
    ("1g.10gb", 9728, 14, 1, 0, 0, 0, 0), ("1g.10gb+me", 9728, 14, 1, 1, 0, 1, 1),
    ("1g.20gb", 19968, 14, 1, 1, 0, 0, 0), ("2g.20gb", 19968, 28, 2, 1, 0, 0, 0),
    ("3g.40gb", 40192, 42, 3, 2, 0, 0, 0), ("4g.40gb", 40192, 56, 4, 2, 0, 0, 0),
    ("7g.80gb", 81152, 98, 7, 5, 0, 1, 1),
)
# H100 80GB HBM3: its published nvidia-smi mig -lgip listing.  The H100 PCIe (114 SMs) has the same
# memory layout; its SM counts are not tabulated separately here.
_PROFILES_H100_80GB = _table(
    ("1g.10gb", 9984, 16, 1, 1, 0, 1, 0), ("1g.10gb+me", 9984, 16, 1, 1, 0, 1, 1),
    ("1g.20gb", 20096, 26, 1, 1, 0, 1, 0), ("2g.20gb", 20096, 32, 2, 2, 0, 2, 0),
    ("3g.40gb", 40448, 60, 3, 3, 0, 3, 0), ("4g.40gb", 40448, 64, 4, 4, 0, 4, 0),
    ("7g.80gb", 81152, 132, 8, 7, 0, 7, 1),
)
# H200 141GB: names and shapes from NVIDIA's MIG user guide ("H200 MIG profiles"); the memory sizes are
# the H100's scaled to the H200's 143771 MiB (not checked against a real H200's -lgip listing).
_PROFILES_H200 = _table(
    ("1g.18gb", 17536, 16, 1, 1, 0, 1, 0), ("1g.18gb+me", 17536, 16, 1, 1, 0, 1, 1),
    ("1g.35gb", 35328, 26, 1, 1, 0, 1, 0), ("2g.35gb", 35328, 32, 2, 2, 0, 2, 0),
    ("3g.71gb", 71296, 60, 3, 3, 0, 3, 0), ("4g.71gb", 71296, 64, 4, 4, 0, 4, 0),
    ("7g.141gb", 143040, 132, 8, 7, 0, 7, 1),
)

# The GPU instance profiles nvidia-smi mig -lgip lists, per model.
MIG_PROFILES: dict[str, tuple[MigProfile, ...]] = {
    "NVIDIA H100 80GB HBM3": _PROFILES_H100_80GB,
    "NVIDIA H100 PCIe": _PROFILES_H100_80GB,
    "NVIDIA A100-SXM4-80GB": _PROFILES_A100_80GB,
    "NVIDIA A100-SXM4-40GB": _PROFILES_A100_40GB,
    "NVIDIA H200": _PROFILES_H200,
}


def swizzle_gi_id(start: int, size: int) -> int:
    """The GPU instance id the driver gives a placement: its node in the binary tree of the 8 memory slices.

    The whole GPU is 0, halves 1-2, quarters 3-6, eighths 7-14 (the driver's
    "swizzle id"); mocknvml.c's gi_id_of() computes the same.
    """
    return {8: 0, 4: 1, 2: 3, 1: 7}[size] + start // size


def first_free_start(profile: MigProfile, taken: int) -> int | None:
    """The lowest legal start of profile whose memory slices are free in the taken bitmask."""
    mask = (1 << profile.memory_slices) - 1
    return next((start for start in profile.starts if not taken & (mask << start)), None)


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
    # Where the GI sits (start memory slice; the size is its profile's) and its
    # NVML_GPU_INSTANCE_PROFILE_* index, so the mock NVML can tell which
    # placements are still free; -1 where no legal placement holds the layout.
    placement_start: int = -1
    profile_index: int = -1

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
        placed = _layout(gpu, layouts[index])
        starts = _placements([profile for profile, _gi in placed])
        for position, (profile, gi) in enumerate(placed):
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
                    placement_start=-1 if starts is None else starts[position],
                    profile_index=profile.index,
                )
            )
    return tuple(devices)


def _placements(profiles: Sequence[MigProfile]) -> list[int] | None:
    """Legal, non-overlapping placement starts for the profiles (in order), or None if there are none.

    An admin can create instances in any order and choose placements, so any
    assignment that fits is the layout; the search is tiny (at most 7 GIs).
    """

    def place(at: int, taken: int) -> list[int] | None:
        if at == len(profiles):
            return []
        profile = profiles[at]
        mask = (1 << profile.memory_slices) - 1
        for start in profile.starts:
            if not taken & (mask << start):
                rest = place(at + 1, taken | mask << start)
                if rest is not None:
                    return [start, *rest]
        return None

    return place(0, 0)


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
