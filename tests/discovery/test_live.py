"""The live facts: the MIG layout parsed from capability paths, and read_live reading only what a start needs."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from gpuhook.config import Config
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.discovery.live import parse_mig_layout, read_live, read_mig_layout
from gpuhook.inventory import LiveFacts, LiveNeeds, MigInstance, bus_key
from integration.fakehost import FakeHost, create_host

#: ``find /proc/driver/nvidia/capabilities -type f`` on a MIG host, relative, with what else the driver puts there
LISTING = """\
fabric-imex-mgmt
mig/config
mig/monitor
gpu0/mig/gi1/access
gpu0/mig/gi1/ci0/access
gpu0/mig/gi1/ci1/access
gpu0/mig/gi2/access
gpu3/mig/gi13/ci7/access
gpu0/mig/gi1/ci0/access.bak
gpu0/mig/gix/ci0/access
gpu0/gi1/ci0/access
"""


def _config(root: Path) -> Config:
    """A config pointing every root at *root*."""
    return Config(driver_root=root, dev_root=root, proc_root=root, log_file=None)


def test_compute_instances_are_the_mig_devices() -> None:
    """Each gi<G>/ci<C>/access is one MIG device; a GPU instance without a compute instance, and strays, are not."""
    assert parse_mig_layout(LISTING.splitlines()) == {
        MigInstance(gpu_minor=0, gi=1, ci=0), MigInstance(gpu_minor=0, gi=1, ci=1),
        MigInstance(gpu_minor=3, gi=13, ci=7),
    }


def test_nothing_listed_is_no_layout() -> None:
    """No capability files (MIG off, or no driver): no instances."""
    assert parse_mig_layout([]) == frozenset()
    assert parse_mig_layout(["mig/config", "mig/monitor"]) == frozenset()


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """2 GPUs, GPU 0 with a 3g and a 1g instance; GPU 1 had Xid 79."""
    return create_host(tmp_path_factory.mktemp("live") / "host", gpus=2, mig={0: ("3g.40gb", "1g.10gb")},
                       unhealthy={1: ("xid:79",)})


def test_layout_read_from_the_proc_root(mig_host: FakeHost, host: FakeHost, tmp_path: Path) -> None:
    """The simulated driver's instances, exactly; a host without MIG, or without a driver, has none."""
    expected = {MigInstance(gpu_minor=d.parent_minor, gi=d.gi, ci=d.ci) for d in mig_host.mig_devices}
    assert read_mig_layout(mig_host.root) == expected and len(expected) == 2
    assert read_mig_layout(host.root) == frozenset()
    assert read_mig_layout(tmp_path) == frozenset()


def test_the_inventory_remembers_the_layout_nvml_was_asked_about(mig_host: FakeHost) -> None:
    """HostDiscoverer keeps the layout it saw, so an instance NVML did not report is not asked about at every start."""
    inventory = HostDiscoverer(_config(mig_host.root)).discover()
    assert inventory.mig_layout == tuple(sorted(read_mig_layout(mig_host.root)))


def test_a_start_reads_only_what_it_needs(mig_host: FakeHost) -> None:
    """LiveNeeds() reads nothing; each need reads its own facts from the dev and proc roots."""
    config = _config(mig_host.root)
    assert read_live(config, LiveNeeds()) == LiveFacts()
    mig = read_live(config, LiveNeeds(mig=True))
    assert mig.mig_instances == read_mig_layout(mig_host.root) and not mig.extra_nodes and not mig.xid_errors
    minors = {1, 2, *(m for d in mig_host.mig_devices for m in (d.gi_cap_minor, d.ci_cap_minor))}
    assert {(n.name, n.major, n.minor) for n in mig.caps_nodes} == {
        (f"nvidia-caps/nvidia-cap{m}", mig_host.caps_major, m) for m in minors}
    extra = read_live(config, LiveNeeds(extra_nodes=True))
    names = {n.name for n in extra.extra_nodes}
    assert {f"nvidia-caps-imex-channels/channel{c}" for c in mig_host.imex_channels} <= names
    assert {name for name, _, _ in mig_host.gated_nodes} <= names and extra.mig_instances is None
    xids = read_live(config, LiveNeeds(xids=True))
    assert xids.xid_errors == ((bus_key(mig_host.gpus[1].pci_bus_id), 79),) and not xids.caps_nodes


def test_caps_nodes_follow_the_dev_root(mig_host: FakeHost, tmp_path: Path) -> None:
    """Capability nodes come from dev_root, the layout from proc_root: each root is read where it is configured."""
    (tmp_path / "dev/nvidia-caps").mkdir(parents=True)
    os.mknod(tmp_path / "dev/nvidia-caps/nvidia-cap1", stat.S_IFCHR | 0o600, os.makedev(mig_host.caps_major, 1))
    live = read_live(replace(_config(mig_host.root), dev_root=tmp_path), LiveNeeds(mig=True))
    assert [n.host_path for n in live.caps_nodes] == [tmp_path / "dev/nvidia-caps/nvidia-cap1"]
    assert live.mig_instances == read_mig_layout(mig_host.root)
