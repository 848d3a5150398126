"""Refuse (or warn about) selected GPUs that are unhealthy: critical Xids and pending memory repairs."""

from __future__ import annotations

from gpuhook.errors import RequestError
from gpuhook.inventory import Gpu, Inventory, bus_key


class UnhealthyGpuError(RequestError):
    """A selected GPU is not fit to run work."""


def problems(gpu: Gpu, inventory: Inventory) -> list[str]:
    """Everything known to be wrong with *gpu*."""
    key = bus_key(gpu.pci_bus_id)
    xids = [xid for bus, xid in inventory.xid_errors if bus == key]
    found = list(gpu.health)
    if xids:
        found.insert(0, f"critical Xid {', '.join(map(str, xids))} in the kernel log")
    return found


def check_health(gpus: tuple[Gpu, ...], inventory: Inventory, policy: str) -> tuple[str, ...]:
    """Raise UnhealthyGpuError under "refuse"; under "warn" return the problems as warnings."""
    if policy == "ignore":
        return ()
    warnings = []
    for gpu in gpus:
        found = problems(gpu, inventory)
        if not found:
            continue
        what = f"GPU {gpu.index} ({gpu.uuid}, {gpu.pci_bus_id})"
        if policy == "refuse":
            raise UnhealthyGpuError(
                f"{what} is unhealthy: {'; '.join(found)}. Fix: select another GPU, reset this one "
                "(nvidia-smi -r) or drain the node; `unhealthy_gpus: warn` lets containers use it anyway"
            )
        warnings.append(f"{what} is unhealthy, used anyway: {'; '.join(found)}")
    return tuple(warnings)
