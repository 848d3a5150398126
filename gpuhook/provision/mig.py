"""MIG instances made for a lease, and destroyed after it: NVML under the GPU's lock, each step in the ledger first.

``make`` tries the GPUs an ask may use (``sharing.mig.pick_migs``'s order). On each, under the
GPU's lock: NVML says whether MIG mode is on, the profile and its free placements; the instance
is recorded in the container's lease as ``creating`` at the placement chosen *before* NVML makes
it there, and ``ready`` with its ids and UUID after. ``recycle`` destroys what the ledger's
``recycle`` holds (the instances gpuhook made whose lease ended), CIs first, then the GI, and
only then forgets them. A crash at any point so leaves a record: ``creating`` at a placement, or
ids, in a lease whose holder is gone (reclaim moves it to ``recycle``) or in ``recycle`` itself.
A record's GI is destroyed only while no other lease records that GI: all of gpuhook's changes
to one GPU happen under its lock, so a GI that a later start made in a destroyed one's place is
never taken for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuhook.errors import DiscoveryError, GpuHookError, PolicyError, ProvisionError
from gpuhook.inventory import Gpu, MigProfile
from gpuhook.nvml import mig as nvml_mig
from gpuhook.nvml.facts import gi_profiles
from gpuhook.nvml.session import session
from gpuhook.provision import ledger_store
from gpuhook.request.model import GpuRequest
from gpuhook.sharing.ledger import Holder, Ledger, MigRecord, MigState
from gpuhook.sharing.mig import GpuMigRoom, MigPick, free_starts, no_room, not_in_mig_mode, unknown_profile
from gpuhook.sharing.room import held_by


@dataclass(frozen=True, slots=True, kw_only=True)
class Made:
    """An instance made for a lease: its parent GPU and its record (ready: ids and UUID)."""

    gpu: Gpu
    record: MigRecord


def make(state_dir: Path, library: Path, request: GpuRequest, pick: MigPick, *, container_id: str, holder: Holder,
         now: datetime) -> Made:
    """An instance for *pick* made on the first of its candidates with room and leased to *container_id*.

    Raises PolicyError (NVML says MIG mode is off, or the profile unknown, on every candidate), BusyError
    (no room, or the name was taken meanwhile) or ProvisionError (NVML failed).
    """
    tried: list[GpuMigRoom] = []
    refused: list[str] = []  # GPUs NVML says cannot have it at all (the cached inventory was behind)
    for gpu in pick.candidates:
        with ledger_store.gpu_lock(state_dir, gpu.uuid), session(library):
            handle = nvml_mig.gpu(gpu.uuid)
            if not nvml_mig.mig_enabled(handle):
                refused.append(not_in_mig_mode(gpu))
                continue
            profiles = gi_profiles(gpu.index, handle)
            profile = next((p for p in profiles if p.name == pick.ask.profile), None)
            if profile is None:
                refused.append(unknown_profile(pick.ask.profile, (gpu,)))
                continue
            made = _make_on(state_dir, handle, gpu, profile, pick, container_id=container_id, holder=holder,
                            profiles=profiles, now=now, request=request)
            if made is not None:
                return made
            names = {p.profile_id: p.name for p in profiles}
            tried.append(GpuMigRoom(
                gpu=gpu, instances=tuple((g.gi, names.get(g.profile_id, "?"))
                                         for g in nvml_mig.gpu_instances(handle, names)),
                fits=tuple((p.name, n) for p in profiles if (n := nvml_mig.remaining(handle, p.profile_id)))))
    if not tried:
        raise PolicyError(f"{request.source}={request.raw!r}: {'; '.join(refused)}")
    raise no_room(request, pick.ask, tried, ledger_store.read(state_dir), now)


def _make_on(state_dir: Path, handle: Any, gpu: Gpu, profile: MigProfile, pick: MigPick, *, container_id: str,
             holder: Holder, profiles: tuple[MigProfile, ...], now: datetime, request: GpuRequest
             ) -> Made | None:
    """The instance made on *gpu* at its first free placement NVML accepts; None when none is free."""
    occupied = [(g.start, g.size) for g in nvml_mig.gpu_instances(handle, (p.profile_id for p in profiles))]
    legal = nvml_mig.placements(handle, profile.profile_id)
    size = legal[0][1] if legal else 0
    for start in free_starts([s for s, _ in legal], size, occupied):
        intent = MigRecord(gpu=gpu.uuid, profile=profile.name, name=pick.ask.name, created=True,
                           state=MigState.CREATING, profile_id=profile.profile_id, placement=start)
        _record(state_dir, container_id, holder, intent, request=request, now=now)
        try:
            made = nvml_mig.make(handle, profile, start, size)
        except nvml_mig.NoRoom:
            _forget(state_dir, container_id, holder, intent)
            continue
        except GpuHookError:
            _forget(state_dir, container_id, holder, intent)  # make() leaves nothing half-made
            raise
        ready = replace(intent, state=MigState.READY, gi=made.gi, ci=made.ci, uuid=made.uuid)
        _record_made(state_dir, container_id, holder, ready, intent)
        return Made(gpu=gpu, record=ready)
    return None


def _record(state_dir: Path, container_id: str, holder: Holder, intent: MigRecord, *, request: GpuRequest,
            now: datetime) -> None:
    """*intent* into the lease, unless its name was taken since the allocation (then BusyError)."""

    def change(ledger: Ledger) -> tuple[Ledger, Exception | None]:
        own = ledger.lease_of(container_id, holder)
        if own is None:
            return ledger, ProvisionError(f"the lease of {container_id} is gone (released by hand?) before its MIG "
                                          "instance was made")
        named = ledger.named(intent.gpu, intent.name) if intent.name else None
        if named is not None and named != own:  # another container's, maybe of the same id
            return ledger, PolicyError(f"{request.source}={request.raw!r}: the instance {intent.name!r} is "
                                       f"{held_by((named,), now)}. Fix: choose another #NAME, or wait for it to end")
        return ledger.record_mig(container_id, holder, intent), None

    refused = ledger_store.update(state_dir, change)
    if refused is not None:
        raise refused


def _record_made(state_dir: Path, container_id: str, holder: Holder, ready: MigRecord, intent: MigRecord) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.record_mig(container_id, holder, ready, replacing=intent),
                                                   None))


def _forget(state_dir: Path, container_id: str, holder: Holder, record: MigRecord) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.forget_mig(container_id, holder, record), None))


def recycle(state_dir: Path, library: Path) -> tuple[tuple[MigRecord, ...], tuple[tuple[MigRecord, str], ...]]:
    """Destroy every instance in the ledger's ``recycle`` (those still there), forgetting each once destroyed;
    (the ones destroyed, (record, why) for those NVML could not destroy: they stay for the next try)."""
    destroyed: list[MigRecord] = []
    failed: list[tuple[MigRecord, str]] = []
    for record in ledger_store.read(state_dir).recycle:
        try:
            with ledger_store.gpu_lock(state_dir, record.gpu):
                ledger = ledger_store.read(state_dir)
                if record not in ledger.recycle:
                    continue  # another process recycled it meanwhile
                with session(library):
                    if _destroy(record, ledger):
                        destroyed.append(record)
                _recycled(state_dir, record)
        except (ProvisionError, DiscoveryError) as err:
            failed.append((record, str(err)))
    return tuple(destroyed), tuple(failed)


def _recycled(state_dir: Path, record: MigRecord) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.recycled(record), None))


def _destroy(record: MigRecord, ledger: Ledger) -> bool:
    """Destroy *record*'s GI and CIs, unless another lease records that GI; whether it was there to destroy."""
    try:
        handle = nvml_mig.gpu(record.gpu)
    except ProvisionError:
        return False  # the GPU is gone (reset, unplugged): so are its instances
    gi = record.gi
    if gi is None and record.profile_id is not None and record.placement is not None:
        gi = nvml_mig.find(handle, record.profile_id, record.placement)  # a crash between record and create
    if gi is None or _recorded_elsewhere(ledger, record, gi):
        return False
    return nvml_mig.destroy(handle, gi)


def _recorded_elsewhere(ledger: Ledger, record: MigRecord, gi: int) -> bool:
    """Whether a lease records GI *gi* of *record*'s GPU (a later start's instance in the destroyed one's place)."""
    return any(r.gpu == record.gpu and r.gi == gi for lease in ledger.leases for r in lease.migs)
