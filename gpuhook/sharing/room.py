"""Who holds each device, and whether it has room under its GPU's policy (the other containers' leases only).

A GPU's holders are the containers that hold it whole or a MIG instance on it (made, being
made, or reused); a MIG device's are those that hold it or its parent whole. A device has room
while its holders are fewer than its policy's limit (exclusive 1, shared/mps ``replicas``,
unlimited none). A new MIG instance is held by nobody yet, so only its parent's whole holders
count against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from gpuhook.inventory import Gpu, Inventory, MigDevice
from gpuhook.sharing.ledger import Lease, Ledger
from gpuhook.sharing.policy import GpuPolicy


class Room:
    """Holders and room of each device under the policies."""

    __slots__ = ("inventory", "ledger", "now", "policies")

    def __init__(self, inventory: Inventory, policies: Mapping[int, GpuPolicy], ledger: Ledger, now: datetime) -> None:
        self.inventory = inventory
        self.policies = policies
        self.ledger = ledger
        self.now = now

    def gpu_holders(self, gpu: Gpu) -> tuple[Lease, ...]:
        """Who holds *gpu* whole or a MIG instance on it."""
        holding = self.ledger.holding(gpu.uuid, *(m.uuid for m in self.inventory.mig_devices
                                                  if m.parent_index == gpu.index))
        return holding + tuple(lease for lease in self.ledger.holding_mig_on(gpu.uuid) if lease not in holding)

    def whole_holders(self, gpu: Gpu) -> tuple[Lease, ...]:
        """Who holds *gpu* whole."""
        return self.ledger.holding(gpu.uuid)

    def mig_holders(self, mig: MigDevice, parent: Gpu) -> tuple[Lease, ...]:
        """Who holds *mig*, or its parent whole."""
        return self.ledger.holding(mig.uuid, parent.uuid)

    def gpu_has_room(self, gpu: Gpu) -> bool:
        return self._below_limit(gpu, self.gpu_holders(gpu))

    def mig_has_room(self, mig: MigDevice, parent: Gpu) -> bool:
        return self._below_limit(parent, self.mig_holders(mig, parent))

    def new_mig_has_room(self, gpu: Gpu) -> bool:
        """Whether a new MIG instance on *gpu* may be held (its whole holders are below the limit)."""
        return self._below_limit(gpu, self.whole_holders(gpu))

    def describe_gpu(self, gpu: Gpu) -> str:
        policy = self.policies[gpu.index].describe()
        return f"GPU {gpu.index} ({gpu.uuid}) is {policy}, {self.held(self.gpu_holders(gpu))}"

    def describe_mig(self, mig: MigDevice, parent: Gpu) -> str:
        policy = self.policies[parent.index].describe()
        return f"MIG device {mig.uuid} (on GPU {parent.index}, {policy}) is {self.held(self.mig_holders(mig, parent))}"

    def held(self, leases: Sequence[Lease]) -> str:
        return held_by(leases, self.now)

    def _below_limit(self, gpu: Gpu, holders: Sequence[Lease]) -> bool:
        limit = self.policies[gpu.index].limit
        return limit is None or len(holders) < limit


def held_by(leases: Sequence[Lease], now: datetime) -> str:
    """``held by ID (pid P, for 3m12s), ...``."""
    holders = ", ".join(f"{lease.container_id} (pid {lease.holder.pid}, for {lease.age(now)})" for lease in leases)
    return f"held by {holders}"
