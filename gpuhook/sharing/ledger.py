"""The lease ledger as a value: who holds which GPU (or MIG device), since when, and in which state.

A lease names its container (the OCI id), the devices it holds (GPU and MIG UUIDs), and its
holder: the container's init as a pid *and* that process's start time, so that a pid the
kernel hands to another process never keeps a lease. Transitions return a new ledger:
``reserve`` (before anything is changed in the container) → ``activate`` (the start held) →
``release``; ``stale`` lists the leases whose holder is gone, with the liveness check passed in.
The store (a file written atomically under a lock) is ``provision.ledger_store``'s.
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
    #: the start held: the container runs with these devices
    ACTIVE = "active"


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class Holder:
    """A process as a lease knows it: its pid and its start time (clock ticks after boot, /proc/PID/stat)."""

    pid: int
    start: int


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
    """Every lease, in the order they were taken."""

    leases: tuple[Lease, ...] = ()

    def lease_of(self, container_id: str) -> Lease | None:
        """*container_id*'s lease, if it holds one."""
        return next((lease for lease in self.leases if lease.container_id == container_id), None)

    def holding(self, *devices: str) -> tuple[Lease, ...]:
        """The leases that hold any of *devices* (GPU or MIG UUIDs; matched case-insensitively)."""
        wanted = {device.casefold() for device in devices}
        return tuple(lease for lease in self.leases if any(d.casefold() in wanted for d in lease.devices))

    def reserve(self, lease: Lease) -> Ledger:
        """With *lease* added, replacing an earlier lease of the same container (a second start stage; gone
        holders' leases are reclaimed first, so an earlier one is this container's own)."""
        return Ledger((*(old for old in self.leases if old.container_id != lease.container_id), lease))

    def activate(self, container_id: str, holder: Holder) -> Ledger:
        """With *container_id*'s reservation by *holder* active (unchanged if it is not there)."""
        return Ledger(tuple(replace(lease, state=LeaseState.ACTIVE)
                            if lease.container_id == container_id and lease.holder == holder else lease
                            for lease in self.leases))

    def release(self, container_id: str, holder: Holder | None = None) -> Ledger:
        """Without *container_id*'s lease (only if *holder* holds it, when given)."""
        return Ledger(tuple(lease for lease in self.leases
                            if lease.container_id != container_id or (holder is not None and lease.holder != holder)))

    def stale(self, alive: Callable[[Holder], bool]) -> tuple[Lease, ...]:
        """The leases whose holder no longer runs."""
        return tuple(lease for lease in self.leases if not alive(lease.holder))

    def without(self, leases: tuple[Lease, ...]) -> Ledger:
        """With exactly *leases* removed."""
        return Ledger(tuple(lease for lease in self.leases if lease not in leases))


# --- the stored form -------------------------------------------------------------------------------


def to_object(ledger: Ledger) -> dict[str, Any]:
    """JSON-ready."""
    return {"format": FORMAT, "leases": [
        {"container_id": lease.container_id, "devices": list(lease.devices), "pid": lease.holder.pid,
         "start_ticks": lease.holder.start, "since": lease.since, "state": lease.state.value}
        for lease in ledger.leases]}


def from_object(data: Any, *, source: str) -> Ledger:
    """The ledger *data* (from ``to_object``) describes; raises StateError naming what is wrong."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT or not isinstance(data.get("leases"), list):
        raise StateError(f"{source} is not a format-{FORMAT} lease ledger; {_FIX}")
    leases = []
    for n, item in enumerate(data["leases"]):
        try:
            leases.append(Lease(
                container_id=_typed(item, "container_id", str), devices=tuple(_typed(item, "devices", list)),
                holder=Holder(pid=_typed(item, "pid", int), start=_typed(item, "start_ticks", int)),
                since=_typed(item, "since", str), state=LeaseState(_typed(item, "state", str))))
        except (TypeError, ValueError, KeyError) as err:
            raise StateError(f"{source}: lease {n} is malformed ({err}); {_FIX}") from None
        if not all(isinstance(d, str) for d in leases[-1].devices):
            raise StateError(f"{source}: lease {n} has a device that is not a UUID string; {_FIX}")
    return Ledger(tuple(leases))


_FIX = "it is gpuhook's own file: remove it to start afresh (leases of running containers are then forgotten)"


def _typed(item: Any, key: str, kind: type) -> Any:
    value = item[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key} is {value!r}")
    return value
