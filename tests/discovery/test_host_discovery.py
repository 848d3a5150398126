"""HostDiscoverer against the simulated host, reached only through its roots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpuhook.config import Config
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Inventory
from integration.fakehost import MIG_PROFILES, FakeHost, create_host

REPO = Path(__file__).resolve().parents[2]


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


A100_40 = "NVIDIA A100-SXM4-40GB"


def _discover_apart(host: FakeHost) -> Inventory:
    """*host*'s inventory, discovered in a fresh interpreter.

    A process loads one libnvidia-ml: the dynamic loader hands a second
    host's copy (same soname) the first one it loaded, so another host's NVML
    must be asked from another process.
    """
    code = (
        "import json, sys; from pathlib import Path; from gpuhook.config import Config; "
        "from gpuhook.discovery.host import HostDiscoverer; root = Path(sys.argv[1]); "
        "print(json.dumps(HostDiscoverer(Config(driver_root=root, dev_root=root, proc_root=root, "
        "log_file=None)).discover().to_dict()))"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code, str(host.root)], capture_output=True, text=True,
                            check=False, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return Inventory.from_dict(json.loads(result.stdout))


def test_mig_mode_and_gi_profiles(tmp_path: Path) -> None:
    """A MIG-enabled A100 and a MIG-off one both list their model's GI profiles, names and ids as the table."""
    host = create_host(tmp_path / "host", gpus=2, model=A100_40, mig={0: ()})
    inv = _discover_apart(host)
    assert [g.mig_enabled for g in inv.gpus] == [True, False]
    want = {(p.name, p.profile_id, p.slices, p.memory_mib, p.instances) for p in MIG_PROFILES[A100_40]}
    for gpu in inv.gpus:
        assert {(p.name, p.profile_id, p.slices, p.memory_mib, p.instances) for p in gpu.mig_profiles} == want
        assert len(gpu.mig_profiles) == len(want)
    three = inv.gpus[0].mig_profile("3g.20gb")
    assert three is not None and (three.profile_id, three.slices, three.instances) == (9, 3, 2)
    assert inv.mig_devices == ()


def test_mig_device_profile_of_an_admin_instance(tmp_path: Path) -> None:
    """Admin-made instances get their GPU instance's profile name from NVML."""
    host = create_host(tmp_path / "host", gpus=1, model=A100_40, mig={0: ("3g.20gb", "1g.5gb")})
    inv = _discover_apart(host)
    assert [(m.uuid, m.gi, m.profile) for m in inv.mig_devices] == [
        (m.uuid, m.gi, m.profile) for m in host.mig_devices]
    assert [m.profile for m in inv.mig_devices] == ["3g.20gb", "1g.5gb"]


def test_gpu_without_mig_has_no_profiles(tmp_path: Path) -> None:
    """A GPU without MIG support (Tesla T4) is MIG-off with no profiles."""
    host = create_host(tmp_path / "host", gpus=1, model="Tesla T4")
    (gpu,) = _discover_apart(host).gpus
    assert (gpu.mig_enabled, gpu.mig_profiles, gpu.mig_profile("1g.5gb")) == (False, (), None)
