"""Issue 15's pure core: the per-GPU policy (both syntaxes), allocation under it, and the lease ledger as a value."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhook.config import load_config, parse_config
from gpuhook.errors import BusyError, ConfigError, PolicyError, StateError
from gpuhook.inventory import Gpu, HostDevice, Inventory, MigDevice
from gpuhook.request.model import Capability, DeviceId, GpuIndex, GpuRequest, MigIndex
from gpuhook.sharing.allocate import Allocation, allocate
from gpuhook.sharing.ledger import Holder, Lease, Ledger, LeaseState, from_object, timestamp, to_object
from gpuhook.sharing.policy import (
    UNLIMITED,
    GpuPolicy,
    MigMode,
    MpsLimits,
    Policy,
    Sharing,
    decode_device_file,
    decode_gpus,
    names_gpu,
)

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
COMPUTE_UTILITY = frozenset({Capability.COMPUTE, Capability.UTILITY})


def _uuid(i: int) -> str:
    return f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"


def _gpu(i: int) -> Gpu:
    """GPU i at NVML's bus id 00000000:{18+i}:00.0 (upper-case hex, as NVML writes it)."""
    return Gpu(index=i, uuid=_uuid(i), minor=i, pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
               model="NVIDIA H100 80GB HBM3", brand="Tesla", arch="9.0")


def _mig(parent: int, m: int) -> MigDevice:
    return MigDevice(parent_index=parent, index=m, uuid=f"MIG-{parent}{m}000000-1111-2222-3333-444444444444",
                     gi=m + 1, ci=0, name="MIG 3g.40gb")


def host(gpus: int = 4, *, migs: tuple[MigDevice, ...] = ()) -> Inventory:
    """A host with *gpus* GPUs (and *migs* MIG devices); allocation reads only the GPUs and MIG devices."""
    return Inventory(driver_version="550.54.15", cuda_version="12.4", gpus=tuple(_gpu(i) for i in range(gpus)),
                     gpu_nodes=tuple(HostDevice(name=f"nvidia{i}", host_path=Path(f"/dev/nvidia{i}"), major=195,
                                                minor=i) for i in range(gpus)),
                     control_nodes=(), libraries=(), binaries=(), firmware=(), ipc=(), mig_devices=migs)


def req(*devices: DeviceId, count: int | None = None, caps: frozenset[Capability] = COMPUTE_UTILITY,
        all_devices: bool = False) -> GpuRequest:
    """A request as the parser would make it."""
    raw = f"count={count}" if count is not None else ("all" if all_devices else ",".join(map(str, devices)))
    return GpuRequest(all_devices=all_devices, devices=devices, count=count, capabilities=caps, raw=raw)


def policies(inventory: Inventory, policy: GpuPolicy) -> dict[int, GpuPolicy]:
    """Every GPU of *inventory* under *policy*."""
    return {g.index: policy for g in inventory.gpus}


EXCLUSIVE = GpuPolicy(sharing=Sharing.EXCLUSIVE)


def lease(container_id: str, *devices: str, pid: int = 100, age_s: int = 5) -> Lease:
    """*container_id*'s lease on *devices*, taken *age_s* seconds before NOW."""
    return Lease(container_id=container_id, devices=devices, holder=Holder(pid=pid, start=1000 + pid),
                 since=timestamp(NOW - timedelta(seconds=age_s)))


def take(ledger: Ledger, allocation: Allocation, container_id: str, pid: int) -> Ledger:
    """The ledger with *allocation* reserved for *container_id* (what a start does under the lock)."""
    return ledger.reserve(lease(container_id, *allocation.devices, pid=pid))


# --- the policy: two syntaxes, one model ------------------------------------------------------------

YAML_CONFIG_GPUS = """\
gpus:
  - device: "0000:18:00.0"
    sharing: exclusive
    capabilities: [compute, utility]
  - device: 1
    sharing: shared
    replicas: 4
  - device: GPU-00000002-aaaa-bbbb-cccc-dddddddddddd
    sharing: shared
    replicas: 2
    mig: {enable: true, instance: 3g.20gb}
  - device: 3
    sharing: mps
    replicas: 2
    mps: {thread_percentage: 25, memory_limit: 10G}
  - device: all
    sharing: unlimited
"""

DEVICE_FILE = {"Devices": [
    {"DeviceID": "0000:18:00.0", "Sharing": "exclusive", "Capabilities": ["compute", "utility"]},
    {"DeviceID": "1", "Sharing": "shared", "Replicas": 4},
    {"DeviceID": "GPU-00000002-aaaa-bbbb-cccc-dddddddddddd", "Sharing": "shared", "Replicas": 2,
     "MIGMode": {"Enable": True, "Instance": "3g.20gb"}},
    {"DeviceID": "3", "Sharing": "mps", "Replicas": 2, "MPS": {"ThreadPercentage": 25, "MemoryLimit": "10G"}},
    {"DeviceID": "all", "Sharing": "unlimited"},
]}

EXPECTED_ENTRIES = (
    GpuPolicy(device="0000:18:00.0", sharing=Sharing.EXCLUSIVE, capabilities=COMPUTE_UTILITY),
    GpuPolicy(device="1", sharing=Sharing.SHARED, replicas=4),
    GpuPolicy(device="GPU-00000002-aaaa-bbbb-cccc-dddddddddddd", sharing=Sharing.SHARED, replicas=2,
              mig=MigMode(enable=True, instance="3g.20gb")),
    GpuPolicy(device="3", sharing=Sharing.MPS, replicas=2, mps=MpsLimits(thread_percentage=25.0,
                                                                       memory_limit_mib=10240)),
)


def _rules(policy: Policy) -> tuple[tuple[GpuPolicy, ...], GpuPolicy]:
    """What a policy says (its source, for messages, differs by where it was read)."""
    return policy.entries, policy.default


def test_yaml_list_and_device_file_give_the_same_policy(tmp_path: Path) -> None:
    """gpus: in gpuhook.yaml, the JSON device file and the device file written as YAML: one policy, loaded through
    the config exactly as the hook loads it."""
    yaml_config = tmp_path / "gpus.yaml"
    yaml_config.write_text(f"state_dir: {tmp_path}/state\n{YAML_CONFIG_GPUS}")
    json_file = tmp_path / "devices.json"
    json_file.write_text(json.dumps(DEVICE_FILE))
    yaml_file = tmp_path / "devices.yaml"
    yaml_file.write_text(yaml.safe_dump(DEVICE_FILE))
    assert not yaml_file.read_text().lstrip().startswith("{")  # block YAML, not JSON in disguise

    from_list = load_config(yaml_config, required=True).gpus
    assert _rules(from_list) == (EXPECTED_ENTRIES, UNLIMITED)
    for device_file in (json_file, yaml_file):
        config_path = tmp_path / f"config-{device_file.suffix[1:]}.yaml"
        config_path.write_text(f"state_dir: {tmp_path}/state\ndevice_policy: {device_file}\n")
        config = load_config(config_path, required=True)
        assert config.device_policy == device_file
        assert _rules(config.gpus) == _rules(from_list), device_file
        assert config.gpus.source == str(device_file)
        assert config.gpus.resolve(host().gpus) == from_list.resolve(host().gpus)
    resolved = from_list.resolve(host(5).gpus)
    assert [resolved[i].sharing for i in range(5)] == [Sharing.EXCLUSIVE, Sharing.SHARED, Sharing.SHARED,
                                                      Sharing.MPS, Sharing.UNLIMITED]
    assert [resolved[i].limit for i in range(5)] == [1, 4, 2, 2, None]


def test_a_policy_without_a_default_leaves_the_other_gpus_unlimited() -> None:
    """No `device: all` entry: the GPUs not listed are NVIDIA's (unlimited, any capability)."""
    policy = decode_gpus([{"device": 3, "sharing": "exclusive"}], source="t")
    resolved = policy.resolve(host().gpus)
    assert resolved[3] == GpuPolicy(device="3", sharing=Sharing.EXCLUSIVE)
    assert resolved[0] == resolved[1] == resolved[2] == UNLIMITED
    assert not policy.is_unlimited
    assert decode_gpus([{"device": "all"}], source="t").is_unlimited


def _entry(key: str, value: Any, **more: Any) -> list[dict[str, Any]]:
    return [{"device": "0", key: value, **more}]


def _file_entry(key: str, value: Any, **more: Any) -> dict[str, Any]:
    return {"Devices": [{"DeviceID": "0", key: value, **more}]}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param([{"device": "0", "sharng": "exclusive"}], r"gpus\[0\]: unknown key\(s\) sharng; known: device",
                     id="unknown-key"),
        pytest.param(_entry("mig", {"enable": True, "profile": "1g.10gb"}),
                     r"gpus\[0\]\.mig: unknown key\(s\) profile; known: enable, instance", id="unknown-mig-key"),
        pytest.param(_entry("sharing", "exclusiv"), r"gpus\[0\]\.sharing must be one of unlimited, exclusive, "
                     r"shared, mps, got 'exclusiv'", id="bad-sharing"),
        pytest.param(_entry("sharing", "Exclusive"), r"gpus\[0\]\.sharing must be one of", id="sharing-case"),
        pytest.param(_entry("sharing", "exclusive", replicas=2), r"gpus\[0\]: replicas contradicts sharing "
                     "'exclusive'", id="replicas-with-exclusive"),
        pytest.param(_entry("replicas", 2), r"gpus\[0\]: replicas contradicts sharing 'unlimited'",
                     id="replicas-with-default-unlimited"),
        pytest.param(_entry("sharing", "shared"), r"gpus\[0\]: sharing 'shared' needs replicas", id="shared-alone"),
        pytest.param(_entry("sharing", "mps"), r"gpus\[0\]: sharing 'mps' needs replicas", id="mps-alone"),
        pytest.param(_entry("replicas", 0, sharing="shared"), r"gpus\[0\]\.replicas must be a whole number from 1 "
                     "to 1024, got 0", id="replicas-0"),
        pytest.param(_entry("replicas", True, sharing="shared"), r"gpus\[0\]\.replicas must be a whole number.*"
                     "got True", id="replicas-bool"),
        pytest.param(_entry("replicas", "2", sharing="shared"), r"gpus\[0\]\.replicas must be a whole number.*"
                     "got '2'", id="replicas-string"),
        pytest.param(_entry("replicas", 1025, sharing="shared"), r"gpus\[0\]\.replicas must be a whole number",
                     id="replicas-too-many"),
        pytest.param(_entry("capabilities", ["compute", "cuda"]), r"gpus\[0\]\.capabilities must be a list of "
                     r"driver capabilities \(.*\), got \['compute', 'cuda'\]", id="bad-capability"),
        pytest.param(_entry("capabilities", "compute"), r"gpus\[0\]\.capabilities must be a list",
                     id="capabilities-not-a-list"),
        pytest.param(_entry("mig", {"enable": "yes"}), r"gpus\[0\]\.mig\.enable must be true or false, got 'yes'",
                     id="mig-enable-not-bool"),
        pytest.param(_entry("mig", {"instance": "3g.20gb"}), r"gpus\[0\]\.mig\.enable must be true or false, "
                     "got None", id="mig-enable-missing"),
        pytest.param(_entry("mig", {"enable": True, "instance": "3g.20"}), r"gpus\[0\]\.mig\.instance must be a "
                     "GPU-instance profile", id="bad-instance"),
        pytest.param(_entry("mig", {"enable": False, "instance": "3g.20gb"}), r"gpus\[0\]\.mig: instance '3g.20gb' "
                     "contradicts enable: false", id="instance-with-enable-false"),
        pytest.param(_entry("mig", True), r"gpus\[0\]\.mig must be a mapping", id="mig-not-a-mapping"),
        pytest.param([{"device": "all"}, {"device": "all", "sharing": "exclusive"}],
                     "gpus lists device 'all' 2 times; keep one", id="all-twice"),
        pytest.param([{"device": "0"}, {"device": 0, "sharing": "exclusive"}], "gpus lists device '0' twice",
                     id="index-twice"),
        pytest.param([{"device": "0000:18:00.0"}, {"device": "18:00.0"}], "gpus lists device '18:00.0' twice",
                     id="pci-id-twice-two-spellings"),
        pytest.param([{"device": _uuid(0)}, {"device": _uuid(0).upper()}],
                     "gpus lists device 'GPU-00000000-AAAA-BBBB-CCCC-DDDDDDDDDDDD' twice", id="uuid-twice-any-case"),
        pytest.param([{"sharing": "exclusive"}], r"gpus\[0\]\.device must be a GPU index .* got None",
                     id="no-device"),
        pytest.param([{"device": "nvidia0"}], r"gpus\[0\]\.device must be a GPU index .* got 'nvidia0'",
                     id="bad-device"),
        pytest.param(["0"], r"gpus\[0\]: expected a mapping", id="entry-not-a-mapping"),
        pytest.param({"device": "0"}, "gpus must be a list of GPU entries", id="not-a-list"),
    ],
)
def test_yaml_list_refusals(value: Any, message: str) -> None:
    """Each invalid `gpus:` form is refused at load, the message naming the entry and its key."""
    with pytest.raises(ConfigError, match=message):
        decode_gpus(value, source="gpuhook.yaml")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param({"Devices": [], "Version": 1}, r"unknown key\(s\) Version; expected only \"Devices\"",
                     id="unknown-top-level-key"),
        pytest.param({"devices": []}, r"unknown key\(s\) devices", id="lower-case-devices"),
        pytest.param({}, r"no \"Devices\" list", id="no-devices"),
        pytest.param([], "expected an object with a \"Devices\" list", id="not-an-object"),
        pytest.param(_file_entry("sharing", "exclusive"), r"Devices\[0\]: unknown key\(s\) sharing; known: DeviceID, "
                     "Sharing, Replicas, Capabilities, MIGMode", id="yaml-key-in-the-file"),
        pytest.param(_file_entry("MIGMode", {"Enable": True, "Profile": "1g.10gb"}),
                     r"Devices\[0\]\.MIGMode: unknown key\(s\) Profile; known: Enable, Instance", id="unknown-mig-key"),
        pytest.param(_file_entry("Sharing", "time-slicing"), r"Devices\[0\]\.Sharing must be one of",
                     id="bad-sharing"),
        pytest.param(_file_entry("Sharing", "exclusive", Replicas=4), r"Devices\[0\]: Replicas contradicts Sharing "
                     "'exclusive'", id="replicas-with-exclusive"),
        pytest.param(_file_entry("Sharing", "shared"), r"Devices\[0\]: Sharing 'shared' needs Replicas",
                     id="shared-alone"),
        pytest.param(_file_entry("Sharing", "mps"), r"Devices\[0\]: Sharing 'mps' needs Replicas", id="mps-alone"),
        pytest.param(_file_entry("Replicas", 0, Sharing="shared"), r"Devices\[0\]\.Replicas must be a whole number",
                     id="replicas-0"),
        pytest.param(_file_entry("Replicas", False, Sharing="mps"), r"Devices\[0\]\.Replicas must be a whole number",
                     id="replicas-bool"),
        pytest.param(_file_entry("Replicas", "4", Sharing="shared"), r"Devices\[0\]\.Replicas must be a whole number",
                     id="replicas-string"),
        pytest.param(_file_entry("Capabilities", ["compute", "gpu"]), r"Devices\[0\]\.Capabilities must be a list",
                     id="bad-capability"),
        pytest.param(_file_entry("MIGMode", {"Enable": 1}), r"Devices\[0\]\.MIGMode\.Enable must be true or false",
                     id="mig-enable-not-bool"),
        pytest.param(_file_entry("MIGMode", {"Enable": True, "Instance": "half"}),
                     r"Devices\[0\]\.MIGMode\.Instance must be a GPU-instance profile", id="bad-instance"),
        pytest.param(_file_entry("MIGMode", {"Enable": False, "Instance": "1g.10gb"}),
                     r"Devices\[0\]\.MIGMode: Instance '1g.10gb' contradicts Enable: false",
                     id="instance-with-enable-false"),
        pytest.param({"Devices": [{"DeviceID": "all"}, {"DeviceID": "all"}]}, "Devices lists DeviceID 'all' 2 times",
                     id="all-twice"),
        pytest.param({"Devices": [{"DeviceID": "1"}, {"DeviceID": "1", "Sharing": "exclusive"}]},
                     "Devices lists DeviceID '1' twice", id="index-twice"),
        pytest.param({"Devices": [{"DeviceID": "00000000:19:00.0"}, {"DeviceID": "0000:19:00.0"}]},
                     "Devices lists DeviceID '0000:19:00.0' twice", id="pci-id-twice-two-spellings"),
    ],
)
def test_device_file_refusals(value: Any, message: str) -> None:
    """Each invalid device-file form is refused, the message naming the file's own key (DeviceID, MIGMode, ...)."""
    with pytest.raises(ConfigError, match=message) as excinfo:
        decode_device_file(value, source="/etc/gpuhook/devices.json")
    assert str(excinfo.value).startswith("/etc/gpuhook/devices.json: ")


def test_valid_mig_modes_are_accepted() -> None:
    """MIGMode is accepted and kept (issue 12 acts on it): enabled with or without a profile, or disabled."""
    policy = decode_device_file({"Devices": [
        {"DeviceID": "0", "MIGMode": {"Enable": True, "Instance": "1g.10gb+me"}},
        {"DeviceID": "1", "MIGMode": {"Enable": True}},
        {"DeviceID": "2", "MIGMode": {"Enable": False}},
    ]}, source="f")
    assert [e.mig for e in policy.entries] == [MigMode(enable=True, instance="1g.10gb+me"), MigMode(enable=True),
                                               MigMode(enable=False)]
    assert not policy.is_unlimited


@pytest.mark.parametrize("spelling", ["0000:1a:00.0", "0000:1A:00.0", "1a:00.0", "1A:00.0", "00000000:1a:00.0"])
def test_pci_bus_ids_match_in_every_spelling(spelling: str) -> None:
    """NVML's 00000000:1A:00.0 is the lspci forms 0000:1a:00.0 and 1a:00.0, in either case."""
    gpu = _gpu(2)
    assert gpu.pci_bus_id == "00000000:1A:00.0"
    assert names_gpu(spelling, gpu)
    assert not names_gpu(spelling, _gpu(1))
    assert not names_gpu(spelling.replace(":00.0", ":00.1"), gpu)
    policy = decode_gpus([{"device": spelling, "sharing": "exclusive"}], source="t")
    assert policy.resolve(host().gpus)[2].sharing is Sharing.EXCLUSIVE


@pytest.mark.parametrize("domain", ["0001:18:00.0", "00000001:18:00.0"])
def test_a_pci_id_in_another_domain_is_another_gpu(domain: str) -> None:
    """The domain counts: 0001:18:00.0 is not NVML's 00000000:18:00.0."""
    assert not names_gpu(domain, _gpu(0))


@pytest.mark.parametrize(("first", "second"), [
    pytest.param("0", _uuid(0), id="index-and-uuid"),
    pytest.param("0", "0000:18:00.0", id="index-and-pci"),
    pytest.param("GPU-" + _uuid(0)[4:].upper(), "18:00.0", id="uuid-upper-case-and-pci"),
])
def test_a_gpu_named_twice_in_two_forms_is_refused_at_resolve(first: str, second: str) -> None:
    """Which GPU an index, a UUID or a PCI bus id names is known only against the host: resolve refuses the pair."""
    policy = decode_gpus([{"device": first}, {"device": second, "sharing": "exclusive"}], source="gpuhook.yaml")
    with pytest.raises(ConfigError, match=rf"gpuhook.yaml: GPU 0 \({_uuid(0)}\) is listed twice \(as "
                                          rf"'{first}' and '{second}'\); keep one entry"):
        policy.resolve(host().gpus)


@pytest.mark.parametrize("device", ["7", "GPU-00000009-aaaa-bbbb-cccc-dddddddddddd", "0000:99:00.0"])
def test_a_device_no_host_gpu_matches_is_refused_at_resolve(device: str) -> None:
    """An entry for a GPU this host does not have names the entry and lists the host's GPUs."""
    policy = decode_gpus([{"device": device, "sharing": "exclusive"}], source="gpuhook.yaml")
    with pytest.raises(ConfigError, match=rf"gpuhook.yaml: device '{device}' is not a GPU of this host; it has: "
                                          rf"0 \({_uuid(0)}, 00000000:18:00.0\), 1 "):
        policy.resolve(host(2).gpus)


# --- the policy in the config -----------------------------------------------------------------------


def test_gpus_and_device_policy_together_are_refused(tmp_path: Path) -> None:
    """One policy, in one place."""
    device_file = tmp_path / "devices.json"
    device_file.write_text(json.dumps(DEVICE_FILE))
    with pytest.raises(ConfigError, match="gpus and device_policy both set a sharing policy; keep one"):
        parse_config(f"device_policy: {device_file}\n{YAML_CONFIG_GPUS}")


@pytest.mark.parametrize("text", [
    pytest.param(YAML_CONFIG_GPUS, id="gpus"),
    pytest.param("gpus:\n  - {device: all, capabilities: [compute]}\n", id="capability-rule"),
])
def test_state_dir_null_with_a_limiting_policy_is_refused(text: str) -> None:
    """Leases live in state_dir: a policy that limits GPUs cannot go without them."""
    with pytest.raises(ConfigError, match=r"state_dir is null, but the sharing policy \(<config>\) limits GPUs"):
        parse_config(f"state_dir: null\n{text}")


def test_state_dir_null_with_a_limiting_device_file_is_refused(tmp_path: Path) -> None:
    """The same for a policy read from device_policy, whose message names the file."""
    device_file = tmp_path / "devices.json"
    device_file.write_text(json.dumps(DEVICE_FILE))
    with pytest.raises(ConfigError, match=rf"state_dir is null, but the sharing policy \({device_file}\) limits"):
        parse_config(f"state_dir: null\ndevice_policy: {device_file}\n")


@pytest.mark.parametrize("device", ["0000:18:00.0", "18:00.0", "00000000:18:00.0"])
def test_an_unquoted_decimal_pci_id_is_refused_with_the_way_out(device: str) -> None:
    """YAML 1.1 reads an unquoted 0000:18:00.0 as the base-60 number 1080.0 (0000:1a:00.0 stays a string): the
    refusal must say so and tell to quote it, not show the example the user believes they wrote."""
    with pytest.raises(ConfigError) as excinfo:
        parse_config(f"gpus:\n  - device: {device}\n    sharing: exclusive\n")
    assert "gpus[0].device" in str(excinfo.value)
    assert "quote" in str(excinfo.value)
    assert _rules(parse_config(f"gpus:\n  - device: '{device}'\n    sharing: exclusive\n").gpus)[0][0].device == device


def test_a_device_file_error_names_the_file(tmp_path: Path) -> None:
    """A bad device file is refused at config load with its own path and key; a missing one is named too."""
    device_file = tmp_path / "devices.json"
    device_file.write_text(json.dumps(_file_entry("Sharing", "exclusive", Replicas=2)))
    with pytest.raises(ConfigError, match=rf"{device_file}: Devices\[0\]: Replicas contradicts Sharing"):
        parse_config(f"device_policy: {device_file}\n")
    with pytest.raises(ConfigError, match=rf"device_policy: cannot read {tmp_path}/absent.json"):
        parse_config(f"device_policy: {tmp_path}/absent.json\n")
    (tmp_path / "broken.json").write_text('{"Devices": [\n')
    with pytest.raises(ConfigError, match=rf"{tmp_path}/broken.json: not valid YAML"):
        parse_config(f"device_policy: {tmp_path}/broken.json\n")


# --- allocation -------------------------------------------------------------------------------------


def test_an_exclusive_gpu_held_refuses_naming_the_holder() -> None:
    """Exclusive GPU 0 held by A: B's request for it is refused with A's container id, pid and how long."""
    inv = host()
    ledger = Ledger((lease("ctr-a", _uuid(0), pid=4242, age_s=75),))
    with pytest.raises(BusyError) as excinfo:
        allocate(req(GpuIndex(0)), inv, policies(inv, EXCLUSIVE), ledger, container_id="ctr-b", now=NOW)
    message = str(excinfo.value)
    assert message.startswith("NVIDIA_VISIBLE_DEVICES='0': GPU 0 (GPU-00000000-aaaa-bbbb-cccc-dddddddddddd) is "
                              "exclusive, held by ctr-a (pid 4242, for 1m15s)")
    assert "gpuhook release CONTAINER_ID" in message
    # The other GPUs are free.
    assert allocate(req(GpuIndex(1)), inv, policies(inv, EXCLUSIVE), ledger, container_id="ctr-b",
                    now=NOW).devices == (_uuid(1),)


def test_shared_with_two_replicas_takes_two_and_refuses_the_third() -> None:
    """shared, replicas 2: two holders at once, the third is refused naming both; once one goes, it fits."""
    inv = host(1)
    rules = policies(inv, GpuPolicy(sharing=Sharing.SHARED, replicas=2))
    ledger = Ledger()
    for n in (1, 2):
        ledger = take(ledger, allocate(req(GpuIndex(0)), inv, rules, ledger, container_id=f"c{n}", now=NOW), f"c{n}",
                      n)
    assert len(ledger.holding(_uuid(0))) == 2
    with pytest.raises(BusyError, match=r"is shared \(replicas 2\), held by c1 \(pid 1, for 5s\), c2 \(pid 2"):
        allocate(req(GpuIndex(0)), inv, rules, ledger, container_id="c3", now=NOW)
    ledger = ledger.release("c1")
    assert allocate(req(GpuIndex(0)), inv, rules, ledger, container_id="c3", now=NOW).devices == (_uuid(0),)


def test_mps_counts_like_shared() -> None:
    """mps, replicas 1: the second client is refused."""
    inv = host(1)
    rules = policies(inv, GpuPolicy(sharing=Sharing.MPS, replicas=1))
    with pytest.raises(BusyError, match=r"mps \(replicas 1\)"):
        allocate(req(GpuIndex(0)), inv, rules, Ledger((lease("a", _uuid(0)),)), container_id="b", now=NOW)


def test_unlimited_is_never_refused() -> None:
    """NVIDIA's behaviour: any number of holders, by index, all, or count."""
    inv = host(2)
    rules = policies(inv, UNLIMITED)
    ledger = Ledger(tuple(lease(f"c{n}", _uuid(0), _uuid(1), pid=n) for n in range(50)))
    assert allocate(req(GpuIndex(0)), inv, rules, ledger, container_id="x", now=NOW).devices == (_uuid(0),)
    assert allocate(req(all_devices=True), inv, rules, ledger, container_id="x", now=NOW).devices == (_uuid(0),
                                                                                                   _uuid(1))
    assert len(allocate(req(count=2), inv, rules, ledger, container_id="x", now=NOW).devices) == 2


def test_count_two_on_four_exclusive_gpus_gives_disjoint_pairs_then_refuses() -> None:
    """count=2 twice: {0,1} then {2,3}; the third is refused, naming the holders; with one GPU free, still refused
    (all or nothing: never one GPU for a count=2)."""
    inv = host(4)
    rules = policies(inv, EXCLUSIVE)
    ledger = Ledger()
    first = allocate(req(count=2), inv, rules, ledger, container_id="a", now=NOW)
    assert first.devices == (_uuid(0), _uuid(1))
    assert first.request.count is None and first.request.devices == (GpuIndex(0), GpuIndex(1))
    ledger = take(ledger, first, "a", 1)
    second = allocate(req(count=2), inv, rules, ledger, container_id="b", now=NOW)
    assert second.devices == (_uuid(2), _uuid(3))
    ledger = take(ledger, second, "b", 2)
    assert not set(first.devices) & set(second.devices)
    with pytest.raises(BusyError) as excinfo:
        allocate(req(count=2), inv, rules, ledger, container_id="c", now=NOW)
    message = str(excinfo.value)
    assert message.startswith("NVIDIA_VISIBLE_DEVICES='count=2': 2 GPUs asked, 0 of 4 free under their policies: ")
    assert "GPU 0 (GPU-00000000-aaaa-bbbb-cccc-dddddddddddd) is exclusive, held by a (pid 1" in message
    assert "GPU 3 (GPU-00000003-aaaa-bbbb-cccc-dddddddddddd) is exclusive, held by b (pid 2" in message
    ledger = ledger.release("b").reserve(lease("d", _uuid(2), pid=4))
    with pytest.raises(BusyError, match="2 GPUs asked, 1 of 4 free"):
        allocate(req(count=2), inv, rules, ledger, container_id="c", now=NOW)
    assert allocate(req(count=1), inv, rules, ledger, container_id="c", now=NOW).devices == (_uuid(3),)


def test_any_picks_the_least_held_gpu_then_the_lowest_index() -> None:
    """Under shared replicas 3: GPU 0 held twice, 1 and 2 once, 3 once → any takes GPU 1 (least held, lowest index);
    with 3 empty, GPU 3."""
    inv = host(4)
    rules = policies(inv, GpuPolicy(sharing=Sharing.SHARED, replicas=3))
    ledger = Ledger((lease("a", _uuid(0)), lease("b", _uuid(0)), lease("c", _uuid(2)), lease("d", _uuid(1)),
                     lease("e", _uuid(3))))
    assert allocate(req(count=1), inv, rules, ledger, container_id="x", now=NOW).devices == (_uuid(1),)
    assert allocate(req(count=1), inv, rules, ledger.release("e"), container_id="x", now=NOW).devices == (_uuid(3),)
    # count=3 takes the three least held, least first: 1, 2, 3 (index breaks the tie), then never 0's third slot.
    assert allocate(req(count=3), inv, rules, ledger, container_id="x", now=NOW).devices == (_uuid(1), _uuid(2),
                                                                                          _uuid(3))
    assert allocate(req(count=4), inv, rules, ledger, container_id="x", now=NOW).devices[-1] == _uuid(0)


def test_a_capability_the_policy_does_not_allow_is_refused_naming_the_gpu_and_the_set() -> None:
    """GPU 0 may be given compute and utility: asking it for video too is a PolicyError (not Busy), never clipped."""
    inv = host(2)
    rules = {0: GpuPolicy(device="0", capabilities=COMPUTE_UTILITY), 1: UNLIMITED}
    asked = COMPUTE_UTILITY | {Capability.VIDEO}
    with pytest.raises(PolicyError) as excinfo:
        allocate(req(GpuIndex(0), caps=asked), inv, rules, Ledger(), container_id="x", now=NOW)
    assert type(excinfo.value) is PolicyError
    assert str(excinfo.value).startswith(
        "NVIDIA_VISIBLE_DEVICES='0': GPU 0 (GPU-00000000-aaaa-bbbb-cccc-dddddddddddd) may be given only compute, "
        "utility, and the container asks also for video")
    # all: GPU 0 is among them, refused the same way
    with pytest.raises(PolicyError, match=r"GPU 0 .* may be given only compute, utility"):
        allocate(req(all_devices=True, caps=asked), inv, rules, Ledger(), container_id="x", now=NOW)
    # within the set: given
    assert allocate(req(GpuIndex(0)), inv, rules, Ledger(), container_id="x", now=NOW).devices == (_uuid(0),)


def test_count_skips_gpus_whose_capabilities_do_not_allow_the_request() -> None:
    """count=1 asking for video passes over GPU 0 (compute, utility only) to GPU 1; with too few GPUs allowing
    it, the refusal is the policy's (waiting would not help) and says which GPU may be given what."""
    inv = host(2)
    restricted = GpuPolicy(capabilities=COMPUTE_UTILITY)
    asked = COMPUTE_UTILITY | {Capability.VIDEO}
    rules = {0: restricted, 1: UNLIMITED}
    assert allocate(req(count=1, caps=asked), inv, rules, Ledger(), container_id="x", now=NOW).devices == (_uuid(1),)
    with pytest.raises(PolicyError, match="only 1 of 2 may be given compute, utility, video") as refused:
        allocate(req(count=2, caps=asked), inv, rules, Ledger(), container_id="x", now=NOW)
    assert not isinstance(refused.value, BusyError)
    with pytest.raises(PolicyError, match="GPU 0 may be given only compute, utility; GPU 1 may be given only compute"):
        allocate(req(count=1, caps=asked), inv, {0: restricted, 1: restricted}, Ledger(), container_id="x", now=NOW)


def test_the_containers_own_earlier_lease_does_not_count_against_it() -> None:
    """A second start stage of the container that holds exclusive GPU 0 (same id, same holder) gets it again."""
    inv = host(1)
    held = lease("a", _uuid(0))
    ledger = Ledger((held,))
    assert allocate(req(GpuIndex(0)), inv, policies(inv, EXCLUSIVE), ledger, container_id="a", holder=held.holder,
                    now=NOW).devices == (_uuid(0),)
    assert allocate(req(count=1), inv, policies(inv, EXCLUSIVE), ledger, container_id="a", holder=held.holder,
                    now=NOW).devices == (_uuid(0),)


def test_a_same_id_container_of_another_holder_is_another_container() -> None:
    """Issue 31: container "a" of another runc root (same id, another init) asking for A's exclusive GPU 0 is
    refused naming A's pid; reserving it beside A's lease keeps both (A's is not replaced), and releasing the
    second's by its holder leaves A's."""
    inv = host(2)
    first = lease("a", _uuid(0), pid=7)
    ledger = Ledger((first,))
    second = Holder(pid=8, start=1008)
    with pytest.raises(BusyError, match=r"GPU 0 .* is exclusive, held by a \(pid 7"):
        allocate(req(GpuIndex(0)), inv, policies(inv, EXCLUSIVE), ledger, container_id="a", holder=second, now=NOW)
    with pytest.raises(BusyError, match=r"2 GPUs asked, 1 of 2 free .*held by a \(pid 7"):
        allocate(req(count=2), inv, policies(inv, EXCLUSIVE), ledger, container_id="a", holder=second, now=NOW)
    other = allocate(req(GpuIndex(1)), inv, policies(inv, EXCLUSIVE), ledger, container_id="a", holder=second, now=NOW)
    both = take(ledger, other, "a", pid=8)
    assert both.leases == (first, lease("a", _uuid(1), pid=8))
    assert both.lease_of("a", second) == both.leases[1] and both.leases_of("a") == both.leases
    assert both.release("a", second).leases == (first,)
    assert both.release("a").leases == ()  # by hand: every lease under the id


def test_mig_devices_and_their_parent_hold_each_other() -> None:
    """On exclusive GPU 0: a whole-GPU lease blocks its MIG devices, a MIG lease blocks the whole GPU (and a count
    passes over it); a sibling MIG device of a held one has its own room."""
    migs = (_mig(0, 0), _mig(0, 1), _mig(1, 0))
    inv = host(2, migs=migs)
    rules = policies(inv, EXCLUSIVE)
    whole = Ledger((lease("a", _uuid(0), pid=7),))
    with pytest.raises(BusyError, match=rf"MIG device {migs[0].uuid} \(on GPU 0, exclusive\) is held by a \(pid 7"):
        allocate(req(MigIndex(0, 0)), inv, rules, whole, container_id="b", now=NOW)
    assert allocate(req(MigIndex(1, 0)), inv, rules, whole, container_id="b", now=NOW).devices == (migs[2].uuid,)

    sliced = Ledger((lease("a", migs[0].uuid, pid=7),))
    with pytest.raises(BusyError, match=r"GPU 0 \(GPU-00000000-aaaa-bbbb-cccc-dddddddddddd\) is exclusive, held by a"):
        allocate(req(GpuIndex(0)), inv, rules, sliced, container_id="b", now=NOW)
    with pytest.raises(BusyError, match=r"MIG device .* held by a"):
        allocate(req(MigIndex(0, 0)), inv, rules, sliced, container_id="b", now=NOW)
    assert allocate(req(MigIndex(0, 1)), inv, rules, sliced, container_id="b", now=NOW).devices == (migs[1].uuid,)
    assert allocate(req(count=1), inv, rules, sliced, container_id="b", now=NOW).devices == (_uuid(1),)
    # MIG UUIDs match case-insensitively, as the ledger's devices do.
    upper = Ledger((lease("a", migs[0].uuid.upper()),))
    with pytest.raises(BusyError):
        allocate(req(GpuIndex(0)), inv, rules, upper, container_id="b", now=NOW)


def test_a_request_for_several_gpus_names_every_full_one() -> None:
    """0,1 with both held: one refusal naming each GPU and its holder; nothing is partly given."""
    inv = host(3)
    ledger = Ledger((lease("a", _uuid(0), pid=1), lease("b", _uuid(1), pid=2)))
    with pytest.raises(BusyError) as excinfo:
        allocate(req(GpuIndex(0), GpuIndex(1), GpuIndex(2)), inv, policies(inv, EXCLUSIVE), ledger,
                 container_id="c", now=NOW)
    assert "GPU 0 (" in str(excinfo.value) and "held by a (pid 1" in str(excinfo.value)
    assert "GPU 1 (" in str(excinfo.value) and "held by b (pid 2" in str(excinfo.value)
    assert "GPU 2 (" not in str(excinfo.value)


# --- the ledger as a value --------------------------------------------------------------------------


def test_ledger_transitions() -> None:
    """reserve (replacing the container's earlier lease) → activate (only by its holder) → release; stale lists the
    leases whose holder is gone; without removes exactly those."""
    a, b = lease("a", _uuid(0), pid=1), lease("b", _uuid(1), pid=2)
    ledger = Ledger().reserve(a).reserve(b)
    assert ledger.leases == (a, b) and a.state is LeaseState.RESERVED
    assert ledger.lease_of("a", a.holder) == a and ledger.lease_of("z", a.holder) is None
    assert ledger.holding(_uuid(0).upper()) == (a,)

    again = lease("a", _uuid(2), pid=1)
    assert ledger.reserve(again).leases == (b, again)

    assert ledger.activate("a", Holder(pid=99, start=1)) == ledger  # another process: unchanged
    active = ledger.activate("a", a.holder)
    assert active.lease_of("a", a.holder) == replace(a, state=LeaseState.ACTIVE)
    assert active.lease_of("b", b.holder) == b
    assert ledger.activate("zz", a.holder) == ledger

    assert ledger.release("a").leases == (b,)
    assert ledger.release("a", Holder(pid=1, start=5)) == ledger  # pid reused by another process: not its lease
    assert ledger.release("a", a.holder).leases == (b,)
    assert ledger.release("nobody") == ledger

    gone = ledger.stale(lambda holder: holder.pid != 2)
    assert gone == (b,)
    assert ledger.without(gone).leases == (a,)
    assert ledger.without(()) == ledger


def test_lease_age_reads_at_a_glance() -> None:
    """42s, 3m12s, 2h05m; an unreadable since is '?'."""
    assert lease("a", pid=1, age_s=42).age(NOW) == "42s"
    assert lease("a", pid=1, age_s=192).age(NOW) == "3m12s"
    assert lease("a", pid=1, age_s=7500).age(NOW) == "2h05m"
    assert replace(lease("a"), since="yesterday").age(NOW) == "?"
    assert timestamp(NOW) == "2026-12-01T12:00:00Z"


def test_ledger_round_trips_through_its_stored_form() -> None:
    """to_object → JSON → from_object gives the same ledger, states and all."""
    ledger = Ledger((lease("a", _uuid(0), _mig(1, 0).uuid, pid=1),
                     replace(lease("b", _uuid(2), pid=2), state=LeaseState.ACTIVE), lease("c", pid=3)))
    stored = json.loads(json.dumps(to_object(ledger)))
    assert stored["format"] == 1
    assert stored["leases"][1] == {"container_id": "b", "devices": [_uuid(2)], "pid": 2, "start_ticks": 1002,
                                   "since": "2026-12-01T11:59:55Z", "state": "active", "migs": []}
    assert from_object(stored, source="leases.json") == ledger
    assert from_object(to_object(Ledger()), source="x") == Ledger()


def _stored(**changes: Any) -> dict[str, Any]:
    item = {"container_id": "a", "devices": [_uuid(0)], "pid": 1, "start_ticks": 9, "since": "2026-12-01T12:00:00Z",
            "state": "reserved"} | changes
    return {"format": 1, "leases": [{k: v for k, v in item.items() if v is not None}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param([], "is not a format-1 lease ledger", id="list"),
        pytest.param({"leases": []}, "is not a format-1 lease ledger", id="no-format"),
        pytest.param({"format": 2, "leases": []}, "is not a format-1 lease ledger", id="format-2"),
        pytest.param({"format": 1, "leases": {}}, "is not a format-1 lease ledger", id="leases-not-a-list"),
        pytest.param({"format": 1, "leases": ["x"]}, "lease 0 is malformed", id="lease-not-an-object"),
        pytest.param(_stored(pid="1"), r"lease 0 is malformed \(pid is '1'\)", id="pid-string"),
        pytest.param(_stored(pid=True), r"lease 0 is malformed \(pid is True\)", id="pid-bool"),
        pytest.param(_stored(start_ticks=None), "lease 0 is malformed", id="no-start"),
        pytest.param(_stored(container_id=7), "lease 0 is malformed", id="id-not-a-string"),
        pytest.param(_stored(devices=_uuid(0)), "lease 0 is malformed", id="devices-not-a-list"),
        pytest.param(_stored(devices=[0]), "lease 0 has a device that is not a UUID string", id="device-not-a-string"),
        pytest.param(_stored(state="held"), "lease 0 is malformed", id="unknown-state"),
        pytest.param(_stored(since=None), "lease 0 is malformed", id="no-since"),
    ],
)
def test_a_malformed_ledger_is_a_state_error(data: Any, message: str) -> None:
    """Anything that is not a ledger is refused naming the file and what is wrong, with the way out."""
    with pytest.raises(StateError, match=message) as excinfo:
        from_object(data, source="/run/gpuhook/leases.json")
    assert str(excinfo.value).startswith("/run/gpuhook/leases.json")
    assert "remove it to start afresh" in str(excinfo.value)


def test_all_capabilities_in_a_policy_allow_every_request() -> None:
    """``capabilities: [all]`` (as NVIDIA_DRIVER_CAPABILITIES spells it) allows every capability; the
    policy then differs from no rule only in being explicit."""
    config = parse_config("gpus:\n  - device: 0\n    capabilities: [all]\n")
    rules = config.gpus.resolve(host(1).gpus)
    assert rules[0].capabilities == frozenset(Capability)
    assert allocate(req(GpuIndex(0), caps=frozenset(Capability)), host(1), rules, Ledger(), container_id="x",
                    now=NOW).devices == (_uuid(0),)
