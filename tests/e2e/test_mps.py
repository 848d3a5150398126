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
#: What the container sees: the daemon's control socket where CUDA looks by default (and what else is in
#: that directory), the filesystem type and superblock options of the top mount on /dev/shm (mountinfo's
#: fields after the " - ") and its mount options (field 6), a file of its own in /dev/shm; then it holds its
#: GPU until killed.
PROBE = ("test -S /tmp/nvidia-mps/control && echo control-socket > /out/mps; "
         "echo pipes=$(ls -A /tmp/nvidia-mps | tr '\\n' ,) >> /out/mps; "
         "awk '$5 == \"/dev/shm\" {for (i = 7; i < NF; i++) if ($i == \"-\") shm = $(i + 1) \",\" $(i + 3) \";\" $6} "
         "END {print \"shm=\" shm}' /proc/self/mountinfo >> /out/mps; "
         "echo > /dev/shm/from-$(cat /proc/sys/kernel/random/uuid); "
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
    # /dev/shm is the daemon's: a 64 MiB tmpfs by default, where both containers' files land
    assert "shm=tmpfs,rw,size=65536k;rw,nosuid,nodev,noexec,relatime" in seen.split(), seen
    assert len(list(Path(daemon["shm_dir"]).glob("from-*"))) == 2
    assert [d["pid"] for d in daemons(site)] == [pid]  # the same daemon serves both
    site.refused(site.run(GPU0), a.id, b.id, "mps (replicas 2)")
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert gpu0["mps"] == {"pid": pid, "thread_percentage": 50.0, "memory_limit_mib": half,
                           "pipe_directory": daemon["pipe_dir"], "clients": [a.id, b.id], "ok": True,
                           "problems": [], "restart": "same-directories"}
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


def in_container(site: Site, container_id: str, script: str) -> str:
    """*script* run by ``runc exec`` in the container, as one of its own processes (the tenant's); its output."""
    proc = site.runc_cmd("exec", container_id, "/bin/sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def ask(site: Site, container_id: str, command: str, *, pipe: str = "/tmp/nvidia-mps") -> str:
    """``echo COMMAND | nvidia-cuda-mps-control`` in the container (the driver's, which gpuhook injects)."""
    return in_container(site, container_id, f"echo {command} | CUDA_MPS_PIPE_DIRECTORY={pipe} "
                                            "nvidia-cuda-mps-control 2>&1; echo status=$?")


def test_a_tenant_can_neither_quit_the_daemon_nor_serve_the_others_from_a_daemon_of_its_own(
        site: Site, h100: FakeHost) -> None:
    """Through its own processes, a tenant of a sharing: mps GPU: its /tmp/nvidia-mps holds the client socket
    alone, read-only; quit and new limits are refused; a daemon of its own cannot start there, nor can it
    plant or remove an entry (EROFS); one elsewhere serves only itself. The other tenant still reaches
    gpuhook's daemon with the policy's 50%, and status and the metrics say all is well."""
    a = site.run(GPU0, script=PROBE)
    b = site.run(GPU0, script=PROBE)
    assert "pipes=control," in sees(a).split() and "pipes=control," in sees(b).split()
    [daemon] = daemons(site)
    assert "Permission denied" in ask(site, a.id, "quit")
    assert "Permission denied" in ask(site, a.id, "set_default_active_thread_percentage 100")
    own = in_container(site, a.id, "nvidia-cuda-mps-control -d 2>&1; echo status=$?; "
                                   "mkfifo /tmp/nvidia-mps/control2 2>&1; rm -f /tmp/nvidia-mps/control 2>&1; true")
    assert "status=1" in own and own.count("Read-only file system") == 3, own
    assert ask(site, a.id, "get_default_active_thread_percentage", pipe="/tmp/nvidia-mps") == "50.0\nstatus=0\n"
    elsewhere = in_container(site, a.id, "CUDA_MPS_PIPE_DIRECTORY=/tmp/own CUDA_MPS_LOG_DIRECTORY=/tmp/own-log "
                                         "nvidia-cuda-mps-control -d && echo started")
    assert elsewhere == "started\n"
    assert ask(site, a.id, "set_default_active_thread_percentage 100", pipe="/tmp/own") == "100.0\nstatus=0\n"
    assert _alive(daemon["pid"]) and [d["pid"] for d in daemons(site)] == [daemon["pid"]]
    assert ask(site, b.id, "get_default_active_thread_percentage") == "50.0\nstatus=0\n"
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert (gpu0["mps"]["ok"], gpu0["mps"]["problems"]) == (True, [])
    metric = f'gpuhook_mps_daemon_ok{{gpu="0",uuid="{h100.gpus[0].uuid}"}} 1.0'
    assert metric in site.gpuhook("status", "--prometheus").stdout


def test_limits_told_by_someone_else_show_in_status_and_the_next_start_tells_them_again(
        site: Site, h100: FakeHost) -> None:
    """Someone with the host's control_privileged gives the daemon 100%: status says it is not as recorded, the
    metric is 0; the next start tells it the policy's 50% again, and both say so."""
    import subprocess

    a = site.run(GPU0, script=PROBE)
    sees(a)
    [daemon] = daemons(site)
    control = h100.root / "usr/bin/nvidia-cuda-mps-control"
    env = {"CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_dir"], "CUDA_MPS_LOG_DIRECTORY": daemon["log_dir"]}
    told = subprocess.run([control], input="set_default_active_thread_percentage 100\n", env=env,
                          capture_output=True, text=True, timeout=10, check=True)
    assert told.stdout == "100.0\n"
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert gpu0["mps"]["ok"] is False
    assert gpu0["mps"]["problems"] == ["it reports 100.0% of the SMs per client, not 50%"]
    assert "MPS daemon NOT as gpuhook recorded it: it reports 100.0%" in site.gpuhook("status").stdout
    metric = f'gpuhook_mps_daemon_ok{{gpu="0",uuid="{h100.gpus[0].uuid}"}}'
    assert f"{metric} 0.0" in site.gpuhook("status", "--prometheus").stdout
    b = site.run(GPU0, script=PROBE)
    sees(b)
    assert [d["pid"] for d in daemons(site)] == [daemon["pid"]]  # the same daemon, told again
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert (gpu0["mps"]["ok"], gpu0["mps"]["problems"]) == (True, [])
    assert f"{metric} 1.0" in site.gpuhook("status", "--prometheus").stdout


def test_a_daemon_killed_while_a_container_holds_the_gpu_restarts_where_the_holder_reaches_it(
        site: Site) -> None:
    """kill -9 of the daemon while A holds the GPU; B's start restarts it in the same directories: A, through
    the mounts it got at its start, reaches the new daemon (told the policy's limits) and still shares
    /dev/shm with B."""
    a = site.run(GPU0, script=PROBE)
    sees(a)
    [first] = daemons(site)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for("the daemon died", lambda: not _alive(first["pid"]))
    [gpu0] = [g for g in site.status()["gpus"] if g["index"] == 0]
    assert gpu0["mps"]["problems"] == [f"its control daemon (pid {first['pid']}) is not running"]
    assert gpu0["mps"]["restart"] == "same-directories"
    b = site.run(GPU0, script=PROBE)
    sees(b)
    [second] = daemons(site)
    assert second["pid"] != first["pid"] and _alive(second["pid"])
    assert {k: v for k, v in second.items() if k not in ("pid", "start_ticks")} == \
        {k: v for k, v in first.items() if k not in ("pid", "start_ticks")}
    assert ask(site, a.id, "get_default_active_thread_percentage") == "50.0\nstatus=0\n"
    assert in_container(site, a.id, "ls /dev/shm | wc -l").strip() == "2"  # its file and B's
    site.delete(a.id)
    site.delete(b.id)
    assert not _alive(second["pid"]) and daemons(site) == []


def test_a_tenant_filling_dev_shm_fills_only_the_gpus_bounded_tmpfs(
        tmp_path: Path, h100: FakeHost, rootfs_src: Path) -> None:
    """mps.shm_size 2M: the GPU's /dev/shm is a 2 MiB tmpfs, on no filesystem the ledger is on; a tenant
    writing 8 MiB there gets ENOSPC at 2 MiB, and the next start (which writes leases.json) still works. The
    tenants killed without their poststop, the next reclaim (status) unmounts it."""
    site = Site(tmp_path / "site", h100, rootfs_src,
                [{"device": 0, "sharing": "mps", "replicas": 2, "mps": {"shm_size": "2M"}}])
    try:
        a = site.run(GPU0, script=PROBE)
        assert "shm=tmpfs,rw,size=2048k;rw,nosuid,nodev,noexec,relatime" in sees(a).split()
        [daemon] = daemons(site)
        shm = Path(daemon["shm_dir"])
        assert os.stat(shm).st_dev != os.stat(site.state_dir).st_dev
        filled = in_container(site, a.id, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=8 2>&1; echo status=$?")
        assert "No space left on device" in filled and "status=1" in filled, filled
        assert (shm / "fill").stat().st_size <= 2 << 20
        b = site.run(GPU0, script=PROBE)
        sees(b)
        assert len(site.leases()) == 2
        site.kill(a.id)
        site.kill(b.id)
        site.status()
        assert daemons(site) == [] and not shm.exists()
        assert str(shm) not in Path("/proc/self/mountinfo").read_text()
    finally:
        site.cleanup()
        for left in daemons(site):
            if left["pid"] and _alive(left["pid"]):
                os.kill(left["pid"], signal.SIGKILL)


def test_gpuhookd_serving_the_start_gives_the_same_client_view_and_tmpfs(site: Site, h100: FakeHost) -> None:
    """A start gpuhookd's worker serves (it takes the hook's view of the host first): the daemon it starts is
    reached through the read-only client view, refuses the tenant's quit, and its /dev/shm tmpfs is mounted
    on the host, where the container's poststop unmounts it."""
    import json
    import sys

    from integration.gpuhookd import Gpuhookd

    from .conftest import hook_entry

    gpuhookd = Gpuhookd(sys.executable, site.tmp / "gpuhookd", config=site.config)
    try:
        a = site.run(GPU0, script=PROBE, prestart=hook_entry(site.config, "--daemon-socket", gpuhookd.socket,
                                                             "prestart"))
        seen = sees(a).split()
        assert "pipes=control," in seen and "shm=tmpfs,rw,size=65536k;rw,nosuid,nodev,noexec,relatime" in seen
        served = [json.loads(line) for line in (h100.root / "gpuhook.log").read_text().splitlines() if a.id in line]
        assert any(e.get("event") == "mps_daemon" and e.get("served_by") == "gpuhookd" for e in served), served
        assert "Permission denied" in ask(site, a.id, "quit")
        [daemon] = daemons(site)
        assert _alive(daemon["pid"]) and daemon["shm_dir"] in Path("/proc/self/mountinfo").read_text()
        site.delete(a.id)
        assert daemons(site) == [] and daemon["shm_dir"] not in Path("/proc/self/mountinfo").read_text()
    finally:
        journal = gpuhookd.stop()
    assert "Traceback" not in journal, journal
