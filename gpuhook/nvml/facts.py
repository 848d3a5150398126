"""What NVML says about the driver and the GPUs, read once per driver identity (discovery caches it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Gpu, MigDevice, MigProfile
from gpuhook.nvml.session import ABSENT as _ABSENT
from gpuhook.nvml.session import call as _call
from gpuhook.nvml.session import session as _session
from gpuhook.nvml.session import text as _text


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmlFacts:
    """What NVML says about the driver and the GPUs."""

    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...]
    mig_devices: tuple[MigDevice, ...] = ()


def _brand_names() -> dict[int, str]:
    """NVML brand enum values to names (NVML_BRAND_TESLA → "Tesla")."""
    out = {}
    for name in dir(pynvml):
        if name.startswith("NVML_BRAND_") and name != "NVML_BRAND_COUNT":
            out[getattr(pynvml, name)] = name.removeprefix("NVML_BRAND_").title().replace("_", "")
    return out


def read_nvml(library: Path) -> NvmlFacts:
    """Driver and CUDA versions and every GPU, from the NVML at *library*."""
    try:
        return _read_nvml(library)
    except pynvml.NVMLError as err:  # anything not already translated below
        raise DiscoveryError(f"NVML at {library} failed: {err}") from err


def _read_nvml(library: Path) -> NvmlFacts:
    """read_nvml's body."""
    with _session(library):
        cuda = _call(pynvml.nvmlSystemGetCudaDriverVersion)
        brands = _brand_names()
        gpus = []
        migs: list[MigDevice] = []
        profiles: dict[tuple[str, bool], tuple[MigProfile, ...]] = {}  # by (model, MIG mode): asked once
        for index in range(_call(pynvml.nvmlDeviceGetCount)):
            handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
            model = _text(_call(pynvml.nvmlDeviceGetName, handle))
            mig = _mig(index, handle, model, profiles)
            migs += mig.devices
            major, minor = _call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            gpus.append(Gpu(
                index=index,
                uuid=_text(_call(pynvml.nvmlDeviceGetUUID, handle)),
                minor=_call(pynvml.nvmlDeviceGetMinorNumber, handle),
                pci_bus_id=_text(_call(pynvml.nvmlDeviceGetPciInfo, handle).busId),
                model=model,
                brand=brands.get(_call(pynvml.nvmlDeviceGetBrand, handle), "Unknown"),
                arch=f"{major}.{minor}",
                health=_health(handle),
                persistence=_persistence(handle),
                memory_mib=_memory_mib(handle),
                mig_enabled=mig.enabled,
                mig_profiles=mig.profiles,
            ))
        return NvmlFacts(
            driver_version=_text(_call(pynvml.nvmlSystemGetDriverVersion)),
            # nvmlSystemGetCudaDriverVersion encodes 12.4 as 12040.
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpus=tuple(gpus),
            mig_devices=tuple(migs),
        )


def _memory_mib(handle: Any) -> int | None:
    """Total device memory in MiB, or None where NVML does not report it."""
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) >> 20
    except _ABSENT:
        return None


def _persistence(handle: Any) -> bool | None:
    """Persistence mode, or None where NVML does not report it."""
    try:
        return bool(pynvml.nvmlDeviceGetPersistenceMode(handle) == pynvml.NVML_FEATURE_ENABLED)
    except _ABSENT:
        return None


def _health(handle: Any) -> tuple[str, ...]:
    """What NVML says is wrong with a GPU's memory (features a GPU lacks are simply not reported)."""
    problems = []
    try:
        if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == pynvml.NVML_FEATURE_ENABLED:
            problems.append("retired memory pages are pending (they apply at the next GPU reset or reboot)")
    except _ABSENT:
        pass
    try:
        _corrected, _uncorrected, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
    except _ABSENT:
        return tuple(problems)
    if failed:
        problems.append("memory row remapping failed (the GPU needs service)")
    elif pending:
        problems.append("memory row remapping is pending (reset the GPU to apply it)")
    return tuple(problems)


@dataclass(frozen=True, slots=True)
class _Mig:
    """What NVML says about one GPU's MIG: its mode, its GPU-instance profiles and its MIG devices."""

    enabled: bool = False
    profiles: tuple[MigProfile, ...] = ()
    devices: tuple[MigDevice, ...] = ()


#: Profile indices a GPU does not have (NVML_GPU_INSTANCE_PROFILE_6_SLICE on an A100, say): skipped.
_NO_SUCH_PROFILE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_NotFound)
#: A MIG device's name ends in its profile: "NVIDIA A100-SXM4-40GB MIG 3g.20gb" (a compute instance smaller
#: than its GPU instance: "... MIG 1c.3g.20gb").
_MIG_NAME_PROFILE = re.compile(r" MIG (?:[0-9]+c\.)?(?P<profile>[0-9]+g\.\S+)$")


def _mig(parent_index: int, handle: Any, model: str, known: dict[tuple[str, bool], tuple[MigProfile, ...]]) -> _Mig:
    """One GPU's MIG facts (nothing for a GPU without MIG; profiles but no devices when MIG is off).

    GPUs of one model in one MIG mode have one profile table: *known* keeps
    those already read, so eight H100s cost one table's calls, not eight.
    """
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except _ABSENT:
        return _Mig()
    except pynvml.NVMLError as err:
        raise DiscoveryError(f"NVML nvmlDeviceGetMigMode failed for GPU {parent_index}: {err}") from err
    enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
    if (model, enabled) not in known:
        known[model, enabled] = gi_profiles(parent_index, handle)
    profiles = known[model, enabled]
    if not enabled:
        return _Mig(profiles=profiles)
    return _Mig(enabled=True, profiles=profiles, devices=_mig_devices(parent_index, handle, profiles))


def gi_profiles(parent_index: int, handle: Any) -> tuple[MigProfile, ...]:
    """The GPU-instance profiles of a MIG-capable GPU, in NVML's profile-index order (as nvidia-smi mig -lgip).

    NVML answers with MIG mode off too (go-nvlib's VisitMigProfiles asks any
    GPU whose MIG mode reads). The versioned call is the one with the name.
    """
    found = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except _NO_SUCH_PROFILE:
            continue
        except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NoPermission):
            return ()  # a driver older than the versioned call, or an unprivileged `gpuhook info`: not known
        except pynvml.NVMLError as err:
            raise DiscoveryError(
                f"NVML nvmlDeviceGetGpuInstanceProfileInfo failed for GPU {parent_index}: {err}"
            ) from err
        name = _text(getattr(info, "name", b"")).removeprefix("MIG ")
        if name:  # a profile without a name cannot be asked for
            found.append(MigProfile(name=name, profile_id=info.id, slices=info.sliceCount,
                                    memory_mib=info.memorySizeMB, instances=info.instanceCount))
    return tuple(found)


def _mig_devices(parent_index: int, handle: Any, profiles: tuple[MigProfile, ...]) -> tuple[MigDevice, ...]:
    """The MIG devices of a GPU in MIG mode, in NVML's enumeration order."""
    by_id = {p.profile_id: p.name for p in profiles}
    profile_of: dict[int, str] = {}  # GI id -> profile name: the compute instances of one GI ask once
    found: list[MigDevice] = []
    for slot in range(_call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue  # an empty slot
        except pynvml.NVMLError as err:
            raise DiscoveryError(
                f"NVML nvmlDeviceGetMigDeviceHandleByIndex failed for GPU {parent_index}: {err}"
            ) from err
        gi = _call(pynvml.nvmlDeviceGetGpuInstanceId, mig)
        name = _text(_call(pynvml.nvmlDeviceGetName, mig))
        if gi not in profile_of:
            profile_of[gi] = _gi_profile_name(handle, gi, by_id) or _profile_from_name(name)
        found.append(MigDevice(
            parent_index=parent_index, index=len(found), uuid=_text(_call(pynvml.nvmlDeviceGetUUID, mig)),
            gi=gi, ci=_call(pynvml.nvmlDeviceGetComputeInstanceId, mig), name=name, profile=profile_of[gi],
        ))
    return tuple(found)


def _gi_profile_name(handle: Any, gi: int, by_id: dict[int, str]) -> str:
    """The profile name of GPU instance *gi*, as NVML says it ("" when it does not)."""
    if not by_id:
        return ""
    try:
        info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(handle, gi))
    except pynvml.NVMLError:
        return ""  # the device's name still says it
    return by_id.get(info.profileId, "")


def _profile_from_name(name: str) -> str:
    """The GPU-instance profile at the end of a MIG device's name, or ""."""
    match = _MIG_NAME_PROFILE.search(name)
    return match["profile"] if match else ""


def running_processes(library: Path) -> tuple[tuple[int, int, int], ...]:
    """(GPU index, pid, used bytes) of every process with a context on a GPU (compute and graphics), as NVML
    lists them now; a GPU whose driver does not say lists none. For the metrics side only: never on a start."""
    with _session(library):
        found: dict[tuple[int, int], int] = {}
        for index in range(_call(pynvml.nvmlDeviceGetCount)):
            handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
            for lister in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    processes = lister(handle)
                except (*_ABSENT, pynvml.NVMLError_NoPermission):
                    continue
                for process in processes:
                    used = process.usedGpuMemory if isinstance(process.usedGpuMemory, int) else 0
                    found[(index, process.pid)] = max(found.get((index, process.pid), 0), used)
        return tuple((index, pid, used) for (index, pid), used in sorted(found.items()))
