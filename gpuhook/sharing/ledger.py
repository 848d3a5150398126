"""The lease ledger as a value: who holds which GPU (or MIG device), since when, and in which state.

A lease names its container (the OCI id), the devices it holds (GPU and MIG UUIDs), and its
holder: the container's init as a pid *and* that process's start time, so that a pid the
kernel hands to another process never keeps a lease. An id is not unique (another runc
``--root``, another containerd namespace, ``nvidia-container-cli configure``'s rootfs parent), so
a lease is the id *and* its holder: a same-id start with another live holder is another
container, whose lease stands beside the first one's. Transitions return a new ledger:
``reserve`` (before anything is changed in the container) → ``activate`` (the start held) →
``release``; ``stale`` lists the leases whose holder is gone, with the liveness check passed in.
The store (a file written atomically under a lock) is ``provision.ledger_store``'s.

A lease also records the MIG instances it holds (``MigRecord``): an admin's, reused, or one
gpuhook made for it. A made one is recorded *before* NVML is asked to make it (``creating``,
with the placement it is made at), so a crash between the two leaves a record to find it by.
Whenever a lease leaves the ledger, the instances gpuhook made for it move to ``recycle``, the
instances to destroy; they leave it once destroyed (``recycled``), so no path that ends a lease
can forget one.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Final

from gpuhook.errors import StateError

FORMAT: Final = 1


class LeaseState(enum.StrEnum):
    """Where a lease is in its life."""

    #: taken under the lock before the container is changed: the start is under way
    RESERVED = "reserved"
    #: the container's cgroup allows these devices: its start held, or is finishing its rootfs (a start that
    #: fails after drops the lease)
    ACTIVE = "active"


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class Holder:
    """A process as a lease knows it: its pid and its start time (clock ticks after boot, /proc/PID/stat)."""

    pid: int
    start: int


class MigState(enum.StrEnum):
    """Where a MIG instance a lease holds is in its life."""

    #: recorded, NVML not yet known to have made it (its placement says where it would be)
    CREATING = "creating"
    #: it exists: ids and UUID known
    READY = "ready"


@dataclass(frozen=True, slots=True, kw_only=True)
class MigRecord:
    """A MIG instance a lease holds: one gpuhook made for it, or an admin's it reuses."""

    #: the parent GPU's UUID
    gpu: str
    #: the GPU-instance profile name (``3g.20gb``)
    profile: str
    #: ``#NAME`` it was asked by (None: unnamed)
    name: str | None
    #: gpuhook made it (destroyed when the lease ends); False: an admin's, reused and never destroyed
    created: bool
    state: MigState = MigState.READY
    #: the NVML profile id and the placement start (memory slice) gpuhook made it with
    profile_id: int | None = None
    placement: int | None = None
    gi: int | None = None
    ci: int | None = None
    uuid: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MpsDaemon:
    """An MPS control daemon gpuhook runs for one GPU, while containers hold it under ``sharing: mps``."""

    #: the GPU's UUID (the daemon's CUDA_VISIBLE_DEVICES)
    gpu: str
    #: its CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY on the host, and the /dev/shm it shares with
    #: its clients
    pipe_dir: str
    log_dir: str
    shm_dir: str
    #: the defaults it was told (set_default_active_thread_percentage, ..._device_pinned_mem_limit)
    thread_percentage: float
    memory_limit_mib: int
    #: the control daemon's process; None: recorded before it was started (a crash may have left one running)
    holder: Holder | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """One container's hold on its devices."""

    container_id: str
    #: GPU UUIDs (whole GPUs) and MIG UUIDs
    devices: tuple[str, ...]
    holder: Holder
    #: when it was taken, UTC, ISO 8601 with a Z (``2026-12-01T12:00:00Z``)
    since: str
    state: LeaseState = LeaseState.RESERVED
    #: the MIG instances among (or about to join) *devices*
    migs: tuple[MigRecord, ...] = ()

    def age(self, now: datetime) -> str:
        """How long it has been held (``age``)."""
        return age(self.since, now)


def age(since: str, now: datetime) -> str:
    """How long since *since* (a lease's), as a person reads it: ``42s``, ``3m12s``, ``2h05m``."""
    try:
        seconds = max(0, int((now - datetime.fromisoformat(since)).total_seconds()))
    except ValueError:
        return "?"
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def timestamp(now: datetime) -> str:
    """*now* as a lease's ``since``."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Ledger:
    """Every lease, in the order they were taken, and the MIG instances gpuhook made that await destruction."""

    leases: tuple[Lease, ...] = ()
    #: instances gpuhook made whose lease has ended: destroyed by whoever ended it, or by the next reclaim
    recycle: tuple[MigRecord, ...] = ()
    #: the MPS control daemons gpuhook runs (one per GPU at most)
    daemons: tuple[MpsDaemon, ...] = ()

    def daemon_for(self, gpu: str) -> MpsDaemon | None:
        """The MPS daemon recorded for the GPU with UUID *gpu*."""
        return next((d for d in self.daemons if d.gpu.casefold() == gpu.casefold()), None)

    def with_daemon(self, daemon: MpsDaemon) -> Ledger:
        """With *daemon* as its GPU's record (replacing an earlier one)."""
        return replace(self, daemons=(*(d for d in self.daemons if d.gpu != daemon.gpu), daemon))

    def without_daemon(self, daemon: MpsDaemon) -> Ledger:
        """With *daemon*'s record gone (it has been stopped)."""
        return replace(self, daemons=tuple(d for d in self.daemons if d != daemon))

    def idle_daemons(self) -> tuple[MpsDaemon, ...]:
        """The daemons no lease holds the GPU of any more: to stop."""
        return tuple(d for d in self.daemons if not self.holding(d.gpu))

    def lease_of(self, container_id: str, holder: Holder) -> Lease | None:
        """The lease of the container *container_id* whose init is *holder*, if it holds one."""
        return next((lease for lease in self.leases if lease.container_id == container_id
                     and lease.holder == holder), None)

    def leases_of(self, container_id: str) -> tuple[Lease, ...]:
        """Every lease under *container_id*: one per container of that id (each its own holder)."""
        return tuple(lease for lease in self.leases if lease.container_id == container_id)

    def holding(self, *devices: str) -> tuple[Lease, ...]:
        """The leases that hold any of *devices* (GPU or MIG UUIDs; matched case-insensitively)."""
        wanted = {device.casefold() for device in devices}
        return tuple(lease for lease in self.leases if any(d.casefold() in wanted for d in lease.devices))

    def holding_mig_on(self, gpu: str) -> tuple[Lease, ...]:
        """The leases with a MIG instance (made, being made or reused) on the GPU with UUID *gpu*."""
        return tuple(lease for lease in self.leases if any(r.gpu.casefold() == gpu.casefold() for r in lease.migs))

    def named(self, gpu: str, name: str) -> Lease | None:
        """The lease holding the instance called *name* on the GPU with UUID *gpu*."""
        return next((lease for lease in self.leases
                     if any(r.name == name and r.gpu.casefold() == gpu.casefold() for r in lease.migs)), None)

    def reserve(self, lease: Lease) -> Ledger:
        """With *lease* added, replacing the earlier lease of the same container id *and* holder (a second start
        stage); a same-id lease of another holder is another container's and stays. The instances gpuhook made
        for the earlier one that *lease* holds again (the second stage finds them free, as an admin's) stay
        gpuhook's, so they are destroyed when it ends."""
        own = self.lease_of(lease.container_id, lease.holder)
        if own is not None:
            made = {r.uuid: r for r in own.migs if r.created and r.uuid}
            lease = replace(lease, migs=tuple(made.get(r.uuid, r) if r.uuid else r for r in lease.migs))
        return self._ending(lambda old: old == own, add=lease)

    def activate(self, container_id: str, holder: Holder) -> Ledger:
        """With *container_id*'s reservation by *holder* active (unchanged if it is not there)."""
        return self._changed(container_id, holder, lambda lease: replace(lease, state=LeaseState.ACTIVE))

    def record_mig(self, container_id: str, holder: Holder, record: MigRecord, *, replacing: MigRecord | None = None
                   ) -> Ledger:
        """With *record* in *container_id*'s lease (in place of *replacing*); a ready one's UUID joins its devices."""
        def change(lease: Lease) -> Lease:
            migs = (*(r for r in lease.migs if r != replacing), record)
            devices = lease.devices + ((record.uuid,) if record.uuid and record.uuid not in lease.devices else ())
            return replace(lease, migs=migs, devices=devices)

        return self._changed(container_id, holder, change)

    def forget_mig(self, container_id: str, holder: Holder, record: MigRecord) -> Ledger:
        """Without *record* in *container_id*'s lease (an instance NVML did not make after all)."""
        return self._changed(container_id, holder, lambda lease: replace(
            lease, migs=tuple(r for r in lease.migs if r != record)))

    def release(self, container_id: str, holder: Holder | None = None) -> Ledger:
        """Without *container_id*'s lease held by *holder* (every lease under that id, when None)."""
        return self._ending(lambda lease: lease.container_id == container_id
                            and (holder is None or lease.holder == holder))

    def stale(self, alive: Callable[[Holder], bool]) -> tuple[Lease, ...]:
        """The leases whose holder no longer runs."""
        return tuple(lease for lease in self.leases if not alive(lease.holder))

    def without(self, leases: tuple[Lease, ...]) -> Ledger:
        """With exactly *leases* removed."""
        return self._ending(lambda lease: lease in leases)

    def recycled(self, record: MigRecord) -> Ledger:
        """With *record* (destroyed, or found gone) out of ``recycle``."""
        return replace(self, recycle=tuple(r for r in self.recycle if r != record))

    def _ending(self, ends: Callable[[Lease], bool], add: Lease | None = None) -> Ledger:
        """Without the leases *ends* picks (the instances gpuhook made for them moved to ``recycle``, but those
        *add* holds), plus *add*."""
        kept = tuple(lease for lease in self.leases if not ends(lease))
        held = add.migs if add is not None else ()
        made = tuple(r for lease in self.leases if ends(lease) for r in lease.migs if r.created and r not in held)
        return replace(self, leases=kept + ((add,) if add is not None else ()), recycle=self.recycle + made)

    def _changed(self, container_id: str, holder: Holder, change: Callable[[Lease], Lease]) -> Ledger:
        return replace(self, leases=tuple(change(lease) if lease.container_id == container_id
                                          and lease.holder == holder else lease for lease in self.leases))


# --- the stored form -------------------------------------------------------------------------------


def to_object(ledger: Ledger) -> dict[str, Any]:
    """JSON-ready."""
    return {"format": FORMAT, "leases": [
        {"container_id": lease.container_id, "devices": list(lease.devices), "pid": lease.holder.pid,
         "start_ticks": lease.holder.start, "since": lease.since, "state": lease.state.value,
         "migs": [_record_object(r) for r in lease.migs]}
        for lease in ledger.leases], "recycle": [_record_object(r) for r in ledger.recycle],
        "daemons": [_daemon_object(d) for d in ledger.daemons]}


def from_object(data: Any, *, source: str) -> Ledger:
    """The ledger *data* (from ``to_object``) describes; raises StateError naming what is wrong.

    ``migs`` and ``recycle`` may be absent (a ledger written before MIG instances were made).
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT or not isinstance(data.get("leases"), list):
        raise StateError(f"{source} is not a format-{FORMAT} lease ledger; {_FIX}")
    leases = []
    for n, item in enumerate(data["leases"]):
        try:
            leases.append(Lease(
                container_id=_typed(item, "container_id", str), devices=tuple(_typed(item, "devices", list)),
                holder=Holder(pid=_typed(item, "pid", int), start=_typed(item, "start_ticks", int)),
                since=_typed(item, "since", str), state=LeaseState(_typed(item, "state", str)),
                migs=tuple(_record(r) for r in item.get("migs", ()))))
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise StateError(f"{source}: lease {n} is malformed ({err}); {_FIX}") from None
        if not all(isinstance(d, str) for d in leases[-1].devices):
            raise StateError(f"{source}: lease {n} has a device that is not a UUID string; {_FIX}")
    try:
        recycle = tuple(_record(r) for r in data.get("recycle", ()))
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise StateError(f"{source}: its recycle list is malformed ({err}); {_FIX}") from None
    try:
        daemons = tuple(_daemon(d) for d in data.get("daemons", ()))
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise StateError(f"{source}: its MPS daemon list is malformed ({err}); {_FIX}") from None
    return Ledger(tuple(leases), recycle, daemons)


def _daemon_object(daemon: MpsDaemon) -> dict[str, Any]:
    holder = daemon.holder
    return {"gpu": daemon.gpu, "pipe_dir": daemon.pipe_dir, "log_dir": daemon.log_dir, "shm_dir": daemon.shm_dir,
            "thread_percentage": daemon.thread_percentage, "memory_limit_mib": daemon.memory_limit_mib,
            "pid": holder.pid if holder else None, "start_ticks": holder.start if holder else None}


def _daemon(item: Any) -> MpsDaemon:
    pid, start = item["pid"], item["start_ticks"]
    if (pid is None) != (start is None):
        raise ValueError("pid and start_ticks must both be set or both be null")
    threads = item["thread_percentage"]
    if isinstance(threads, bool) or not isinstance(threads, int | float):
        raise TypeError(f"thread_percentage is {threads!r}")
    return MpsDaemon(gpu=_typed(item, "gpu", str), pipe_dir=_typed(item, "pipe_dir", str),
                     log_dir=_typed(item, "log_dir", str), shm_dir=_typed(item, "shm_dir", str),
                     thread_percentage=float(threads), memory_limit_mib=_typed(item, "memory_limit_mib", int),
                     holder=None if pid is None else Holder(pid=_typed(item, "pid", int),
                                                            start=_typed(item, "start_ticks", int)))


_OPTIONAL_INT: Final = (int, type(None))
_RECORD_FIELDS: Final[dict[str, type | tuple[type, ...]]] = {
    "gpu": str, "profile": str, "name": (str, type(None)), "created": bool, "state": str, "profile_id": _OPTIONAL_INT,
    "placement": _OPTIONAL_INT, "gi": _OPTIONAL_INT, "ci": _OPTIONAL_INT, "uuid": (str, type(None))}


def _record_object(record: MigRecord) -> dict[str, Any]:
    return {key: getattr(record, key) for key in _RECORD_FIELDS} | {"state": record.state.value}


def _record(item: Any) -> MigRecord:
    values: dict[str, Any] = {}
    for key, kind in _RECORD_FIELDS.items():
        value = item[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise TypeError(f"{key} is {value!r}")
        values[key] = value
    return MigRecord(**(values | {"state": MigState(values["state"])}))


_FIX = "it is gpuhook's own file: remove it to start afresh (leases of running containers are then forgotten)"


def _typed(item: Any, key: str, kind: type) -> Any:
    value = item[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key} is {value!r}")
    return value
