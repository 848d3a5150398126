"""Allocation: which devices a request gets under the per-GPU policy and the ledger, or why none.

A pure function of the request, the (live-narrowed) inventory, each GPU's policy and the
ledger. A GPU's *holders* are the other containers that hold it whole or hold one of its MIG
devices; a MIG device's are those that hold it or its parent whole. A device has room while
its holders are fewer than its policy's limit (exclusive 1, shared/mps ``replicas``,
unlimited none). ``count=N`` takes N GPUs with room whose policy allows the request's
capabilities, least held first, then the lowest index; all or nothing. It never picks a GPU
that the health policy would refuse (``unhealthy``); a GPU named explicitly is the health
check's to refuse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from gpuhook.errors import BusyError, PolicyError
from gpuhook.inventory import Gpu, Inventory, MigDevice
from gpuhook.planning.select import select_devices
from gpuhook.request.model import GpuIndex, GpuRequest
from gpuhook.sharing.ledger import Lease, Ledger
from gpuhook.sharing.policy import GpuPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """What a start may take: *request* with its ``count`` resolved to GPUs, and the devices to lease."""

    request: GpuRequest
    #: GPU and MIG UUIDs, in request order
    devices: tuple[str, ...]


def allocate(request: GpuRequest, inventory: Inventory, policies: Mapping[int, GpuPolicy], ledger: Ledger, *,
             container_id: str, now: datetime, unhealthy: Mapping[int, str] | None = None) -> Allocation:
    """The devices *request* gets; raises PolicyError (a capability not allowed), BusyError (no room) or
    UnknownDeviceError. *container_id*'s own lease (a second start stage) does not count against it;
    *unhealthy*: GPUs (by index, with the problem) that ``count`` must not pick."""
    others = Ledger(tuple(lease for lease in ledger.leases if lease.container_id != container_id))
    room = _Room(inventory, policies, others, now)
    if request.count is not None:
        gpus = _pick(request, inventory.gpus, room, unhealthy or {})
        return Allocation(request=replace(request, devices=tuple(GpuIndex(g.index) for g in gpus), count=None),
                          devices=tuple(g.uuid for g in gpus))
    selection = select_devices(request, inventory)
    full: list[str] = []
    for gpu in selection.gpus:
        _check_capabilities(request, gpu, policies[gpu.index])
        if not room.gpu_has_room(gpu):
            full.append(room.describe_gpu(gpu))
    for mig in selection.migs:
        parent = inventory.gpus[mig.parent_index]
        _check_capabilities(request, parent, policies[parent.index])
        if not room.mig_has_room(mig, parent):
            full.append(room.describe_mig(mig, parent))
    if full:
        raise BusyError(f"{request.source}={request.raw!r}: {'; '.join(full)}. Fix: wait for the holder to end, "
                        "ask for another GPU ('any' or 'count=N' take free ones), or, if a holder is gone, "
                        "`gpuhook release CONTAINER_ID`")
    return Allocation(request=request, devices=tuple(g.uuid for g in selection.gpus)
                      + tuple(m.uuid for m in selection.migs))


def _pick(request: GpuRequest, gpus: Sequence[Gpu], room: _Room, unhealthy: Mapping[int, str]) -> tuple[Gpu, ...]:
    """``count=N``: the N GPUs with room, least held first, then the lowest index; raises BusyError
    (PolicyError when too few GPUs may be given the request's capabilities at all)."""
    assert request.count is not None
    permitted = [g for g in gpus if _allows(room.policies[g.index], request)]
    healthy = [g for g in permitted if g.index not in unhealthy]
    free = sorted((g for g in healthy if room.gpu_has_room(g)), key=lambda g: (len(room.gpu_holders(g)), g.index))
    if len(free) >= request.count:
        return tuple(free[:request.count])
    why = [room.describe_gpu(g) for g in healthy if g not in free]
    why += [f"GPU {g.index} is unhealthy ({unhealthy[g.index]})" for g in permitted if g.index in unhealthy]
    why += [f"GPU {g.index} may be given only {_names(room.policies[g.index])}" for g in gpus if g not in permitted]
    asked = f"{request.count} GPU{'s' if request.count != 1 else ''}"
    if len(permitted) < request.count:  # waiting would not help
        raise PolicyError(f"{request.source}={request.raw!r}: {asked} asked, but only {len(permitted)} of {len(gpus)} "
                          f"may be given {', '.join(sorted(request.capabilities))}: {'; '.join(why)}. Fix: ask for "
                          "fewer GPUs or capabilities (NVIDIA_DRIVER_CAPABILITIES)")
    raise BusyError(f"{request.source}={request.raw!r}: {asked} asked, {len(free)} of {len(gpus)} free under their "
                    f"policies{': ' if why else ''}{'; '.join(why)}. Fix: wait for a holder to end, ask for fewer, or, "
                    "if a holder is gone, `gpuhook release CONTAINER_ID`")


def _allows(policy: GpuPolicy, request: GpuRequest) -> bool:
    return policy.capabilities is None or request.capabilities <= policy.capabilities


def _check_capabilities(request: GpuRequest, gpu: Gpu, policy: GpuPolicy) -> None:
    if not _allows(policy, request):
        assert policy.capabilities is not None
        extra = ", ".join(sorted(request.capabilities - policy.capabilities))
        raise PolicyError(f"{request.source}={request.raw!r}: GPU {gpu.index} ({gpu.uuid}) may be given only "
                          f"{_names(policy)}, and the container asks also for {extra} (NVIDIA_DRIVER_CAPABILITIES). "
                          "Fix: ask for those capabilities only, or for another GPU")


def _names(policy: GpuPolicy) -> str:
    return ", ".join(sorted(policy.capabilities or ())) or "no capability"


class _Room:
    """Holders and room of each device under the policies (the other containers' leases only)."""

    __slots__ = ("inventory", "ledger", "now", "policies")

    def __init__(self, inventory: Inventory, policies: Mapping[int, GpuPolicy], ledger: Ledger, now: datetime) -> None:
        self.inventory = inventory
        self.policies = policies
        self.ledger = ledger
        self.now = now

    def gpu_holders(self, gpu: Gpu) -> tuple[Lease, ...]:
        """Who holds *gpu* whole or one of its MIG devices."""
        return self.ledger.holding(gpu.uuid, *(m.uuid for m in self.inventory.mig_devices
                                               if m.parent_index == gpu.index))

    def mig_holders(self, mig: MigDevice, parent: Gpu) -> tuple[Lease, ...]:
        """Who holds *mig*, or its parent whole."""
        return self.ledger.holding(mig.uuid, parent.uuid)

    def gpu_has_room(self, gpu: Gpu) -> bool:
        limit = self.policies[gpu.index].limit
        return limit is None or len(self.gpu_holders(gpu)) < limit

    def mig_has_room(self, mig: MigDevice, parent: Gpu) -> bool:
        limit = self.policies[parent.index].limit
        return limit is None or len(self.mig_holders(mig, parent)) < limit

    def describe_gpu(self, gpu: Gpu) -> str:
        policy = self.policies[gpu.index].describe()
        return f"GPU {gpu.index} ({gpu.uuid}) is {policy}, {self._held(self.gpu_holders(gpu))}"

    def describe_mig(self, mig: MigDevice, parent: Gpu) -> str:
        policy = self.policies[parent.index].describe()
        return f"MIG device {mig.uuid} (on GPU {parent.index}, {policy}) is {self._held(self.mig_holders(mig, parent))}"

    def _held(self, leases: Sequence[Lease]) -> str:
        holders = ", ".join(f"{lease.container_id} (pid {lease.holder.pid}, for {lease.age(self.now)})"
                            for lease in leases)
        return f"held by {holders}"
