"""HostDiscoverer against the simulated host, reached only through its roots."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from gpuhook.config import Config
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.errors import DiscoveryError
from integration.fakehost import FakeHost


def _config(root: Path) -> Config:
    """A config pointing every root at *root*."""
    return Config(driver_root=root, dev_root=root, proc_root=root, log_file=None)


def test_inventory_matches_the_host(host: FakeHost) -> None:
    """NVML facts, versioned libraries, binaries, firmware, sockets and nodes are all found."""
    inv = HostDiscoverer(_config(host.root)).discover()
    assert (inv.driver_version, inv.cuda_version) == (host.driver_version, host.cuda_version)
    assert [(g.index, g.uuid, g.minor, g.pci_bus_id) for g in inv.gpus] == [
        (g.index, g.uuid, g.minor, g.pci_bus_id) for g in host.gpus]
    names = {f.name for f in inv.libraries}
    assert f"libcuda.so.{host.driver_version}" in names and f"libnvidia-ml.so.{host.driver_version}" in names
    assert all(f.host_path.is_file() and f.host_path.is_relative_to(host.root) for f in inv.libraries)
    assert {"nvidia-smi", "nvidia-cuda-mps-control"} <= {f.name for f in inv.binaries}
    assert len(inv.firmware) == 2 and [f.name for f in inv.ipc] == ["/run/nvidia-persistenced/socket"]
    expected = [(f"nvidia{g.minor}", 195, g.minor) for g in host.gpus]
    assert [(n.name, n.major, n.minor) for n in inv.gpu_nodes] == expected
    assert {(n.name, n.major) for n in inv.control_nodes} >= {("nvidiactl", 195), ("nvidia-uvm", host.uvm_major)}
    assert inv.proc_driver is not None and len(inv.proc_driver.gpu_dirs) == 4


def test_driver_root_without_ld_so_cache(host: FakeHost, tmp_path: Path) -> None:
    """A driver folder without etc/ld.so.cache (like /usr/local/nvidia) is searched in its lib dirs."""
    root = tmp_path / "driver"
    for part in ("usr", "lib", "etc"):
        shutil.copytree(host.root / part, root / part, symlinks=True)
    (root / "etc/ld.so.cache").unlink()
    inv = HostDiscoverer(replace(_config(host.root), driver_root=root)).discover()
    assert f"libcuda.so.{host.driver_version}" in {f.name for f in inv.libraries}
    assert len(inv.gpus) == 4


def test_missing_driver_says_what_to_check(tmp_path: Path) -> None:
    """An empty driver root is a DiscoveryError naming the root."""
    with pytest.raises(DiscoveryError, match=f"libnvidia-ml.so.1 not found under driver root {tmp_path}"):
        HostDiscoverer(_config(tmp_path)).discover()


def test_stale_uvm_node_is_refused(host: FakeHost, tmp_path: Path) -> None:
    """A /dev/nvidia-uvm whose major is not the driver's is stale: refused with the fix."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for node in host.root.joinpath("dev").iterdir():
        if node.is_dir():
            continue  # nvidia-caps-imex-channels/, infiniband/: not needed here
        st = node.lstat()
        rdev = os.makedev(host.uvm_major + 1, 0) if node.name == "nvidia-uvm" else st.st_rdev
        os.mknod(dev / node.name, st.st_mode, rdev)
    config = replace(_config(host.root), dev_root=tmp_path)
    with pytest.raises(DiscoveryError, match="stale: recreate it"):
        HostDiscoverer(config).discover()
