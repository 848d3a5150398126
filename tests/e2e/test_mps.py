"""Issue 17: ``sharing: mps``: gpuhook runs one MPS control daemon per GPU while containers hold it.

Real runc containers that keep running (``test_leases.Site``) on a simulated H100 80GB host whose driver
root has the simulated host's ``nvidia-cuda-mps-control`` (integration/fakehost/mpscontrol.c: the real
program's daemon mode, control socket, pid file, commands and control.log, without a GPU to serve). What
the daemon was told is read from its control.log, its environment from /proc; what a container got is
what it sees.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.fakehost import FakeHost, create_host

from .test_leases import Site, Started, wait_for

GPU0 = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
MPS0 = [{"device": 0, "sharing": "mps", "replicas": 2}]
#: What the container sees: the daemon's control socket where CUDA looks by default, and what is mounted
#: on /dev/shm (mountinfo field 4: the source's root), then it holds its GPU until killed.
PROBE = ("test -S /tmp/nvidia-mps/control && echo control-socket > /out/mps; "
         "awk '$5 == \"/dev/shm\" {print \"shm=\" $4}' /proc/self/mountinfo >> /out/mps; "
         "ls /dev > /out/.dev && mv /out/.dev /out/dev && exec sleep 1000")


@pytest.fixture
def h100(tmp_path: Path) -> FakeHost:
    return create_host(tmp_path / "h100", gpus=2)


@pytest.fixture
def site(tmp_path: Path, h100: FakeHost, rootfs_src: Path) -> Iterator[Site]:
    made = Site(tmp_path / "site", h100, rootfs_src, MPS0)
    try:
        yield made
    finally:
        made.cleanup()
        for daemon in daemons(made):  # a failing test must not leave its daemon running
            if daemon["pid"] and _alive(daemon["pid"]):
                os.kill(daemon["pid"], signal.SIGKILL)


def daemons(site: Site) -> list[dict[str, Any]]:
    """The MPS daemons in the ledger file, as stored."""
    import json

    path = site.state_dir / "leases.json"
    return json.loads(path.read_text()).get("daemons", []) if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in "ZX"
    except OSError:
        return False


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def control_log(daemon: dict[str, Any]) -> str:
    return (Path(daemon["log_dir"]) / "control.log").read_text()


def sees(started: Started) -> str:
    assert started.returncode == 0, started.stderr
    wait_for(f"{started.id} wrote its listing", (started.bundle.out / "dev").exists)
    return (started.bundle.out / "mps").read_text()


def test_one_daemon_per_gpu_with_the_policys_limits_for_both_clients_and_quit_after_the_last(
        site: Site, h100: FakeHost) -> None:
    """replicas 2 on an 80 GB GPU: the first start brings up one daemon with CUDA_VISIBLE_DEVICES = the GPU's
    UUID, told 50% of the threads and half the memory; both containers see its control socket at
    /tmp/nvidia-mps and its shared memory at /dev/shm; a third is refused; status shows the daemon and its
    clients; after both end it was told quit and is gone."""
    a = site.run(GPU0, script=PROBE)
    assert "control-socket" in sees(a)
    [daemon] = daemons(site)
    pid = daemon["pid"]
    assert environ(pid)["CUDA_VISIBLE_DEVICES"] == h100.gpus[0].uuid
    assert environ(pid)["CUDA_MPS_PIPE_DIRECTORY"] == daemon["pipe_dir"]
    half = (h100.gpus[0].memory_total >> 20) // 2
    log = control_log(daemon)
    assert "Cmd:set_default_active_thread_percentage 50" in log
    assert f"Cmd:set_default_device_pinned_mem_limit 0 {half}M" in log
    b = site.run(GPU0, script=PROBE)
    seen = sees(b)
    assert "control-socket" in seen, seen
    # /dev/shm is the daemon's (a bind of its shm dir: mountinfo's root names that directory)
    assert any(line.startswith("shm=") and line.endswith(f"/mps/{h100.gpus[0].uuid}/shm")
               for line in seen.split()), seen
    assert [d["pid"] for d in daemons(site)] == [pid]  # the same daemon serves both
    site.refused(site.run(GPU0), a.id, b.id, "mps (replicas 2)")
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert gpu0["mps"] == {"pid": pid, "thread_percentage": 50.0, "memory_limit_mib": half,
                           "pipe_directory": daemon["pipe_dir"], "clients": [a.id, b.id]}
    assert 'gpuhook_mps_daemon_up{gpu="0"} 1.0' in site.gpuhook("status", "--prometheus").stdout
    site.delete(a.id)
    assert _alive(pid) and [d["pid"] for d in daemons(site)] == [pid]
    site.delete(b.id)
    assert not _alive(pid), "the daemon outlived its last client"
    assert "Cmd:quit" in control_log(daemon) and daemons(site) == []
    assert 'gpuhook_mps_daemon_up{gpu="0"} 0.0' in site.gpuhook("status", "--prometheus").stdout


def test_a_killed_daemon_is_brought_up_again_by_the_next_start(site: Site) -> None:
    """kill -9 of the daemon between two starts: the next start finds it dead and starts a new one."""
    a = site.run(GPU0, script=PROBE)
    assert "control-socket" in sees(a)
    [first] = daemons(site)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for("the daemon died", lambda: not _alive(first["pid"]))
    b = site.run(GPU0, script=PROBE)
    assert "control-socket" in sees(b)
    [second] = daemons(site)
    assert second["pid"] != first["pid"] and _alive(second["pid"])
    site.delete(a.id)
    site.delete(b.id)
    assert not _alive(second["pid"]) and daemons(site) == []


def test_no_daemon_for_a_gpu_without_an_mps_policy(site: Site) -> None:
    """GPU 1 has no MPS policy: a container on it starts no daemon."""
    other = site.run({"NVIDIA_VISIBLE_DEVICES": "1"})
    assert site.started(other) == {1}
    assert daemons(site) == []


def test_gpuhook_runtime_also_puts_the_limits_in_the_containers_environment(site: Site, h100: FakeHost) -> None:
    """docker --runtime gpuhook (gpuhook-runtime: a spec edit, then its prestart and poststop hooks): the
    container's environment holds CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT with the policy's values (each client's own limits, which a plain
    prestart hook cannot set), it reaches the daemon, and the daemon quits after it."""
    import subprocess
    import sys

    from integration.engines import default_spec, unique_id, write_bundle
    from integration.rootfs import copy_rootfs

    bundle = site.tmp / "runtime-bundle"
    copy_rootfs(site.rootfs_src, bundle / "rootfs")
    write_bundle(bundle, default_spec("rootfs", ["/bin/sh", "-c", "env | grep ^CUDA_MPS_; test -S "
                                                 "/tmp/nvidia-mps/control && echo control-socket"],
                                      ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in GPU0.items()),
                                       "CUDA_MPS_PIPE_DIRECTORY=/somewhere/else"], capabilities=["CAP_MKNOD"]))
    wrapper = Path(sys.executable).with_name("gpuhook-runtime")
    run = subprocess.run([str(wrapper), "run", "--bundle", str(bundle), unique_id("mps-runtime")],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUHOOK_CONFIG": str(site.config)})
    assert run.returncode == 0, run.stderr
    half = (h100.gpus[0].memory_total >> 20) // 2
    assert set(run.stdout.split()) >= {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "control-socket",
                                       "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                                       f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={half}M"}, run.stdout
    assert "CUDA_MPS_PIPE_DIRECTORY=/somewhere/else" not in run.stdout
    assert daemons(site) == []  # its poststop stopped the daemon it was the last client of
