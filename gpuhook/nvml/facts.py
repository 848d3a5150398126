"""What NVML says about the driver and the GPUs, read once per driver identity (discovery caches it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Gpu, MigDevice
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
        for index in range(_call(pynvml.nvmlDeviceGetCount)):
            handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
            migs += _mig_devices(index, handle)
            major, minor = _call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            gpus.append(Gpu(
                index=index,
                uuid=_text(_call(pynvml.nvmlDeviceGetUUID, handle)),
                minor=_call(pynvml.nvmlDeviceGetMinorNumber, handle),
                pci_bus_id=_text(_call(pynvml.nvmlDeviceGetPciInfo, handle).busId),
                model=_text(_call(pynvml.nvmlDeviceGetName, handle)),
                brand=brands.get(_call(pynvml.nvmlDeviceGetBrand, handle), "Unknown"),
                arch=f"{major}.{minor}",
                health=_health(handle),
                persistence=_persistence(handle),
            ))
        return NvmlFacts(
            driver_version=_text(_call(pynvml.nvmlSystemGetDriverVersion)),
            # nvmlSystemGetCudaDriverVersion encodes 12.4 as 12040.
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpus=tuple(gpus),
            mig_devices=tuple(migs),
        )


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


def _mig_devices(parent_index: int, handle: Any) -> list[MigDevice]:
    """The MIG devices of one GPU, in NVML's enumeration order (none when MIG is off or unsupported)."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except _ABSENT:
        return []
    except pynvml.NVMLError as err:
        raise DiscoveryError(f"NVML nvmlDeviceGetMigMode failed for GPU {parent_index}: {err}") from err
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
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
        found.append(MigDevice(
            parent_index=parent_index, index=len(found), uuid=_text(_call(pynvml.nvmlDeviceGetUUID, mig)),
            gi=_call(pynvml.nvmlDeviceGetGpuInstanceId, mig), ci=_call(pynvml.nvmlDeviceGetComputeInstanceId, mig),
            name=_text(_call(pynvml.nvmlDeviceGetName, mig)),
        ))
    return found
