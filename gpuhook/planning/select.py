"""Resolve a request's device list against the host's GPUs and MIG devices."""

from __future__ import annotations

from dataclasses import dataclass

from gpuhook.errors import UnknownDeviceError
from gpuhook.inventory import Gpu, Inventory, MigDevice
from gpuhook.request.model import DeviceId, GpuIndex, GpuRequest, GpuUuid, MigIndex, MigUuid


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """What a request names: whole GPUs and MIG devices (each MIG device also needs its parent's node)."""

    gpus: tuple[Gpu, ...]
    migs: tuple[MigDevice, ...]

    def parents(self, inventory: Inventory) -> tuple[Gpu, ...]:
        """The selected GPUs plus the parents of the selected MIG devices, without duplicates."""
        found = {g.index: g for g in self.gpus}
        for mig in self.migs:
            found.setdefault(mig.parent_index, inventory.gpus[mig.parent_index])
        return tuple(found.values())


def select_devices(request: GpuRequest, inventory: Inventory) -> Selection:
    """The devices *request* names, in request order without duplicates; raises UnknownDeviceError.

    ``all`` is every GPU and every MIG device (libnvidia-container ``select_all_devices``).
    """
    if request.all_devices:
        return Selection(gpus=inventory.gpus, migs=inventory.mig_devices)
    gpus: dict[str, Gpu] = {}
    migs: dict[str, MigDevice] = {}
    for device in request.devices:
        match device:
            case GpuIndex() | GpuUuid():
                gpu = find_gpu(device, inventory.gpus)
                if gpu is None:
                    raise UnknownDeviceError(_unknown_message(request, device, inventory))
                gpus.setdefault(gpu.uuid, gpu)
            case MigUuid() | MigIndex():
                mig = _find_mig(device, inventory)
                if mig is None:
                    raise UnknownDeviceError(_unknown_message(request, device, inventory))
                migs.setdefault(mig.uuid, mig)
    return Selection(gpus=tuple(gpus.values()), migs=tuple(migs.values()))


def find_gpu(device: GpuIndex | GpuUuid, gpus: tuple[Gpu, ...]) -> Gpu | None:
    """The GPU an index or UUID names, or None."""
    if isinstance(device, GpuIndex):
        return next((g for g in gpus if g.index == device.index), None)
    # libnvidia-container: strcasecmp on the full UUID, never a prefix match.
    return next((g for g in gpus if g.uuid.casefold() == device.uuid.casefold()), None)


def _find_mig(device: MigUuid | MigIndex, inventory: Inventory) -> MigDevice | None:
    """The MIG device a ``MIG-`` UUID, a legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` or a ``G:M`` index names."""
    migs = inventory.mig_devices
    if isinstance(device, MigIndex):
        return next((m for m in migs if (m.parent_index, m.index) == (device.gpu, device.mig)), None)
    wanted = device.uuid.casefold()
    if wanted.startswith("mig-gpu-"):
        parent_uuid, gi, ci = device.uuid[4:].rsplit("/", 2)
        return next((m for m in migs if inventory.gpus[m.parent_index].uuid.casefold() == parent_uuid.casefold()
                     and (m.gi, m.ci) == (int(gi), int(ci))), None)
    return next((m for m in migs if m.uuid.casefold() == wanted), None)


def _unknown_message(request: GpuRequest, device: DeviceId, inventory: Inventory) -> str:
    """Name the value, list what exists, say the fix (for a MIG device: also what each MIG GPU can make)."""
    gpus = inventory.gpus
    mig_ask = False
    match device:
        case GpuIndex(index):
            what = f"no GPU with index {index}"
        case GpuUuid(uuid):
            what = f"no GPU with UUID {uuid}"
        case _:
            what = f"no MIG device {device}"
            mig_ask = True
    have = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
    count = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
    migs = ", ".join(
        f"{m.parent_index}:{m.index} ({m.uuid}{f', {m.profile}' if mig_ask and m.profile else ''})"
        for m in inventory.mig_devices
    ) or "none"
    makers = [g for g in gpus if g.mig_enabled and g.mig_profiles] if mig_ask else []
    can_make = "".join(
        f"; GPU {g.index} can make: "
        + ", ".join(f"{p.name} ({p.memory_mib / 1024:.1f} GiB, {p.instances} fit)" for p in g.mig_profiles)
        for g in makers
    )
    if makers:
        can_make += f"; ask for one with {makers[0].index},mig=PROFILE"
    return (
        f"{request.source}={request.raw!r}: {what} on this host; it has {count}: {have}; MIG devices: {migs}"
        f"{can_make}. Fix: request one of those by index or UUID, or 'all'"
    )
