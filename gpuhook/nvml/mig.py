"""MIG instances through NVML, inside a ``session``: a GPU's MIG mode, its GPU instances, make and destroy.

A MIG device is a compute instance (CI) of a GPU instance (GI). gpuhook makes one GI of the
asked profile at a placement it chose (so that a record written before the call can find it
after a crash) and one CI spanning the whole GI, as ``nvidia-smi mig -cgi P -C`` does; it
destroys the CIs first, then the GI, as the driver requires. Mutations need root (the driver's
``mig/config`` capability).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pynvml

from gpuhook.errors import ProvisionError
from gpuhook.inventory import MigProfile
from gpuhook.nvml.session import ABSENT, text

#: The compute-instance profile that spans a GI of N compute slices.
_FULL_CI: dict[int, int] = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE, 7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}
#: CI ids a GI can hold (the driver's limit is 8 per GI), GIs a GPU can hold (15 ids).
_MAX_CI = 8
_MAX_GI = 15
#: Answers that mean "there is no such thing here" rather than a failure.
_NONE_HERE = (*ABSENT, pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInstance:
    """A GI that exists: its id, profile and placement."""

    gi: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Made:
    """A MIG device gpuhook made: its GI, its one CI and its UUID."""

    gi: int
    ci: int
    uuid: str


def gpu(uuid: str) -> Any:
    """The handle of the GPU with *uuid* (a UUID, not an index: indices can move with a reset)."""
    return _nvml(pynvml.nvmlDeviceGetHandleByUUID, uuid)


def mig_enabled(handle: Any) -> bool:
    """Whether MIG mode is on now (False on a GPU without MIG)."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except ABSENT:
        return False
    except pynvml.NVMLError as err:
        raise ProvisionError(f"NVML nvmlDeviceGetMigMode failed: {err}") from err
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def placements(handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
    """Every legal placement (start, size in memory slices) of a profile, free or not (NVML lists them all)."""
    count = ctypes.c_uint(0)
    _nvml(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    _nvml(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, array, ctypes.byref(count))
    return tuple((array[i].start, array[i].size) for i in range(count.value))


def gpu_instances(handle: Any, profile_ids: Iterable[int]) -> tuple[GpuInstance, ...]:
    """Every GI on the GPU of any of *profile_ids*."""
    found = []
    for profile_id in profile_ids:
        count = ctypes.c_uint(0)
        array = (pynvml.c_nvmlGpuInstance_t * _MAX_GI)()
        if _maybe(pynvml.nvmlDeviceGetGpuInstances, handle, profile_id, array, ctypes.byref(count)) is None:
            continue
        for n in range(count.value):
            info = _nvml(pynvml.nvmlGpuInstanceGetInfo, array[n])
            found.append(GpuInstance(gi=info.id, profile_id=info.profileId, start=info.placement.start,
                                     size=info.placement.size))
    return tuple(found)


def remaining(handle: Any, profile_id: int) -> int:
    """How many more GIs of the profile fit now."""
    return int(_maybe(pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity, handle, profile_id) or 0)


class NoRoom(Exception):  # noqa: N818  (a signal between two functions here, never shown)
    """NVML refused the placement for lack of free slices (another placement may still fit)."""


def make(handle: Any, profile: MigProfile, start: int, size: int) -> Made:
    """A GI of *profile* at (*start*, *size*) and one CI spanning it; raises NoRoom or ProvisionError.

    A CI that cannot be made takes its GI down with it: nothing half-made is left.
    """
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = start, size
    try:
        instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile.profile_id,
                                                                   ctypes.byref(placement))
    except (pynvml.NVMLError_InsufficientResources, pynvml.NVMLError_InUse) as err:
        raise NoRoom(str(err)) from err
    except pynvml.NVMLError as err:
        raise ProvisionError(f"NVML could not make a {profile.name} GPU instance at slice {start}: {err}") from err
    gi = _nvml(pynvml.nvmlGpuInstanceGetInfo, instance).id
    try:
        ci_profile = _nvml(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, instance, _FULL_CI[profile.slices],
                           pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        compute = _nvml(pynvml.nvmlGpuInstanceCreateComputeInstance, instance, ci_profile.id)
        ci = _nvml(pynvml.nvmlComputeInstanceGetInfo, compute).id
        return Made(gi=gi, ci=ci, uuid=_mig_uuid(handle, gi, ci))
    except (ProvisionError, KeyError) as err:
        destroy(handle, gi)
        raise ProvisionError(f"NVML made GPU instance {gi} ({profile.name}) but not its compute instance ({err}); "
                             "the GPU instance was destroyed again") from err


def _mig_uuid(handle: Any, gi: int, ci: int) -> str:
    """The UUID of the MIG device of GI *gi*, CI *ci* (a CI's info names its parent GPU, not its MIG device)."""
    for slot in range(_nvml(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
        try:
            device = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue
        except pynvml.NVMLError as err:
            raise ProvisionError(f"NVML nvmlDeviceGetMigDeviceHandleByIndex failed: {err}") from err
        if (_nvml(pynvml.nvmlDeviceGetGpuInstanceId, device), _nvml(pynvml.nvmlDeviceGetComputeInstanceId, device)) \
                == (gi, ci):
            return text(_nvml(pynvml.nvmlDeviceGetUUID, device))
    raise ProvisionError(f"NVML made GPU instance {gi} with compute instance {ci} but lists no MIG device for them")


def find(handle: Any, profile_id: int, start: int) -> int | None:
    """The id of the GI of *profile_id* placed at *start*, if there is one."""
    return next((g.gi for g in gpu_instances(handle, (profile_id,)) if g.start == start), None)


def destroy(handle: Any, gi: int) -> bool:
    """Destroy GI *gi* and its CIs (CIs first); False when there is no such GI (already gone)."""
    instance = _maybe(pynvml.nvmlDeviceGetGpuInstanceById, handle, gi)
    if instance is None:
        return False
    for ci in range(_MAX_CI):
        compute = _maybe(pynvml.nvmlGpuInstanceGetComputeInstanceById, instance, ci)
        if compute is not None:
            _nvml(pynvml.nvmlComputeInstanceDestroy, compute)
    _nvml(pynvml.nvmlGpuInstanceDestroy, instance)
    return True


def _maybe(fn: Any, *args: Any) -> Any:
    """A pynvml call's answer, or None where NVML says there is no such thing (not a failure)."""
    try:
        return fn(*args)
    except _NONE_HERE:
        return None
    except pynvml.NVMLError as err:
        raise ProvisionError(f"NVML {fn.__name__} failed: {err}") from err


def _nvml(fn: Any, *args: Any) -> Any:
    """Call a pynvml function; its failure is a ProvisionError naming it."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        raise ProvisionError(f"NVML {fn.__name__} failed: {err}") from err
