"""Who uses the GPUs now: NVML's running-process lists and the processes' cgroups (the metrics side only).

Never called on a container start: NVML's process lists cost an NVML session each time.
"""

from __future__ import annotations

from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Inventory
from gpuhook.sharing.attribution import GpuProcess


def gpu_processes(inventory: Inventory) -> tuple[GpuProcess, ...]:
    """Every process NVML lists on the inventory's GPUs, with its cgroup (none when NVML cannot say)."""
    from gpuhook.nvml.facts import running_processes

    library = inventory.nvml_library()
    if library is None:
        return ()
    try:
        listed = running_processes(library)
    except DiscoveryError:
        return ()
    return tuple(GpuProcess(gpu=index, pid=pid, used_bytes=used, cgroup=cgroup)
                 for index, pid, used in listed if (cgroup := cgroup_of(pid)) is not None)


def cgroup_of(pid: int) -> str | None:
    """The process's cgroup path: the unified hierarchy's, else the pids controller's, else the first."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            lines = [line.rstrip("\n").split(":", 2) for line in handle if line.count(":") >= 2]
    except OSError:
        return None
    for wanted in ("", "pids"):
        for _hierarchy, controllers, path in lines:
            if controllers == wanted or wanted in controllers.split(","):
                return path
    return lines[0][2] if lines else None
