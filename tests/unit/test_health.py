"""GPU health: critical Xids from the kernel log, NVML's memory-repair state, and the policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuhook.discovery.health import parse_xids
from gpuhook.inventory import Inventory, LiveFacts, bus_key
from gpuhook.planning.health import HealthPolicy, UnhealthyGpuError, check_health

from .test_planner import _fields, _gpu, inventory

LOG = (
    "6,100,5,-;nvidia: module loaded\n"
    "4,101,6,-;NVRM: Xid (PCI:0000:18:00): 13, pid=42, name=python, Graphics Exception\n"
    "3,102,7,-;NVRM: Xid (PCI:0000:19:00): 79, pid=0, GPU has fallen off the bus.\n"
    "3,103,8,-;NVRM: Xid (PCI:0000:19:00): 79, pid=0, GPU has fallen off the bus.\n"
    "3,104,9,-;NVRM: Xid (PCI:0001:1A:00): 48, pid=7, An uncorrectable double bit error\n"
)


def test_critical_xids_are_found_per_bus() -> None:
    """Application Xids (13) are ignored; repeats collapse; bus ids of either form compare equal."""
    assert parse_xids(LOG) == (("0:19:00", 79), ("1:1a:00", 48))
    assert bus_key("00000000:19:00.0") == bus_key("0000:19:00") == "0:19:00"
    assert bus_key("00000001:1A:00.0") == "1:1a:00"


def _host() -> Inventory:
    """GPU 3 has pending retired pages (NVML's answer, cached)."""
    inv = inventory()
    gpus = (*inv.gpus[:3], replace(inv.gpus[3], health=("retired memory pages are pending",)))
    return Inventory(**{**_fields(inv), "gpus": gpus})


#: GPU 2 (bus 0x19) had Xid 79: read from the kernel log at the start, never cached
LIVE = LiveFacts(xid_errors=parse_xids(LOG))


def test_refuse_names_the_gpu_and_the_problem() -> None:
    """Under refuse, a selected unhealthy GPU refuses the container with what is wrong and the fix."""
    host = _host()
    with pytest.raises(UnhealthyGpuError, match=r"GPU 2 .* critical Xid 79 in the kernel log.*nvidia-smi -r"):
        check_health((host.gpus[2],), LIVE, HealthPolicy.REFUSE)
    with pytest.raises(UnhealthyGpuError, match="retired memory pages are pending"):
        check_health((host.gpus[3],), LIVE, HealthPolicy.REFUSE)
    assert check_health((host.gpus[0], host.gpus[1]), LIVE, HealthPolicy.REFUSE) == ()


def test_warn_and_ignore() -> None:
    """warn returns one warning per unhealthy GPU; ignore looks at nothing."""
    host = _host()
    warnings = check_health(host.gpus, LIVE, HealthPolicy.WARN)
    assert len(warnings) == 2 and "used anyway" in warnings[0]
    assert check_health(host.gpus, LIVE, HealthPolicy.IGNORE) == ()
    assert _gpu(0).health == ()
