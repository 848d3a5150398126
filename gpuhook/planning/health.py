"""Refuse (or warn about) selected GPUs that are unhealthy: critical Xids and pending memory repairs."""

from __future__ import annotations

import enum

# defined in errors, as every error is (so that any process rebuilds it); imported from here too
from gpuhook.errors import UnhealthyGpuError
from gpuhook.inventory import Gpu, LiveFacts, bus_key


class HealthPolicy(enum.StrEnum):
    """What a selected unhealthy GPU does to a start (config ``unhealthy_gpus``, the YAML takes the values)."""

    #: the container is refused, naming the GPU, the problem and the fix
    REFUSE = "refuse"
    #: the container gets the GPU; the problems become the plan's warnings
    WARN = "warn"
    #: health is not looked at (nor is the kernel log read for Xids)
    IGNORE = "ignore"


def problems(gpu: Gpu, live: LiveFacts) -> list[str]:
    """Everything known to be wrong with *gpu*: its Xids in the kernel log now, and NVML's memory findings."""
    key = bus_key(gpu.pci_bus_id)
    xids = [xid for bus, xid in live.xid_errors if bus == key]
    found = list(gpu.health)
    if xids:
        found.insert(0, f"critical Xid {', '.join(map(str, xids))} in the kernel log")
    return found


def check_health(gpus: tuple[Gpu, ...], live: LiveFacts, policy: HealthPolicy) -> tuple[str, ...]:
    """Raise UnhealthyGpuError under REFUSE; under WARN return the problems as warnings."""
    if policy == HealthPolicy.IGNORE:
        return ()
    warnings = []
    for gpu in gpus:
        found = problems(gpu, live)
        if not found:
            continue
        what = f"GPU {gpu.index} ({gpu.uuid}, {gpu.pci_bus_id})"
        if policy == HealthPolicy.REFUSE:
            raise UnhealthyGpuError(
                f"{what} is unhealthy: {'; '.join(found)}. Fix: select another GPU, reset this one "
                "(nvidia-smi -r) or drain the node; an Xid counts while the kernel log holds it (under gpuhookd, "
                "until gpuhookd restarts): `unhealthy_gpus: warn` lets containers use it anyway"
            )
        warnings.append(f"{what} is unhealthy, used anyway: {'; '.join(found)}")
    return tuple(warnings)
