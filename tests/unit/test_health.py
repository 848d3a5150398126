"""GPU health: critical Xids from the kernel log, NVML's memory-repair state, and the policy."""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuhook.discovery import health
from gpuhook.discovery.health import parse_xids, read_xids
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


# --- gpuhookd reads the kernel log once (XidLog) -------------------------------------------------------------

#: the kernel's log (Documentation/admin-guide/devices.txt: char 1:11)
KMSG = os.makedev(1, 11)


@pytest.fixture
def kernel_log_root(tmp_path: Path) -> Iterator[Path]:
    """A dev root whose dev/kmsg is the kernel's own log (this machine's); no log shared after the test."""
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev" / "kmsg", 0o600 | stat.S_IFCHR, KMSG)
    try:
        yield tmp_path
    finally:
        health.share(None)


def _log_xid(xid: int) -> str:
    """An Xid record as the driver writes it, for a bus no simulated GPU has (domain fffe, random bus and
    device), appended to this machine's kernel log; its bus key."""
    bus = f"fffe:{random.randrange(256):02x}:{random.randrange(32):02x}"
    with open("/dev/kmsg", "wb", buffering=0) as kmsg:  # root may append records to the kernel log
        kmsg.write(f"<4>gpuhook test: NVRM: Xid (PCI:{bus}): {xid}, pid=0, from tests/unit/test_health.py\n".encode())
    return bus_key(bus)


def test_the_pool_reads_each_record_once_and_every_process_sees_every_xid(kernel_log_root: Path) -> None:
    """The ring as it was when the log was opened; a record read by a forked process (the log's read position
    is one for all of them) is still known to the process that forked it; application Xids are left out."""
    before = _log_xid(79)
    log = health.XidLog(kernel_log_root)
    assert (before, 79) in log.read_new()
    after, application = _log_xid(48), _log_xid(13)
    child = os.fork()
    if child == 0:  # a worker: it reads the new records first
        seen = log.read_new()
        os._exit(0 if (after, 48) in seen and (before, 79) in seen else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    seen = log.read_new()  # the records are the child's now: what it found was kept for us
    assert (after, 48) in seen and (before, 79) in seen
    assert not any(bus == application for bus, _ in seen)


def test_read_xids_asks_the_shared_log_of_its_dev_root_only(kernel_log_root: Path, tmp_path: Path) -> None:
    """Shared (as gpuhookd does), the log answers for its dev_root, and where it fails the ring is read whole;
    any other dev_root's log is read whole; a regular file (a simulated host's) is no log to follow."""
    bus = _log_xid(79)
    log = health.XidLog(kernel_log_root)
    health.share(log)
    assert (bus, 79) in read_xids(kernel_log_root)
    os.close(log.fileno())  # a log that cannot be read any more: the start reads the whole ring instead
    assert (bus, 79) in read_xids(kernel_log_root)
    with pytest.raises(OSError):
        log.read_new()
    simulated = tmp_path / "simulated"
    (simulated / "dev").mkdir(parents=True)
    (simulated / "dev" / "kmsg").write_text(LOG)
    assert read_xids(simulated) == (("0:19:00", 79), ("1:1a:00", 48))
    with pytest.raises(ValueError, match="is not a character device"):
        health.XidLog(simulated)
