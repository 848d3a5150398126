"""Issue 16: MIG on demand under real runc: ``mig=PROFILE[#NAME]`` makes the instance, its end destroys it.

Each test gets a simulated A100-40GB host of its own in MIG mode with no instances (the mock NVML's
instances are the host's state, shared by every process on it), a ledger of its own, and sleeping
containers (``test_leases.Site``) that hold their instances while the test starts others. What a
container got is what it sees: its /dev/nvidia-caps listing and which nodes open (ENXIO: the device
cgroup lets it through to a driver that is not there; EPERM: the cgroup refuses it). What exists is
asked of the mock NVML through pynvml in a fresh interpreter, as an admin's ``nvidia-smi`` would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from integration.fakehost import FakeHost, create_host, mig

from .conftest import hook_entry
from .test_leases import Site, Started, same_id, wait_for

A100_40 = "NVIDIA A100-SXM4-40GB"
#: Lists the caps nodes and opens every node the container has, then holds its instance until killed.
PROBE = ("ls /dev/nvidia-caps > /out/caps 2>&1; devopen /dev/nvidia0 /dev/nvidia-caps/* > /out/open 2>&1; "
         "ls /dev > /out/.dev && mv /out/.dev /out/dev && exec sleep 1000")

#: What an admin's nvidia-smi would list: (gi, ci, profile name, uuid) of every MIG device of GPU 0.
_LIST = """
import ctypes, json, sys
import pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
out = []
for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
    try:
        dev = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
    except pynvml.NVMLError_NotFound:
        continue
    name = pynvml.nvmlDeviceGetName(dev)
    name = name.decode() if isinstance(name, bytes) else name
    uuid = pynvml.nvmlDeviceGetUUID(dev)
    out.append([pynvml.nvmlDeviceGetGpuInstanceId(dev), pynvml.nvmlDeviceGetComputeInstanceId(dev),
                name.rsplit(" ", 1)[-1], uuid.decode() if isinstance(uuid, bytes) else uuid])
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def nvml_instances(host: FakeHost) -> list[tuple[int, int, str, str]]:
    """(gi, ci, profile, uuid) of every MIG device on GPU 0, as NVML lists them now."""
    proc = subprocess.run([sys.executable, "-I", "-c", _LIST, str(host.nvml_library)], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [tuple(item) for item in json.loads(proc.stdout)]  # type: ignore[misc]


@pytest.fixture
def a100(tmp_path: Path) -> FakeHost:
    """An A100-40GB in MIG mode with no instances, and a second one with MIG off (a host of this test's own)."""
    return create_host(tmp_path / "a100", gpus=2, model=A100_40, mig={0: ()})


@pytest.fixture
def site(tmp_path: Path, a100: FakeHost, rootfs_src: Path) -> Iterator[Site]:
    """A ledger and no sharing policy on the A100 host; its containers force-deleted after the test."""
    made = Site(tmp_path / "site", a100, rootfs_src, ())
    try:
        yield made
    finally:
        made.cleanup()


def mig_records(site: Site) -> list[dict[str, Any]]:
    """Every MIG record in the ledger file (leases' and the recycle list's), as stored."""
    path = site.state_dir / "leases.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return [r for lease in data["leases"] for r in lease["migs"]] + data.get("recycle", [])


def events(host: FakeHost, container_id: str) -> list[dict[str, Any]]:
    """The hook log's events of *container_id*."""
    lines = (host.root / "gpuhook.log").read_text().splitlines()
    return [e for line in lines if (e := json.loads(line)).get("container_id") == container_id]


def caps_seen(started: Started) -> tuple[list[str], str]:
    """The caps nodes *started* lists, and what opening its nodes said."""
    assert started.returncode == 0, started.stderr
    wait_for(f"{started.id} wrote its listings", (started.bundle.out / "dev").exists)
    out = started.bundle.out
    return sorted((out / "caps").read_text().split()), (out / "open").read_text()


def test_named_instance_is_made_for_the_container_and_destroyed_after(site: Site, a100: FakeHost) -> None:
    """0,mig=3g.20gb#instance1: one 3g.20gb GI+CI is made; the container gets /dev/nvidia0 and exactly its two
    caps nodes (both open: ENXIO); status names it the holder; after `runc delete` the instance is gone."""
    assert nvml_instances(a100) == []
    a = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb#instance1"}, script=PROBE)
    caps, opened = caps_seen(a)
    [(gi, ci, profile, uuid)] = nvml_instances(a100)
    assert profile == "3g.20gb"
    want = [f"nvidia-cap{mig.gi_minor(0, gi)}", f"nvidia-cap{mig.ci_minor(0, gi, ci)}"]
    assert caps == sorted(want), opened
    assert "/dev/nvidia0 ENXIO" in opened
    assert all(f"/dev/nvidia-caps/{node} ENXIO" in opened for node in want), opened
    status = site.status()
    assert status["mig_devices"] == [{"uuid": uuid, "gpu_index": 0, "profile": "3g.20gb", "name": "instance1",
                                      "created_by_gpuhook": True, "holder": a.id}]
    # The instance is a live fact: a start that selects it by UUID plans from the cache, without NVML.
    calls = len(a100.nvml_calls())
    b = site.run({"NVIDIA_VISIBLE_DEVICES": uuid})
    assert site.started(b) == {0}
    assert [e["cache"] for e in events(a100, b.id) if e["event"] == "host_discovered"] == ["hit"]
    assert len(a100.nvml_calls()) == calls, "the start after the instance was made asked NVML"
    site.delete(b.id)
    site.delete(a.id)
    assert nvml_instances(a100) == []
    assert mig_records(site) == [] and site.leases() == []


def test_two_3g_fit_a_third_is_refused_naming_both_and_a_name_has_one_holder(site: Site, a100: FakeHost) -> None:
    """Two mig=3g.20gb starts get one instance each (two fit); a third is refused naming both holders and what
    is on the GPU; #instance1 asked by a second container is refused naming the first while it runs."""
    a = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb#instance1"})
    b = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"})
    assert site.started(a) == site.started(b) == {0}
    made = nvml_instances(a100)
    assert len(made) == 2 and len({uuid for *_, uuid in made}) == 2
    site.refused(site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"}), a.id, b.id, "no room for a 3g.20gb",
                 "what still fits")
    site.delete(b.id)
    site.refused(site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb#instance1"}), "'instance1'", a.id,
                 "another #NAME")
    assert len(nvml_instances(a100)) == 1  # the refused start made nothing, and b's instance went with b


def test_seven_concurrent_1g_starts_get_distinct_instances_an_eighth_is_refused(site: Site, a100: FakeHost) -> None:
    """Seven mig=1g.5gb starts at once all run on distinct instances; an eighth is refused; once all are
    deleted no instance is left (and no record)."""
    bundles = [site.bundle({"NVIDIA_VISIBLE_DEVICES": "mig=1g.5gb"}) for _ in range(7)]
    with ThreadPoolExecutor(max_workers=7) as pool:
        started = list(pool.map(site.start, bundles))
    for one in started:
        assert site.started(one) == {0}, one.stderr
    made = nvml_instances(a100)
    assert len(made) == 7 and len({uuid for *_, uuid in made}) == 7
    held = {d for lease in site.leases() for d in lease["devices"]}
    assert held == {uuid for *_, uuid in made}
    site.refused(site.run({"NVIDIA_VISIBLE_DEVICES": "mig=1g.5gb"}), "no room for a 1g.5gb")
    for one in started:
        site.delete(one.id)
    assert nvml_instances(a100) == [] and mig_records(site) == []


def test_admin_instance_is_reused_when_free_and_kept_after(tmp_path: Path, rootfs_src: Path) -> None:
    """An admin's 3g.20gb instance is given to mig=3g.20gb while free (nothing is made), and still exists after
    the container ends; a second mig=3g.20gb meanwhile gets a new instance, destroyed after it."""
    host = create_host(tmp_path / "host", gpus=1, model=A100_40, mig={0: ("3g.20gb",)})
    admin = host.mig_devices[0]
    site = Site(tmp_path / "site", host, rootfs_src, ())
    try:
        a = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"}, script=PROBE)
        caps, _ = caps_seen(a)
        assert caps == sorted([f"nvidia-cap{admin.gi_cap_minor}", f"nvidia-cap{admin.ci_cap_minor}"])
        assert [uuid for *_, uuid in nvml_instances(host)] == [admin.uuid]
        b = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"})
        assert site.started(b) == {0}
        assert len(nvml_instances(host)) == 2
        [record] = [m for m in site.status()["mig_devices"] if m["uuid"] == admin.uuid]
        assert record == {"uuid": admin.uuid, "gpu_index": 0, "profile": "3g.20gb", "name": None,
                          "created_by_gpuhook": False, "holder": a.id}
        site.delete(a.id)
        site.delete(b.id)
        assert [uuid for *_, uuid in nvml_instances(host)] == [admin.uuid]
    finally:
        site.cleanup()


def test_killed_container_without_poststop_has_its_instance_destroyed_by_the_next_start(
        site: Site, a100: FakeHost) -> None:
    """kill -9 of a container registered without poststop (and no gpuhookd): its instance outlives it until the
    next start (any GPU start: here one for the other GPU, whole) reclaims the lease and destroys it;
    `gpuhook status` does the same for another."""
    a = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=4g.20gb"}, poststop=False)
    assert site.started(a) == {0}
    site.kill(a.id)
    assert len(nvml_instances(a100)) == 1  # nobody has noticed yet
    other = site.run({"NVIDIA_VISIBLE_DEVICES": "1"})
    assert site.started(other) == {1}
    assert nvml_instances(a100) == [] and mig_records(site) == []
    b = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=4g.20gb"}, poststop=False)
    assert site.started(b) == {0}, b.stderr
    [(_, _, profile, uuid)] = nvml_instances(a100)
    assert profile == "4g.20gb"
    assert {lease["container_id"]: lease["devices"] for lease in site.leases()} == {
        other.id: [a100.gpus[1].uuid], b.id: [uuid]}
    site.kill(b.id)
    assert site.status()["mig_devices"] == []
    assert nvml_instances(a100) == [] and mig_records(site) == []


def test_a_start_that_fails_after_making_its_instance_destroys_it(site: Site, a100: FakeHost) -> None:
    """The image asks for a CUDA newer than the driver (NVIDIA_REQUIRE_CUDA): refused after the instance was
    made and leased; the refusal leaves no instance, no record and no lease."""
    started = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=1g.5gb", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"})
    site.refused(started, "cuda>=99.0")
    assert nvml_instances(a100) == [] and mig_records(site) == []


@pytest.mark.parametrize(("value", "needles"), [
    pytest.param("1,mig=3g.20gb", ["GPU 1", "not in MIG mode", "nvidia-smi -i 1 -mig 1", "reset"], id="mig-off"),
    pytest.param("0,mig=5g.30gb", ["no MIG profile '5g.30gb'", "3g.20gb (19.5 GiB, up to 2)"], id="unknown-profile"),
    pytest.param("0,mig=3g", ["'mig=3g' is not a MIG instance request", "mig=PROFILE#NAME"], id="malformed"),
])
def test_mig_errors_say_the_fix(site: Site, value: str, needles: list[str]) -> None:
    """Each refusal is one line that names the value and says what to do; nothing is left behind."""
    started = site.run({"NVIDIA_VISIBLE_DEVICES": value})
    site.refused(started, *needles)
    assert len([line for line in started.stderr.splitlines() if "gpuhook: " in line]) == 1, started.stderr


def test_a_policy_instance_gives_a_request_for_the_gpu_an_instance(tmp_path: Path, a100: FakeHost,
                                                                  rootfs_src: Path) -> None:
    """GPU 0's policy says MIGMode {Enable: true, Instance: 1g.5gb}: NVIDIA_VISIBLE_DEVICES=0 gets a 1g.5gb
    instance made for it (its two caps nodes), destroyed once the container is deleted."""
    site = Site(tmp_path / "policy", a100, rootfs_src, [{"device": 0, "mig": {"enable": True, "instance": "1g.5gb"}}])
    try:
        a = site.run({"NVIDIA_VISIBLE_DEVICES": "0"}, script=PROBE)
        caps, _ = caps_seen(a)
        [(gi, ci, profile, _uuid)] = nvml_instances(a100)
        assert profile == "1g.5gb"
        assert caps == sorted([f"nvidia-cap{mig.gi_minor(0, gi)}", f"nvidia-cap{mig.ci_minor(0, gi, ci)}"])
        site.delete(a.id)
        assert nvml_instances(a100) == []
    finally:
        site.cleanup()


def test_a_same_id_container_of_another_runc_root_gets_nothing_of_the_first_ones_instance(
        site: Site, a100: FakeHost) -> None:
    """Issue 31: A holds 3g.20gb #instance1. B, with A's id under another runc root, asking for #instance1 is
    refused naming A and its pid, and handed nothing; C (A's id, that root) asking unnamed gets an instance of
    its own. C's delete destroys C's only: A's keeps its name, its lease and its record until A's delete."""
    a = site.run({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb#instance1"})
    assert site.started(a) == {0}
    [(*_, first)] = nvml_instances(a100)
    root2 = site.tmp / "runc2"
    b = site.start(same_id(site.bundle({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb#instance1"}), a, root2))
    assert b.returncode != 0 and "'instance1'" in b.stderr and f"held by {a.id} (pid {site.pid(a.id)}," in b.stderr
    assert "Traceback" not in b.stderr and not list(b.bundle.out.iterdir()), b.stderr
    assert [uuid for *_, uuid in nvml_instances(a100)] == [first]
    assert [(r["uuid"], r["name"], r["created"]) for r in mig_records(site)] == [(first, "instance1", True)]

    c = site.start(same_id(site.bundle({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"}), a, root2))
    assert site.started(c) == {0}
    [second] = {uuid for *_, uuid in nvml_instances(a100)} - {first}
    assert sorted((lease["pid"], lease["devices"]) for lease in site.leases()) == sorted(
        [(site.pid(a.id), [first]), (site.pid(a.id, root=root2), [second])])
    site.delete(a.id, root=root2)
    assert [uuid for *_, uuid in nvml_instances(a100)] == [first]
    assert [(r["uuid"], r["name"], r["created"]) for r in mig_records(site)] == [(first, "instance1", True)]
    site.delete(a.id)
    assert nvml_instances(a100) == [] and mig_records(site) == [] and site.leases() == []


def test_a_second_start_stage_that_refuses_leaves_no_instance(site: Site, a100: FakeHost) -> None:
    """Issue 31: gpuhook registered at prestart and at createRuntime on one ledger; the first stage makes the
    1g.5gb instance, the second refuses the start (its config checks NVIDIA_REQUIRE_CUDA, the first's is told
    disable_require): the refusal leaves no instance on the GPU (as NVML lists them), no record, no lease."""
    lenient = site.tmp / "lenient.yaml"
    lenient.write_text(site.config.read_text() + "disable_require: true\n")
    started = site.start(site.bundle({"NVIDIA_VISIBLE_DEVICES": "0,mig=1g.5gb", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"},
                                     prestart=hook_entry(lenient, "prestart"),
                                     create_runtime=hook_entry(site.config, "createRuntime")))
    site.refused(started, "cuda>=99.0")
    made = [e["uuid"] for e in events(a100, started.id) if e["event"] == "mig_created"]
    assert len(made) == 1, events(a100, started.id)  # the first stage made it
    assert nvml_instances(a100) == [] and mig_records(site) == [] and site.leases() == []
