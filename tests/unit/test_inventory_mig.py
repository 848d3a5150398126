"""The inventory's MIG facts: MIG mode, GPU-instance profiles and MIG device profiles, and where people see them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from gpuhook.cli.inspect import _inventory_dict, _inventory_text
from gpuhook.errors import UnknownDeviceError
from gpuhook.inventory import Gpu, Inventory, MigDevice, MigProfile
from gpuhook.nvml.facts import _profile_from_name
from gpuhook.planning.select import select_devices
from gpuhook.request.model import DeviceId, GpuIndex, GpuRequest, MigIndex, MigUuid
from integration.fakehost import create_host

# The A100-SXM4-40GB's table (integration/fakehost/mig.py), three of its rows.
PROFILES = (
    MigProfile(name="1g.5gb", profile_id=19, slices=1, memory_mib=4864, instances=7),
    MigProfile(name="3g.20gb", profile_id=9, slices=3, memory_mib=19968, instances=2),
    MigProfile(name="7g.40gb", profile_id=0, slices=7, memory_mib=40192, instances=1),
)
UUID_A = "MIG-aaaaaaaa-0000-0000-0000-000000000000"


def _gpu(index: int, *, mig: bool | None) -> Gpu:
    """An A100 in MIG mode (True), MIG-capable with MIG off (False), or without MIG (None)."""
    return Gpu(index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", minor=index,
               pci_bus_id=f"00000000:{index + 0x18:02X}:00.0", model="NVIDIA A100-SXM4-40GB",
               mig_enabled=bool(mig), mig_profiles=() if mig is None else PROFILES)


def _inventory(*gpus: Gpu, migs: tuple[MigDevice, ...] = ()) -> Inventory:
    """An inventory with *gpus* and *migs* and nothing else."""
    return Inventory(driver_version="550.54.15", cuda_version="12.4", gpus=gpus, gpu_nodes=(), control_nodes=(),
                     libraries=(), binaries=(), firmware=(), ipc=(), mig_devices=migs)


def _mig_inventory() -> Inventory:
    """GPU 0 in MIG mode with one admin-made 3g.20gb, GPU 1 MIG-capable but off, GPU 2 without MIG."""
    mig = MigDevice(parent_index=0, index=0, uuid=UUID_A, gi=1, ci=0, name="NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                    profile="3g.20gb")
    return _inventory(_gpu(0, mig=True), _gpu(1, mig=False), _gpu(2, mig=None), migs=(mig,))


def _unknown(device: DeviceId, raw: str) -> str:
    """The message select_devices refuses *device* with."""
    request = GpuRequest(all_devices=False, devices=(device,), capabilities=frozenset(), raw=raw)
    with pytest.raises(UnknownDeviceError) as excinfo:
        select_devices(request, _mig_inventory())
    return str(excinfo.value)


class TestInventoryFields:
    """The new fields, their lookups and their JSON form."""

    def test_mig_profile_is_an_exact_name_match(self) -> None:
        """Gpu.mig_profile finds a profile by its exact name only; a GPU without MIG has none."""
        gpu = _gpu(0, mig=True)
        assert gpu.mig_profile("3g.20gb") == PROFILES[1]
        assert gpu.mig_profile("3g.20GB") is None and gpu.mig_profile("3g") is None
        assert gpu.mig_profile("MIG 3g.20gb") is None
        assert _gpu(2, mig=None).mig_profile("3g.20gb") is None

    def test_defaults_say_no_mig(self) -> None:
        """A Gpu built without MIG facts is MIG-off with no profiles; a MigDevice has no profile."""
        gpu = Gpu(index=0, uuid="GPU-x", minor=0, pci_bus_id="00000000:18:00.0", model="Tesla T4")
        assert (gpu.mig_enabled, gpu.mig_profiles) == (False, ())
        assert MigDevice(parent_index=0, index=0, uuid="MIG-x", gi=1, ci=0).profile == ""

    def test_round_trip(self) -> None:
        """MIG mode, profiles and MIG device profiles survive the cache's JSON form unchanged."""
        inventory = _mig_inventory()
        data = json.loads(json.dumps(inventory.to_dict()))
        assert data["gpus"][0]["mig_enabled"] is True
        assert data["gpus"][0]["mig_profiles"][1] == {"name": "3g.20gb", "profile_id": 9, "slices": 3,
                                                      "memory_mib": 19968, "instances": 2}
        assert data["mig_devices"][0]["profile"] == "3g.20gb"
        assert Inventory.from_dict(data) == inventory

    @pytest.mark.parametrize(
        "damage",
        [
            pytest.param(lambda d: d["gpus"][0].pop("mig_enabled"), id="missing-mig-enabled"),
            pytest.param(lambda d: d["gpus"][0].update(mig_enabled=1), id="int-for-bool"),
            pytest.param(lambda d: d["gpus"][0].update(mig_enabled=None), id="null-for-bool"),
            pytest.param(lambda d: d["gpus"][0].pop("mig_profiles"), id="missing-profiles"),
            pytest.param(lambda d: d["gpus"][0].update(mig_profiles={}), id="dict-for-profiles"),
            pytest.param(lambda d: d["gpus"][0]["mig_profiles"][0].update(profile_id=True), id="bool-for-id"),
            pytest.param(lambda d: d["gpus"][0]["mig_profiles"][0].update(memory_mib="4864"), id="str-for-mib"),
            pytest.param(lambda d: d["gpus"][0]["mig_profiles"][0].pop("instances"), id="missing-instances"),
            pytest.param(lambda d: d["gpus"][0]["mig_profiles"][0].update(name=19), id="int-for-name"),
            pytest.param(lambda d: d["gpus"][0]["mig_profiles"].append("1g.5gb"), id="str-for-profile"),
            pytest.param(lambda d: d["mig_devices"][0].pop("profile"), id="missing-mig-profile"),
            pytest.param(lambda d: d["mig_devices"][0].update(profile=None), id="null-for-mig-profile"),
        ],
    )
    def test_wrong_types_are_refused(self, damage: Callable[[dict[str, object]], object]) -> None:
        """Each new field is type-checked like the rest: a damaged document is a ValueError."""
        data = json.loads(json.dumps(_mig_inventory().to_dict()))
        damage(data)
        with pytest.raises(ValueError, match="inventory"):
            Inventory.from_dict(data)


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "3g.20gb"),
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", "3g.20gb"),  # a compute instance smaller than its GI
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me", "1g.5gb+me"),
        ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", "7g.80gb"),
        ("NVIDIA A100-SXM4-40GB", ""),
        ("NVIDIA A100-SXM4-40GB MIG", ""),
        ("", ""),
    ],
)
def test_profile_from_a_mig_device_name(name: str, profile: str) -> None:
    """The fallback when NVML cannot say a GI's profile: the end of the MIG device's name."""
    assert _profile_from_name(name) == profile


class TestUnknownMessage:
    """select's refusal names the MIG devices' profiles and what MIG GPUs can make."""

    def test_mig_index_lists_profiles_and_what_can_be_made(self) -> None:
        """A MIG ask: MIG devices with their profiles, and GPU 0's profiles (GPU 1 is MIG-off, GPU 2 has none)."""
        message = _unknown(MigIndex(0, 5), "0:5")
        assert f"MIG devices: 0:0 ({UUID_A}, 3g.20gb)" in message
        assert ("; GPU 0 can make: 1g.5gb (4.8 GiB, 7 fit), 3g.20gb (19.5 GiB, 2 fit), 7g.40gb (39.2 GiB, 1 fit)"
                "; ask for one with 0,mig=PROFILE. Fix: ") in message
        assert "GPU 1 can make" not in message and "GPU 2 can make" not in message
        assert "\n" not in message

    def test_mig_uuid_lists_them_too(self) -> None:
        """A MIG UUID that does not exist gets the same listing."""
        message = _unknown(MigUuid("MIG-ffffffff-0000-0000-0000-000000000000"), "MIG-ffffffff")
        assert "no MIG device MIG-ffffffff-" in message and "3g.20gb)" in message and "GPU 0 can make" in message

    def test_gpu_ask_stays_short(self) -> None:
        """A whole-GPU ask lists GPUs and MIG devices, not profiles."""
        message = _unknown(GpuIndex(7), "7")
        assert "no GPU with index 7" in message and f"({UUID_A})" in message
        assert "can make" not in message and "3g.20gb" not in message

    def test_no_mig_gpu_no_offer(self) -> None:
        """Without a GPU in MIG mode there is nothing to offer."""
        inventory = replace(_mig_inventory(), gpus=(_gpu(0, mig=False),), mig_devices=())
        request = GpuRequest(all_devices=False, devices=(MigIndex(0, 0),), capabilities=frozenset(), raw="0:0")
        with pytest.raises(UnknownDeviceError) as excinfo:
            select_devices(request, inventory)
        assert str(excinfo.value).endswith("MIG devices: none. Fix: request one of those by index or UUID, or 'all'")


class TestInfo:
    """`gpuhook info` shows MIG mode, profiles and MIG device profiles."""

    def test_text(self) -> None:
        """One line per profile and per MIG device, under MIG-capable GPUs only."""
        text = _inventory_text(_mig_inventory(), "hit")
        gpu0, gpu1, gpu2 = text.split("Device Index:")[1:]
        assert "MIG Mode:       Enabled\n" in gpu0
        assert "MIG Profile:    3g.20gb   19.5 GiB  2 fit  (id 9)\n" in gpu0
        assert f"MIG Device:     0:0  {UUID_A}  3g.20gb\n" in gpu0
        assert "MIG Mode:       Disabled\n" in gpu1 and gpu1.count("MIG Profile:") == 3 and "MIG Device" not in gpu1
        assert "MIG" not in gpu2

    def test_json(self) -> None:
        """--json carries the same facts."""
        data = json.loads(json.dumps(_inventory_dict(_mig_inventory()), default=str))
        assert data["gpus"][0]["mig_enabled"] is True and data["gpus"][2]["mig_profiles"] == []
        assert data["gpus"][1]["mig_profiles"] == [asdict(p) for p in PROFILES]
        assert data["mig_devices"][0]["profile"] == "3g.20gb"


def test_info_command_on_a_mig_host(tmp_path: Path) -> None:
    """`gpuhook info` end to end on a simulated A100 in MIG mode with one admin instance.

    In its own process: a process can load only one simulated host's libnvidia-ml (they share a soname).
    """
    host = create_host(tmp_path / "host", gpus=2, model="NVIDIA A100-SXM4-40GB", mig={0: ("3g.20gb",)})
    config = tmp_path / "gpuhook.yaml"
    config.write_text(f"driver_root: {host.root}\ndev_root: {host.root}\nproc_root: {host.root}\n"
                      "cache_dir: null\nlog_file: null\n")

    def info(*args: str) -> str:
        result = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(config), "info", *args],
                                capture_output=True, text=True, check=False, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    text = info()
    assert text.count("MIG Mode:       ") == 2 and "MIG Mode:       Enabled" in text
    assert text.count("MIG Profile:    3g.20gb ") == 2
    assert f"MIG Device:     0:0  {host.mig_devices[0].uuid}  3g.20gb" in text
    data = json.loads(info("--json"))
    assert [g["mig_enabled"] for g in data["gpus"]] == [True, False]
    assert data["mig_devices"][0]["profile"] == "3g.20gb"
