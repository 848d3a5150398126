"""nvidia-smi inside runc containers: the simulated host's NVML client sees exactly what gpuhook gave the container."""

from __future__ import annotations

import subprocess

import pytest

from integration.fakehost import FakeHost, create_host

from .conftest import MakeContainer, hook_entry

UTILITY = {"NVIDIA_DRIVER_CAPABILITIES": "utility"}


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """Two H100s; GPU 0 in MIG mode with a 3g.40gb and a 1g.10gb device."""
    return create_host(tmp_path_factory.mktemp("smimig") / "host", gpus=2, mig={0: ("3g.40gb", "1g.10gb")})


def host_listing(host: FakeHost) -> list[str]:
    """nvidia-smi -L run on the host: every GPU and MIG device."""
    smi = subprocess.run([host.root / "usr/bin/nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    return smi.stdout.splitlines()


def test_one_gpu_container_lists_only_its_gpu(make_container: MakeContainer, host: FakeHost) -> None:
    """NVIDIA_VISIBLE_DEVICES=1: one line, numbered 0 as NVML numbers what it sees, with GPU 1's UUID."""
    gpu = host.gpus[1]
    assert len(host_listing(host)) == len(host.gpus)
    result = make_container("nvidia-smi -L; echo rc=$?", {"NVIDIA_VISIBLE_DEVICES": "1", **UTILITY}).run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"GPU 0: {gpu.name} (UUID: {gpu.uuid})", "rc=0"]


def test_two_gpu_container_table_and_query(make_container: MakeContainer, host: FakeHost) -> None:
    """NVIDIA_VISIBLE_DEVICES=0,3: the table has those two bus ids only; --query-gpu lists their UUIDs."""
    script = "nvidia-smi; nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader"
    result = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0,3", **UTILITY}).run()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"Driver Version: {host.driver_version}" in out
    shown = [gpu for gpu in host.gpus if gpu.pci_bus_id in out]
    assert [gpu.index for gpu in shown] == [0, 3]
    gpus = (host.gpus[0], host.gpus[3])
    assert out.splitlines()[-2:] == [f"{n}, {g.uuid}, {g.pci_bus_id}" for n, g in enumerate(gpus)]


def test_mig_container_lists_only_its_mig_device(make_container: MakeContainer, mig_host: FakeHost) -> None:
    """NVIDIA_VISIBLE_DEVICES=0:1 (the 1g.10gb): its parent GPU and that one MIG device, as Device 0."""
    parent, wanted = mig_host.gpus[0], mig_host.mig_devices[1]
    assert len(host_listing(mig_host)) == len(mig_host.gpus) + len(mig_host.mig_devices)
    hook = hook_entry(mig_host.config_path, "prestart")
    result = make_container("nvidia-smi -L", {"NVIDIA_VISIBLE_DEVICES": "0:1", **UTILITY}, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"GPU 0: {parent.name} (UUID: {parent.uuid})",
        f"  MIG {wanted.profile:<11} Device  0: (UUID: {wanted.uuid})",
    ]


def test_mig_uuid_container_and_a_whole_gpu_beside(make_container: MakeContainer, mig_host: FakeHost) -> None:
    """The 3g.40gb by UUID plus GPU 1: both GPUs, only that MIG device under GPU 0."""
    wanted = mig_host.mig_devices[0]
    hook = hook_entry(mig_host.config_path, "prestart")
    env = {"NVIDIA_VISIBLE_DEVICES": f"{wanted.uuid},1", **UTILITY}
    result = make_container("nvidia-smi -L", env, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"GPU 0: {mig_host.gpus[0].name} (UUID: {mig_host.gpus[0].uuid})",
        f"  MIG 3g.40gb     Device  0: (UUID: {wanted.uuid})",
        f"GPU 1: {mig_host.gpus[1].name} (UUID: {mig_host.gpus[1].uuid})",
    ]
