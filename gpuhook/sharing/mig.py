"""MIG on demand, the pure half: what each ``mig=PROFILE[#NAME]`` ask of a request gets, and the refusals.

An ask names a GPU (the GPU token before it) or none (then any MIG-enabled GPU with the
profile, least used first). It gets an admin's free instance of the profile when there is one
(no lease holds it and gpuhook did not make it), else a place to make one: the GPUs to try, in
order, for the provisioning part, which asks NVML for room under each GPU's lock. ``#NAME``
has one holder per GPU. The refusals the provisioning part raises (MIG mode off, no room) are
worded here too, so that every MIG refusal reads alike and names who holds what.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from gpuhook.errors import BusyError, MigNoRoomError, PolicyError
from gpuhook.inventory import Gpu, Inventory, MigDevice, MigProfile
from gpuhook.planning.select import find_gpu
from gpuhook.request.model import DeviceId, GpuIndex, GpuRequest, GpuUuid, MigAsk
from gpuhook.sharing.ledger import Ledger, MigRecord
from gpuhook.sharing.policy import GpuPolicy
from gpuhook.sharing.room import Room, held_by


@dataclass(frozen=True, slots=True, kw_only=True)
class MigPick:
    """What one ask gets: an admin's free instance (``reuse``), or the GPUs to make one on, in order."""

    ask: MigAsk
    reuse: MigDevice | None = None
    candidates: tuple[Gpu, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuMigRoom:
    """What NVML says is on a MIG GPU that had no room: its GPU instances and what still fits."""

    gpu: Gpu
    #: (GPU instance id, profile name) of every GPU instance on it
    instances: tuple[tuple[int, str], ...]
    #: (profile name, how many more fit) for each profile with room
    fits: tuple[tuple[str, int], ...]


def pick_migs(request: GpuRequest, inventory: Inventory, room: Room, gpus: Sequence[Gpu | None]
              ) -> tuple[MigPick, ...]:
    """Each of *request*'s asks, placed; *gpus*: the asks' GPUs (None for an ask without one), in order.

    Raises PolicyError (no MIG mode, no such profile) or BusyError (a name held, no GPU with room).
    """
    picks: list[MigPick] = []
    # Not free: what a lease holds, and what gpuhook made and awaits destruction. Gathered once, and each
    # ask's refusal worded only when it is raised: per ask, either would cost the whole request again.
    taken = {d.casefold() for lease in room.ledger.leases for d in lease.devices}
    taken |= {r.uuid.casefold() for r in room.ledger.recycle if r.uuid}
    for ask, named in zip(request.mig_asks, gpus, strict=True):
        candidates = _candidates(request, ask, named, inventory, room)
        order = {gpu.index: n for n, gpu in enumerate(candidates)}
        free = sorted((m for m in inventory.mig_devices
                       if m.parent_index in order and m.profile == ask.profile and m.uuid.casefold() not in taken),
                      key=lambda m: (order[m.parent_index], m.index))
        if free:
            taken.add(free[0].uuid.casefold())
            picks.append(MigPick(ask=ask, reuse=free[0]))
        else:
            picks.append(MigPick(ask=ask, candidates=candidates))
    return tuple(picks)


def reused_record(pick: MigPick, inventory: Inventory) -> MigRecord:
    """The lease's record of an admin's instance it reuses."""
    assert pick.reuse is not None
    mig = pick.reuse
    return MigRecord(gpu=inventory.gpus[mig.parent_index].uuid, profile=mig.profile, name=pick.ask.name,
                     created=False, gi=mig.gi, ci=mig.ci, uuid=mig.uuid)


def free_starts(legal: Sequence[int], size: int, occupied: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The legal placement starts (memory slices) of a profile of *size* slices that overlap no (start, size)."""
    taken = 0
    for start, length in occupied:
        taken |= ((1 << length) - 1) << start
    mask = (1 << size) - 1
    return tuple(start for start in legal if not taken & (mask << start))


def _where(request: GpuRequest, ask: MigAsk) -> str:
    return f"{request.source}={request.raw!r}: {str(ask)!r}"


def _candidates(request: GpuRequest, ask: MigAsk, named: Gpu | None, inventory: Inventory, room: Room
                ) -> tuple[Gpu, ...]:
    """The GPUs an ask may get an instance on, least used first; raises PolicyError or BusyError."""
    if named is not None:
        if not named.mig_enabled:
            raise PolicyError(f"{_where(request, ask)}: {not_in_mig_mode(named)}")
        gpus: tuple[Gpu, ...] = (named,)
    else:
        gpus = tuple(g for g in inventory.gpus if g.mig_enabled)
        if not gpus:
            have = ", ".join(f"{g.index} ({g.model})" for g in inventory.gpus) or "none"
            raise PolicyError(f"{_where(request, ask)}: no GPU of this host is in MIG mode (GPUs: {have}). Fix: "
                              "enable MIG mode on one (`nvidia-smi -i 0 -mig 1`; this needs the GPU idle and, on "
                              "some GPUs, a reset), or ask for a whole GPU")
    with_profile = tuple(g for g in gpus if g.mig_profile(ask.profile) is not None)
    if not with_profile:
        raise PolicyError(f"{_where(request, ask)}: {unknown_profile(ask.profile, gpus)}")
    busy: list[str] = []
    usable: list[Gpu] = []
    for gpu in with_profile:
        holder = room.ledger.named(gpu.uuid, ask.name) if ask.name else None
        if holder is not None:
            busy.append(f"the instance {ask.name!r} on GPU {gpu.index} is {room.held((holder,))}")
        elif not room.new_mig_has_room(gpu):
            busy.append(f"GPU {gpu.index} ({gpu.uuid}) is {room.policies[gpu.index].describe()}, "
                        f"{room.held(room.whole_holders(gpu))} as a whole GPU")
        else:
            usable.append(gpu)
    if not usable:
        fix = ("choose another #NAME, or wait for the holder to end" if ask.name
               else "wait for the holder to end, or ask for another GPU")
        raise BusyError(f"{_where(request, ask)}: {'; '.join(busy)}. Fix: {fix} (a holder that is gone: "
                        "`gpuhook release CONTAINER_ID`)")
    return tuple(sorted(usable, key=lambda g: (len(room.ledger.holding_mig_on(g.uuid)), g.index)))


def not_in_mig_mode(gpu: Gpu) -> str:
    """Why a GPU cannot be given a MIG instance, and the fix (gpuhook never changes MIG mode)."""
    return (f"GPU {gpu.index} ({gpu.model}, {gpu.uuid}) is not in MIG mode: enable it with "
            f"`nvidia-smi -i {gpu.index} -mig 1`; this needs the GPU idle and, on some GPUs, a reset "
            "(gpuhook never changes MIG mode)")


def describe_profiles(profiles: Sequence[MigProfile]) -> str:
    """``1g.5gb (4.8 GiB, up to 7), 3g.20gb (19.5 GiB, up to 2), ...``."""
    return ", ".join(f"{p.name} ({p.memory_mib / 1024:.1f} GiB, up to {p.instances})" for p in profiles)


def unknown_profile(profile: str, gpus: Sequence[Gpu]) -> str:
    """No GPU among *gpus* has *profile*: what each has, and the fix."""
    listed = "; ".join(f"GPU {g.index} ({g.model}) has {describe_profiles(g.mig_profiles)}" if g.mig_profiles
                       else f"GPU {g.index} ({g.model}) supports no MIG" for g in gpus)
    return f"no MIG profile {profile!r} here: {listed}. Fix: ask for one of those (mig=PROFILE)"


def no_room(request: GpuRequest, ask: MigAsk, tried: Sequence[GpuMigRoom], ledger: Ledger, now: datetime
            ) -> MigNoRoomError:
    """No GPU tried had room for *ask*: what is on each, who holds it, what still fits."""
    parts = []
    for state in tried:
        gpu = state.gpu
        held = []
        for gi, profile in state.instances:
            holder = next((lease for lease in ledger.leases for r in lease.migs
                           if r.gpu.casefold() == gpu.uuid.casefold() and r.gi == gi), None)
            held.append(f"{profile} (GI {gi}, " + (held_by((holder,), now) if holder else "held by no container")
                        + ")")
        fits = ", ".join(f"{name} ×{count}" for name, count in state.fits) or "nothing"
        parts.append(f"GPU {gpu.index} ({gpu.model}) has {'; '.join(held) or 'no instance'}; what still fits: {fits}")
    return MigNoRoomError(f"{_where(request, ask)}: no room for a {ask.profile} instance: {'. '.join(parts)}. "
                          "Fix: wait for a holder to end, ask for a profile that fits, or remove an idle admin "
                          "instance (`nvidia-smi mig -dci -ci C -gi G -i GPU` then `-dgi -gi G`)")


def mode_may_be_stale(request: GpuRequest, inventory: Inventory) -> bool:
    """Whether an ask would be refused for MIG mode off by *inventory* (cached: MIG mode may have been enabled
    since, which changes nothing else the cache sees), so that it is asked of NVML again first."""
    for ask in request.mig_asks:
        gpu = find_gpu(ask.gpu, inventory.gpus) if ask.gpu is not None else None
        if (gpu is not None and not gpu.mig_enabled) or (ask.gpu is None and not any(
                g.mig_enabled for g in inventory.gpus)):
            return True
    return False


def with_policy_instances(request: GpuRequest, inventory: Inventory, policies: Mapping[int, GpuPolicy]) -> GpuRequest:
    """*request* with each whole GPU whose policy says ``MIGMode: {Enable: true, Instance: P}`` asking for a P
    instance on it instead (``mig=P`` after it)."""
    kept: list[DeviceId] = []
    asks = list(request.mig_asks)
    for device in request.devices:
        gpu = find_gpu(device, inventory.gpus) if isinstance(device, GpuIndex | GpuUuid) else None
        mode = policies[gpu.index].mig if gpu is not None else None
        if gpu is not None and mode is not None and mode.enable and mode.instance:
            asks.append(MigAsk(profile=mode.instance, gpu=GpuIndex(gpu.index)))
        else:
            kept.append(device)
    if len(asks) == len(request.mig_asks):
        return request
    return replace(request, devices=tuple(kept), mig_asks=tuple(asks))


def with_recorded(inventory: Inventory, records: Sequence[MigRecord]) -> Inventory:
    """*inventory* with the ready instances *records* name (the ledger's) among its MIG devices.

    NVML told gpuhook their UUIDs when it made them, so a start that can select MIG devices
    need not ask NVML again for them (``discovery.cache``): each replaces a device of the same
    GPU instance and compute instance, or joins its parent's devices last (NVML numbers MIG
    devices in the order they were made); ``narrow_to_live`` renumbers them.
    """
    by_uuid = {g.uuid.casefold(): g for g in inventory.gpus}
    added: list[MigDevice] = []
    for record in records:
        parent = by_uuid.get(record.gpu.casefold())
        if parent is None or record.uuid is None or record.gi is None or record.ci is None:
            continue
        added.append(MigDevice(parent_index=parent.index, index=len(inventory.mig_devices) + len(added),
                               uuid=record.uuid, gi=record.gi, ci=record.ci, profile=record.profile,
                               name=f"{parent.model} MIG {record.profile}"))
    if not added:
        return inventory
    places = {(m.parent_index, m.gi, m.ci) for m in added}
    kept = tuple(m for m in inventory.mig_devices if (m.parent_index, m.gi, m.ci) not in places)
    ordered = sorted((*kept, *added), key=lambda m: m.parent_index)  # stable: each parent's order is kept
    return replace(inventory, mig_devices=tuple(ordered))
