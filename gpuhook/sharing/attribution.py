"""Who uses which GPU, as metrics show it: the GPUs with their policy and holders, each lease's devices, the
MIG instances, and the GPU memory of each container's processes. Pure: the inputs are read elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuhook.inventory import Inventory
from gpuhook.sharing.ledger import Ledger
from gpuhook.sharing.policy import GpuPolicy, Sharing


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuUse:
    """One GPU: its identity, policy, the containers holding it, whether its MPS daemon runs (None: not MPS)."""

    index: int
    uuid: str
    model: str
    sharing: str
    holders: tuple[str, ...]
    mps_up: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasedDevice:
    """One device of one lease: the GPU (whole: mig_uuid ""), or a MIG device on it."""

    container_id: str
    gpu: int
    uuid: str
    mig_uuid: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess:
    """A process NVML lists on a GPU (or on a MIG device of it), with the memory it uses, and its cgroup."""

    gpu: int
    pid: int
    used_bytes: int
    #: its cgroup path (/proc/PID/cgroup's, the first hierarchy gpuhook reads)
    cgroup: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageView:
    """What the metrics show of the host now."""

    gpus: tuple[GpuUse, ...]
    leases: tuple[LeasedDevice, ...]
    #: (GPU index, profile, made by gpuhook) → how many MIG devices
    mig_instances: Mapping[tuple[int, str, bool], int]
    #: (container id, GPU index) → bytes its processes use
    memory: Mapping[tuple[str, int], int]


def usage_view(inventory: Inventory, policies: Mapping[int, GpuPolicy], ledger: Ledger, *,
               mps_up: Mapping[str, bool], processes: Sequence[GpuProcess],
               holder_cgroups: Mapping[str, str]) -> UsageView:
    """The view of *inventory*'s GPUs under *policies* and *ledger*.

    *mps_up*: GPU UUID → whether gpuhook's MPS daemon for it runs; *holder_cgroups*: container id →
    its init's cgroup path, which a process belongs to when its own cgroup is that or below it.
    """
    parent_of = {m.uuid.casefold(): m.parent_index for m in inventory.mig_devices}
    by_uuid = {g.uuid.casefold(): g for g in inventory.gpus}
    leased: list[LeasedDevice] = []
    #: GPU index → one container id per lease on it: two containers of one id (other runc roots) are two holders
    holders: dict[int, list[str]] = {}
    for lease in ledger.leases:
        first = len(leased)
        for device in lease.devices:
            key = device.casefold()
            if key in by_uuid:
                leased.append(LeasedDevice(container_id=lease.container_id, gpu=by_uuid[key].index,
                                           uuid=by_uuid[key].uuid, mig_uuid=""))
            elif key in parent_of:
                parent = inventory.gpus[parent_of[key]]
                leased.append(LeasedDevice(container_id=lease.container_id, gpu=parent.index, uuid=parent.uuid,
                                           mig_uuid=device))
        for index in dict.fromkeys(d.gpu for d in leased[first:]):
            holders.setdefault(index, []).append(lease.container_id)
    gpus = tuple(GpuUse(index=g.index, uuid=g.uuid, model=g.model, sharing=policies[g.index].sharing.value,
                        holders=tuple(holders.get(g.index, ())),
                        mps_up=mps_up.get(g.uuid, False if policies[g.index].sharing is Sharing.MPS else None))
                 for g in inventory.gpus)
    made = {r.uuid.casefold() for lease in ledger.leases for r in lease.migs if r.created and r.uuid}
    made |= {r.uuid.casefold() for r in ledger.recycle if r.uuid}
    mig: dict[tuple[int, str, bool], int] = {}
    for mig_device in inventory.mig_devices:
        kind = (mig_device.parent_index, mig_device.profile or "?", mig_device.uuid.casefold() in made)
        mig[kind] = mig.get(kind, 0) + 1
    memory: dict[tuple[str, int], int] = {}
    for process in processes:
        owner = _owner(process.cgroup, holder_cgroups)
        if owner is not None:
            memory[(owner, process.gpu)] = memory.get((owner, process.gpu), 0) + process.used_bytes
    return UsageView(gpus=gpus, leases=tuple(leased), mig_instances=mig, memory=memory)


def _owner(cgroup: str, holder_cgroups: Mapping[str, str]) -> str | None:
    """The container whose init's cgroup is *cgroup* or its closest parent (None: no container's)."""
    best: tuple[int, str] | None = None
    for container_id, root in holder_cgroups.items():
        inside = root not in ("", "/") and (cgroup == root or cgroup.startswith(root.rstrip("/") + "/"))
        if inside and (best is None or len(root) > best[0]):
            best = (len(root), container_id)
    return best[1] if best else None
