"""Issue 17's pure core: the ``sharing: mps`` policy (both syntaxes), each client's limits, the ledger's daemons."""

from __future__ import annotations

import json

import pytest

from gpuhook.errors import ConfigError, PolicyError, StateError
from gpuhook.inventory import Gpu
from gpuhook.request.model import GpuIndex
from gpuhook.sharing.allocate import allocate
from gpuhook.sharing.ledger import Holder, Lease, Ledger, MpsDaemon, from_object, to_object
from gpuhook.sharing.policy import (DEFAULT_SHM_SIZE_MIB, GpuPolicy, MpsLimits, Sharing, client_limits,
                                    decode_device_file, decode_gpus, shm_size_mib)
from tests.unit.test_sharing import NOW, host, req

UUID = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"


def gpu(memory_mib: int | None = 81559) -> Gpu:
    return Gpu(index=0, uuid=UUID, minor=0, pci_bus_id="00000000:18:00.0", model="NVIDIA H100 80GB HBM3",
               memory_mib=memory_mib)


def test_both_syntaxes_give_the_same_mps_policy() -> None:
    yaml_form = decode_gpus([{"device": 0, "sharing": "mps", "replicas": 4,
                              "mps": {"thread_percentage": 30, "memory_limit": "10G"}}], source="t")
    file_form = decode_device_file({"Devices": [{"DeviceID": "0", "Sharing": "mps", "Replicas": 4,
                                                 "MPS": {"ThreadPercentage": 30, "MemoryLimit": 10240}}]},
                                   source="t")
    assert yaml_form.entries == file_form.entries == (
        GpuPolicy(device="0", sharing=Sharing.MPS, replicas=4,
                  mps=MpsLimits(thread_percentage=30.0, memory_limit_mib=10240)),)


def test_the_shm_size_is_the_policys_else_64_mib_as_nvidias_device_plugin_mounts() -> None:
    """mps.shm_size (MiB, or "1G"; ShmSize in the device file) sizes the GPU's /dev/shm tmpfs; 64 MiB without it."""
    [sized] = decode_gpus([{"device": 0, "sharing": "mps", "replicas": 2, "mps": {"shm_size": "1G"}}],
                          source="t").entries
    [default] = decode_gpus([{"device": 0, "sharing": "mps", "replicas": 2}], source="t").entries
    [from_file] = decode_device_file({"Devices": [{"DeviceID": "0", "Sharing": "mps", "Replicas": 2,
                                                   "MPS": {"ShmSize": 256}}]}, source="t").entries
    assert (shm_size_mib(sized), shm_size_mib(default), shm_size_mib(from_file)) == (1024, DEFAULT_SHM_SIZE_MIB, 256)
    assert DEFAULT_SHM_SIZE_MIB == 64


def test_client_limits_default_to_the_share_per_replica_as_nvidias_device_plugin_sets_them() -> None:
    [policy] = decode_gpus([{"device": 0, "sharing": "mps", "replicas": 2}], source="t").entries
    assert policy.mps == MpsLimits()
    assert client_limits(policy, gpu()) == (50.0, 81559 // 2)
    [three] = decode_gpus([{"device": 0, "sharing": "mps", "replicas": 3, "mps": {"memory_limit": "512M"}}],
                          source="t").entries
    assert client_limits(three, gpu()) == (33.33, 512)
    with pytest.raises(ConfigError, match=r"NVML reports no memory size .* set its mps.memory_limit"):
        client_limits(policy, gpu(memory_mib=None))


@pytest.mark.parametrize(("entry", "message"), [
    ({"device": 0, "sharing": "shared", "replicas": 2, "mps": {"thread_percentage": 50}},
     r"gpus\[0\]: mps contradicts sharing 'shared'"),
    ({"device": 0, "sharing": "exclusive", "mps": {}}, r"mps contradicts sharing 'exclusive'"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mig": {"enable": True}},
     r"sharing 'mps' and mig on one GPU: MPS runs on a whole GPU"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"thread_percentage": 0}},
     r"mps.thread_percentage must be a percentage above 0 and at most 100, got 0"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"thread_percentage": True}}, r"got True"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"memory_limit": "10 GB"}},
     r"mps.memory_limit must be MiB as a whole number \(10240\) or a size like \"10G\""),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"threads": 5}}, r"unknown key\(s\) threads"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"shm_size": "64 MB"}},
     r"gpus\[0\].mps.shm_size must be MiB as a whole number \(10240\) or a size like \"10G\" or \"512M\", "
     r"got '64 MB'"),
    ({"device": 0, "sharing": "mps", "replicas": 2, "mps": {"shm_size": 0}}, r"mps.shm_size must be MiB"),
])
def test_mps_policies_that_cannot_work_are_refused_naming_the_key(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_gpus([entry], source="t")


def test_daemons_round_trip_and_idle_ones_are_those_no_lease_holds() -> None:
    daemon = MpsDaemon(gpu=UUID, pipe_dir="/run/gpuhook/mps/x/pipe", log_dir="/run/gpuhook/mps/x/log",
                       shm_dir="/run/gpuhook/mps/x/shm", thread_percentage=50.0, memory_limit_mib=40779,
                       holder=Holder(pid=42, start=4242))
    starting = MpsDaemon(gpu="GPU-11111111-aaaa-bbbb-cccc-dddddddddddd", pipe_dir="p", log_dir="l", shm_dir="s",
                         thread_percentage=25.0, memory_limit_mib=100)
    held = Lease(container_id="a", devices=(UUID,), holder=Holder(pid=1, start=1), since="x")
    ledger = Ledger((held,), daemons=(daemon, starting))
    assert from_object(json.loads(json.dumps(to_object(ledger))), source="leases.json") == ledger
    assert ledger.idle_daemons() == (starting,)
    assert ledger.release("a").idle_daemons() == (daemon, starting)
    assert ledger.release("a").daemons == ledger.daemons  # ending a lease keeps the records (stopped, then dropped)
    stored = to_object(ledger)
    stored["daemons"][0]["start_ticks"] = None
    with pytest.raises(StateError, match="MPS daemon list is malformed"):
        from_object(stored, source="leases.json")


def test_a_container_reaches_one_mps_daemon() -> None:
    """Two GPUs each shared through MPS in one request: refused (one /tmp/nvidia-mps, one daemon)."""
    inventory = host(2)
    mps = GpuPolicy(sharing=Sharing.MPS, replicas=2, mps=MpsLimits())
    with pytest.raises(PolicyError, match=r"GPUs 0, 1 are each shared through an MPS daemon of their own"):
        allocate(req(GpuIndex(0), GpuIndex(1)), inventory, {0: mps, 1: mps}, Ledger(), container_id="c", now=NOW)
