"""Allocation: which devices a request gets under the per-GPU policy and the ledger, or why none.

A pure function of the request, the (live-narrowed) inventory, each GPU's policy and the
ledger; holders and room are ``sharing.room``'s. ``count=N`` takes N GPUs with room whose
policy allows the request's capabilities, least held first, then the lowest index; all or
nothing. It never picks a GPU that the health policy would refuse (``unhealthy``); a GPU named
explicitly is the health check's to refuse. ``mig=PROFILE`` asks are ``sharing.mig``'s: an
admin's free instance is leased at once, an instance to make is left to the provisioning part
(``Allocation.to_make``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from gpuhook.errors import BusyError, PolicyError
from gpuhook.inventory import Gpu, Inventory
from gpuhook.planning.select import select_devices
from gpuhook.request.model import GpuIndex, GpuRequest, MigUuid
from gpuhook.sharing.ledger import Holder, Ledger, MigRecord
from gpuhook.sharing.mig import MigPick, pick_migs, reused_record, with_policy_instances
from gpuhook.sharing.policy import GpuPolicy, Sharing
from gpuhook.sharing.room import Room


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """What a start may take: *request* with ``count`` resolved to GPUs and reused MIG instances named by UUID,
    the devices to lease (and the MIG records among them), and the MIG instances still to make."""

    request: GpuRequest
    #: GPU and MIG UUIDs, in request order
    devices: tuple[str, ...]
    #: the admin instances reused (their records join the lease)
    migs: tuple[MigRecord, ...] = ()
    #: asks that get an instance made for them (``request`` keeps these asks; the rest are resolved)
    to_make: tuple[MigPick, ...] = ()


def allocate(request: GpuRequest, inventory: Inventory, policies: Mapping[int, GpuPolicy], ledger: Ledger, *,
             container_id: str, now: datetime, holder: Holder | None = None,
             unhealthy: Mapping[int, str] | None = None) -> Allocation:
    """The devices *request* gets; raises PolicyError (a capability not allowed), BusyError (no room) or
    UnknownDeviceError. The container's own lease (*container_id* held by *holder*: a second start stage)
    does not count against it; another holder's lease under the same id is another container's, and does;
    *unhealthy*: GPUs (by index, with the problem) that ``count`` must not pick."""
    own = ledger.lease_of(container_id, holder) if holder is not None else None
    others = Ledger(tuple(lease for lease in ledger.leases if lease != own), ledger.recycle)
    room = Room(inventory, policies, others, now)
    if request.count is not None:
        gpus = _pick(request, inventory.gpus, room, unhealthy or {})
        return Allocation(request=replace(request, devices=tuple(GpuIndex(g.index) for g in gpus), count=None),
                          devices=tuple(g.uuid for g in gpus))
    request = with_policy_instances(request, inventory, policies)
    selection = select_devices(request, inventory)
    picks = _pick_migs(request, inventory, room)
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
    shared_by_mps = [g for g in selection.parents(inventory) if policies[g.index].sharing is Sharing.MPS]
    if len(shared_by_mps) > 1:
        listed = ", ".join(str(g.index) for g in shared_by_mps)
        raise PolicyError(f"{request.source}={request.raw!r}: GPUs {listed} are each shared through an MPS daemon of "
                          "their own, and a container reaches one MPS daemon (its /tmp/nvidia-mps). Fix: ask for one "
                          "of them")
    if full:
        raise BusyError(f"{request.source}={request.raw!r}: {'; '.join(full)}. Fix: wait for the holder to end, "
                        "ask for another GPU ('any' or 'count=N' take free ones), or, if a holder is gone, "
                        "`gpuhook release CONTAINER_ID`")
    reused = tuple(p for p in picks if p.reuse is not None)
    to_make = tuple(p for p in picks if p.reuse is None)
    request = replace(request, devices=request.devices + tuple(MigUuid(p.reuse.uuid) for p in reused if p.reuse),
                      mig_asks=tuple(p.ask for p in to_make))
    return Allocation(request=request, devices=tuple(g.uuid for g in selection.gpus)
                      + tuple(m.uuid for m in selection.migs) + tuple(p.reuse.uuid for p in reused if p.reuse),
                      migs=tuple(reused_record(p, inventory) for p in reused), to_make=to_make)


def _pick_migs(request: GpuRequest, inventory: Inventory, room: Room) -> tuple[MigPick, ...]:
    """The request's ``mig=`` asks placed (each ask's GPU found first, and its policy's capabilities checked)."""
    if not request.mig_asks:
        return ()
    named = []
    for ask in request.mig_asks:
        gpus = (select_devices(replace(request, devices=(ask.gpu,), mig_asks=()), inventory).gpus
                if ask.gpu is not None else ())
        named.append(gpus[0] if gpus else None)
    for gpu in (g for g in named if g is not None):
        _check_capabilities(request, gpu, room.policies[gpu.index])
    return pick_migs(request, inventory, room, named)


def _pick(request: GpuRequest, gpus: Sequence[Gpu], room: Room, unhealthy: Mapping[int, str]) -> tuple[Gpu, ...]:
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
