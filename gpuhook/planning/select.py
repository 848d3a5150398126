"""Resolve a request's device list against the host's GPUs."""

from __future__ import annotations

from gpuhook.errors import UnknownDeviceError
from gpuhook.inventory import Gpu
from gpuhook.request.model import DeviceId, GpuIndex, GpuRequest, GpuUuid, MigIndex, MigUuid


def select_gpus(request: GpuRequest, gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    """The GPUs *request* names, in request order without duplicates; raises UnknownDeviceError."""
    if request.all_devices:
        return gpus
    chosen: dict[str, Gpu] = {}
    for device in request.devices:
        gpu = _find(device, gpus)
        if gpu is None:
            raise UnknownDeviceError(_unknown_message(request, device, gpus))
        chosen.setdefault(gpu.uuid, gpu)
    return tuple(chosen.values())


def _find(device: DeviceId, gpus: tuple[Gpu, ...]) -> Gpu | None:
    """The GPU *device* names, or None."""
    match device:
        case GpuIndex(index):
            return next((g for g in gpus if g.index == index), None)
        case GpuUuid(uuid):
            # libnvidia-container: strcasecmp on the full UUID, never a prefix match.
            return next((g for g in gpus if g.uuid.casefold() == uuid.casefold()), None)
        case MigUuid() | MigIndex():
            return None  # this inventory has no MIG devices (MIG discovery is not built yet)


def _unknown_message(request: GpuRequest, device: DeviceId, gpus: tuple[Gpu, ...]) -> str:
    """Name the value, list what exists, say the fix."""
    match device:
        case GpuIndex(index):
            what = f"no GPU with index {index}"
        case GpuUuid(uuid):
            what = f"no GPU with UUID {uuid}"
        case _:
            what = f"no MIG device {device} (no MIG devices are known on this host)"
    have = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
    count = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
    return (
        f"{request.source}={request.raw!r}: {what} on this host; it has {count}: {have}. "
        "Fix: request one of those by index or UUID, or 'all'"
    )
