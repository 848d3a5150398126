"""Leases taken, kept and given back: the ledger store's transactions, with the host's liveness check.

Each function is one transaction (``ledger_store.update``): the pure decision is
``sharing``'s, the host facts (is a holder still running?) are read here. Every transaction
that takes a lease first reclaims those whose holder is gone, so a container that died without
a poststop (docker ``--gpus`` runs none) frees its GPUs at the next start at the latest.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gpuhook.errors import GpuHookError, SpecError
from gpuhook.inventory import Inventory
from gpuhook.provision import ledger_store
from gpuhook.request.model import GpuRequest
from gpuhook.sharing.allocate import Allocation, allocate
from gpuhook.sharing.ledger import Holder, Lease, Ledger, timestamp
from gpuhook.sharing.policy import GpuPolicy
from gpuhook.sys.procstat import start_ticks


@dataclass(frozen=True, slots=True, kw_only=True)
class Taken:
    """A start's allocation, and the leases of gone holders that its transaction reclaimed."""

    allocation: Allocation
    reclaimed: tuple[Lease, ...]
    #: MIG instances gpuhook made await destruction, or MPS daemons whose GPU nobody holds await their quit
    to_recycle: bool = False


def alive(holder: Holder) -> bool:
    """Whether *holder* still runs: its pid exists, is no zombie, and started when the lease says."""
    return start_ticks(holder.pid) == holder.start


def holder_of(pid: int, pidfd: int) -> Holder:
    """The container's init as a lease names it; *pidfd* (opened on *pid* first) proves the start time is its own."""
    ticks = start_ticks(pid)
    try:
        signal.pidfd_send_signal(pidfd, 0)  # still the process the pidfd pins, so /proc/PID was its
    except OSError:
        ticks = None
    if ticks is None:
        raise SpecError(f"the container's init (pid {pid}) exited during its start")
    return Holder(pid=pid, start=ticks)


def take(state_dir: Path, request: GpuRequest, inventory: Inventory, policies: Mapping[int, GpuPolicy], *,
         container_id: str, holder: Holder, unhealthy: Mapping[int, str]) -> Taken:
    """Reclaim, allocate and reserve *request*'s devices for *container_id*, in one transaction.

    Raises what ``allocate`` raises (after the reclaim is written: a refusal still frees the gone
    holders' GPUs). A request for no device (``none``) takes no lease.
    """
    now = datetime.now(UTC)

    def change(ledger: Ledger) -> tuple[Ledger, tuple[Taken | GpuHookError, tuple[Lease, ...]]]:
        stale = ledger.stale(alive)
        ledger = ledger.without(stale)
        try:
            allocation = allocate(request, inventory, policies, ledger, container_id=container_id, holder=holder,
                                  now=now, unhealthy=unhealthy)
        except GpuHookError as err:
            return ledger, (err, stale)
        if allocation.devices or allocation.to_make:
            ledger = ledger.reserve(Lease(container_id=container_id, devices=allocation.devices, holder=holder,
                                          since=timestamp(now), migs=allocation.migs))
        # what the gone holders leave to undo (their MIG instances, the MPS daemons nobody holds now)
        taken = Taken(allocation=allocation, reclaimed=stale, to_recycle=bool(ledger.recycle or ledger.idle_daemons()))
        return ledger, (taken, stale)

    outcome, _ = ledger_store.update(state_dir, change)
    if isinstance(outcome, GpuHookError):
        raise outcome
    return outcome


def activate(state_dir: Path, container_id: str, holder: Holder) -> None:
    """The container's devices are granted: its reservation becomes an active lease."""
    ledger_store.update(state_dir, lambda ledger: (ledger.activate(container_id, holder), None))


def drop(state_dir: Path, container_id: str, holder: Holder) -> None:
    """The start failed: give back what it reserved (only its own: same container, same holder)."""
    ledger_store.update(state_dir, lambda ledger: (ledger.release(container_id, holder), None))


def release_if_gone(state_dir: Path, container_id: str) -> tuple[tuple[Lease, ...], tuple[Lease, ...]]:
    """poststop and a holder's exit: (the leases under *container_id* released, those kept because their holder
    still runs). The OCI state at poststop names no live process, so the holder's liveness tells the
    containers of one id apart: the stopped one's is gone, a running one's (another runc root's, say) is not."""

    def change(ledger: Ledger) -> tuple[Ledger, tuple[tuple[Lease, ...], tuple[Lease, ...]]]:
        leases = ledger.leases_of(container_id)
        gone = tuple(lease for lease in leases if not alive(lease.holder))
        return ledger.without(gone), (gone, tuple(lease for lease in leases if lease not in gone))

    return ledger_store.update(state_dir, change)


def release(state_dir: Path, container_id: str) -> tuple[Lease, ...]:
    """``gpuhook release``: drop every lease under *container_id* whatever its holder does; the leases dropped."""
    return ledger_store.update(state_dir, lambda ledger: (ledger.release(container_id),
                                                          ledger.leases_of(container_id)))


def reclaim(state_dir: Path) -> tuple[Ledger, tuple[Lease, ...]]:
    """The ledger without the leases whose holder is gone, written; (that ledger, the leases reclaimed)."""

    def change(ledger: Ledger) -> tuple[Ledger, tuple[Ledger, tuple[Lease, ...]]]:
        stale = ledger.stale(alive)
        after = ledger.without(stale)
        return after, (after, stale)

    return ledger_store.update(state_dir, change)

