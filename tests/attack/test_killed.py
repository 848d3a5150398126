"""Issue 14 item 7: the hook, or a gpuhookd worker, killed at each apply step leaves the rootfs and the host as before.

``killat.py`` stops the apply at one exact syscall through a seccomp user notification, SIGKILLs the
hook (or the worker) while the call waits, and then lets the call go on: the apply child meets its
parent's death in the middle of that very step. It closes its report FIFO once the apply child has
exited, which is the event these tests wait for before they look at the rootfs.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration.engines import run_container, unique_id
from integration.fakehost import FakeHost, create_host
from integration.gpuhookd import Gpuhookd

from .conftest import Progs
from .rig import GPU0, GPU_PROBE, HERE, PYTHON, Rig, Via, diff, hook_command, snapshot

KILLAT = HERE / "killat.py"
COMPAT = "usr/local/cuda/compat"
COMPAT_VERSION = "560.28.03"  # newer than the simulated host's driver: the compat step runs
REPORT_TIMEOUT_S = 30.0

#: (syscall sequence that triggers the kill, whether gpuhook writes the ld.so.cache itself) on x86_64; the kill
#: lands at the last call. The rig's container has no /proc/driver/nvidia (no module here), so the first
#: fsmount and the mounts after it are the ldconfig sandbox's: they exist only where ldconfig runs.
STEPS = [
    pytest.param(("259", True), id="mknod"),
    pytest.param(("429", True), id="first-bind-mount"),
    pytest.param(("429,429", True), id="second-bind-mount"),
    pytest.param(("266", True), id="symlink"),
    pytest.param(("432", False), id="proc-tmpfs-made"),
    pytest.param(("432,429", False), id="proc-tmpfs-attached"),
    pytest.param(("432,429,429", False), id="proc-gpu-dir-bind"),
    pytest.param(("257=00-gpuhook-cuda-compat.conf", True), id="compat-conf"),
    pytest.param(("322", False), id="ldconfig-exec"),
    pytest.param(("257=ld.so.cache~", True), id="ldcache-written"),
    pytest.param(("44^c", True), id="after-report-before-commit")  # the commit byte,
]


def step_config(config: Path, native: bool) -> Path:
    """*config*, or beside it a copy with the sandboxed ldconfig where the step is one of its own."""
    if native:
        return config
    sandboxed = config.with_name(f"{config.stem}-sandboxed-ldconfig.yaml")
    sandboxed.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "ldconfig_native": False}))
    return sandboxed


@pytest.fixture(scope="module")
def compat_lib(progs: Progs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real shared object with SONAME libcuda.so.1, to stand for the image's newer compat libcuda."""
    out = tmp_path_factory.mktemp("compat") / f"libcuda.so.{COMPAT_VERSION}"
    source = out.with_name("stub.c")
    source.write_text("int cuda_compat_stub(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(source)], check=True)
    del progs  # built first: the suite's gcc check
    return out


def compat_image(lib: Path) -> Callable[[Path], None]:
    """An image preparation: *lib* in /usr/local/cuda/compat with its SONAME link, as CUDA images ship it."""
    def prepare(rootfs: Path) -> None:
        compat = rootfs / COMPAT
        compat.mkdir(parents=True)
        shutil.copy(lib, compat / lib.name)
        (compat / "libcuda.so.1").symlink_to(lib.name)
    return prepare


@pytest.fixture
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """The FIFO killat.py reports on, opened for reading (outside the rig's tree), and our end of it."""
    path = tmp_path_factory.mktemp("killat") / "report"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        yield path, fd
    finally:
        os.close(fd)


def read_report(fd: int) -> str:
    """Everything killat.py wrote, up to its close (the apply child has exited)."""
    chunks: list[bytes] = []
    while select.select([fd], [], [], REPORT_TIMEOUT_S)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks).decode()
        chunks.append(chunk)
    raise AssertionError(f"killat.py did not report the end of the undo within {REPORT_TIMEOUT_S:g} s: {chunks}")


def run_killed(rig: Rig, hook: dict[str, Any], fd: int, lib: Path) -> None:
    """Run a GPU 0 container with *hook*; once the apply child is gone, the rootfs and the host are as before."""
    container = rig.container(GPU0, GPU_PROBE, prepare=compat_image(lib), hook=hook)
    before, host_before = snapshot(container.rootfs), rig.host_state()
    result = run_container("runc", container.bundle, unique_id("gpuhook-attack"), timeout=20)
    said = read_report(fd)
    assert said.startswith("killed "), f"the kill never happened (the step was not reached): {said!r}\n{result.stderr}"
    assert result.returncode != 0 and "@@start" not in result.stdout, result.stdout
    assert not rig.kill_leftovers(), "processes outlived the undo"
    rig.assert_host_unchanged(host_before)
    changed = diff(before, snapshot(container.rootfs))
    assert not changed, f"{said}the killed start left in the rootfs:\n" + "\n".join(changed) + result.stderr[-2000:]


@pytest.mark.parametrize("step", STEPS)
def test_hook_killed_mid_apply_leaves_nothing(hook_rig: Rig, report: tuple[Path, int], compat_lib: Path,
                                             step: tuple[str, bool]) -> None:
    """The in-process hook SIGKILLed (a runtime's hook timeout) at the step: its apply child undoes everything."""
    path, fd = report
    trigger, native = step
    argv = hook_command(step_config(hook_rig.base_config, native))
    hook = {"path": PYTHON, "args": [PYTHON, "-I", str(KILLAT), str(path), trigger, "hook", "--", *argv],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    run_killed(hook_rig, hook, fd, compat_lib)


@pytest.fixture
def killing_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hook_rig: Rig,
                   report: tuple[Path, int]) -> Iterator[Gpuhookd]:
    """gpuhookd under killat.py, armed with the test's trigger (``wrapper`` runs only the daemon under it)."""
    path, _ = report
    trigger, native = request.param
    daemon = daemon_under_killat(tmp_path_factory.mktemp("killd"), path, trigger,
                                 step_config(hook_rig.base_config, native))
    yield daemon
    journal = daemon.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal


def daemon_under_killat(base: Path, report: Path, trigger: str, config: Path) -> Gpuhookd:
    """gpuhookd serving *config* under killat.py armed with *trigger* (``wrapper`` runs only the daemon under it)."""
    wrapper = base / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$4" = daemon ]; then exec {PYTHON} -I {KILLAT} {report} {trigger} worker -- {PYTHON} "$@"; fi\n'
        f'exec {PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    return Gpuhookd(wrapper, base / "run", config=config)


@pytest.mark.parametrize("killing_daemon", STEPS, indirect=True)
def test_worker_killed_mid_apply_leaves_nothing(hook_rig: Rig, killing_daemon: Gpuhookd, report: tuple[Path, int],
                                               compat_lib: Path) -> None:
    """A gpuhookd worker SIGKILLed (its --request-timeout alarm) at the step: the hook refuses the container and
    the worker's apply child undoes everything."""
    _, fd = report
    assert killing_daemon.config is not None
    hook = {"path": PYTHON, "args": hook_command(killing_daemon.config, via=Via(killing_daemon.socket)),
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    run_killed(hook_rig, hook, fd, compat_lib)


# --- issue 15: a start killed mid-apply leaves no lease ----------------------------------------------

#: "A few seconds": gpuhookd releases a lease once its holder exits (the issue: within a second).
SELF_RELEASE_S = 5.0


@dataclass(frozen=True, slots=True)
class Leasing:
    """A config with GPU 0 exclusive and a ledger of its own (outside the rig's watched tree)."""

    config: Path
    state_dir: Path

    def leases(self) -> list[dict[str, Any]]:
        """The leases in ``<state_dir>/leases.json`` as stored (reading it reclaims nothing)."""
        path = self.state_dir / "leases.json"
        leases: list[dict[str, Any]] = json.loads(path.read_text())["leases"] if path.exists() else []
        return leases

    def status_holders(self) -> list[str]:
        """Every holder ``gpuhook status --json`` lists (it reclaims the leases of gone holders first)."""
        proc = subprocess.run([PYTHON, "-I", "-m", "gpuhook", "--config", str(self.config), "status", "--json"],
                              capture_output=True, text=True, timeout=30, check=False, cwd="/")
        assert proc.returncode == 0, proc.stderr
        return [h["container_id"] for gpu in json.loads(proc.stdout)["gpus"] for h in gpu["holders"]]


@pytest.fixture
def leasing(hook_rig: Rig, tmp_path_factory: pytest.TempPathFactory) -> Leasing:
    """hook_rig's config with GPU 0 exclusive and its state_dir in a fresh directory."""
    state_dir = tmp_path_factory.mktemp("leases") / "state"
    return Leasing(hook_rig.config(state_dir=state_dir, gpus=[{"device": 0, "sharing": "exclusive"}]), state_dir)


def reserved_since(host: FakeHost, offset: int) -> list[dict[str, Any]]:
    """The ``lease_reserved`` events the hook log got past *offset*."""
    with (host.root / "gpuhook.log").open("rb") as log:
        log.seek(offset)
        return [e for line in log.read().splitlines() if (e := json.loads(line)).get("event") == "lease_reserved"]


def log_offset(host: FakeHost) -> int:
    """Where the hook log's next event will start."""
    log = host.root / "gpuhook.log"
    return log.stat().st_size if log.exists() else 0


@pytest.mark.parametrize("step", STEPS)
def test_hook_killed_mid_apply_leaves_no_lease(hook_rig: Rig, leasing: Leasing, report: tuple[Path, int],
                                              compat_lib: Path, step: tuple[str, bool]) -> None:
    """The in-process hook SIGKILLed at the step, after it reserved GPU 0's lease: it could drop nothing, and
    no gpuhookd watches this ledger; once `gpuhook status` has reclaimed, no GPU has a holder and
    leases.json holds no lease (and GPU 0 is free again)."""
    path, fd = report
    trigger, native = step
    hook = {"path": PYTHON, "args": [PYTHON, "-I", str(KILLAT), str(path), trigger, "hook", "--",
                                     *hook_command(step_config(leasing.config, native))],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    offset = log_offset(hook_rig.host)
    run_killed(hook_rig, hook, fd, compat_lib)
    assert len(reserved_since(hook_rig.host, offset)) == 1, "the killed start never reserved its lease"
    assert leasing.status_holders() == []
    assert leasing.leases() == []


@pytest.fixture
def leasing_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, leasing: Leasing,
                   report: tuple[Path, int]) -> Iterator[Gpuhookd]:
    """killing_daemon, serving the leasing config."""
    trigger, native = request.param
    daemon = daemon_under_killat(tmp_path_factory.mktemp("killd"), report[0], trigger,
                                 step_config(leasing.config, native))
    yield daemon
    journal = daemon.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal


@pytest.mark.parametrize("leasing_daemon", STEPS, indirect=True)
def test_worker_killed_mid_apply_leaves_no_lease(hook_rig: Rig, leasing: Leasing, leasing_daemon: Gpuhookd,
                                                report: tuple[Path, int], compat_lib: Path) -> None:
    """A gpuhookd worker SIGKILLed at the step, after it reserved GPU 0's lease: the daemon (the worker's
    parent, still running) releases the lease by itself within a few seconds of the container's end, nobody
    calling `gpuhook status`; status then lists no holder either."""
    _, fd = report
    assert leasing_daemon.config is not None
    hook = {"path": PYTHON, "args": hook_command(leasing_daemon.config, via=Via(leasing_daemon.socket)),
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    offset = log_offset(hook_rig.host)
    run_killed(hook_rig, hook, fd, compat_lib)
    assert len(reserved_since(hook_rig.host, offset)) == 1, "the killed start never reserved its lease"
    wait_until_released(leasing)
    assert leasing.status_holders() == []


@pytest.mark.parametrize("trigger", [pytest.param("429,429", id="second-bind-mount"),
                                     pytest.param("44^c", id="after-report-before-commit")])
def test_hook_killed_mid_apply_lease_released_by_gpuhookd(hook_rig: Rig, leasing: Leasing,
                                                         report: tuple[Path, int], compat_lib: Path,
                                                         tmp_path_factory: pytest.TempPathFactory,
                                                         trigger: str) -> None:
    """The in-process hook killed at the step while a gpuhookd serves the same config (but not this start):
    the daemon sees the new lease in the ledger and releases it by itself once its holder is gone."""
    path, fd = report
    watcher = Gpuhookd(PYTHON, tmp_path_factory.mktemp("watch") / "run", config=leasing.config)
    try:
        hook = {"path": PYTHON, "args": [PYTHON, "-I", str(KILLAT), str(path), trigger, "hook", "--",
                                         *hook_command(leasing.config)],
                "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
        offset = log_offset(hook_rig.host)
        run_killed(hook_rig, hook, fd, compat_lib)
        assert len(reserved_since(hook_rig.host, offset)) == 1, "the killed start never reserved its lease"
        wait_until_released(leasing)
    finally:
        journal = watcher.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal
    assert leasing.status_holders() == []


def wait_until_released(leasing: Leasing) -> None:
    """Wait (at most SELF_RELEASE_S) for the ledger to hold no lease, nobody calling `gpuhook status`."""
    deadline = time.monotonic() + SELF_RELEASE_S
    while leasing.leases():
        assert time.monotonic() < deadline, f"gpuhookd left the lease after {SELF_RELEASE_S:g} s: {leasing.leases()}"
        time.sleep(0.02)


# --- issue 16: a start killed around the making of its MIG instance leaves no instance -----------------

#: Where the kill lands, in the order a MIG-on-demand start gets there (x86_64 syscalls). The mock NVML
#: takes its change lock (opens mig-state.lock) once to make the GPU instance and once for the compute
#: instance, as the driver serialises changes; the instance is recorded in the lease before either, and
#: its ids after both (the ledger transaction opens leases.lock); the apply child then mknods nvidia0.
#: Each with what the kill leaves: the record's state, and how many 3g.20gb still fit (2: no GI was made).
MIG_STEPS = [
    pytest.param("257=mig-state.lock", "creating", 2, id="recorded-not-made"),
    pytest.param("257=mig-state.lock,257=mig-state.lock", "creating", 1, id="gpu-instance-made-compute-not"),
    pytest.param("257=mig-state.lock,257=mig-state.lock,257=leases.lock", "creating", 1,
                 id="made-not-yet-recorded"),
    pytest.param("259=nvidia0", "ready", 1, id="made-and-recorded-apply-mknod"),
    pytest.param("429", "ready", 1, id="made-and-recorded-apply-bind-mount"),
]


@pytest.fixture
def mig_rig(tmp_path: Path, rootfs_src: Path, default_rules: frozenset[str]) -> Iterator[Rig]:
    """A rig on an A100-40GB of its own, in MIG mode with no instances; hooks in-process."""
    from tests.e2e.test_mig_on_demand import A100_40

    host = create_host(tmp_path / "a100", gpus=1, model=A100_40, mig={0: ()})
    (tmp_path / "rig").mkdir()
    rig = Rig(tmp_path / "rig", host, rootfs_src, default_rules)
    yield rig
    rig.kill_leftovers()


@pytest.mark.parametrize(("trigger", "recorded", "fit"), MIG_STEPS)
def test_hook_killed_around_making_its_instance_leaves_none(mig_rig: Rig, report: tuple[Path, int],
                                                            tmp_path_factory: pytest.TempPathFactory,
                                                            trigger: str, recorded: str, fit: int) -> None:
    """The in-process hook SIGKILLed at the step of a `0,mig=3g.20gb` start (no poststop, no gpuhookd): the
    ledger holds its record as the step left it; once `gpuhook status` has reclaimed, NVML lists no
    instance, the ledger holds no lease and no record, and the GPU's whole room is back (two 3g.20gb fit)."""
    from tests.e2e.test_mig_on_demand import nvml_instances

    path, fd = report
    state_dir = tmp_path_factory.mktemp("migleases") / "state"
    leasing = Leasing(mig_rig.config(state_dir=state_dir), state_dir)
    hook = {"path": PYTHON, "args": [PYTHON, "-I", str(KILLAT), str(path), trigger, "hook", "--",
                                     *hook_command(leasing.config)],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    container = mig_rig.container({"NVIDIA_VISIBLE_DEVICES": "0,mig=3g.20gb"}, GPU_PROBE, hook=hook)
    result = run_container("runc", container.bundle, unique_id("gpuhook-attack"), timeout=30)
    said = read_report(fd)
    assert said.startswith("killed "), f"the kill never happened (the step was not reached): {said!r}\n{result.stderr}"
    assert result.returncode != 0 and "@@start" not in result.stdout, result.stdout
    assert not mig_rig.kill_leftovers(), "processes outlived the undo"
    [lease] = leasing.leases()
    assert [r["state"] for r in lease["migs"]] == [recorded], lease
    assert free_3g(mig_rig.host) == fit
    assert leasing.status_holders() == []
    assert nvml_instances(mig_rig.host) == []
    ledger = json.loads((state_dir / "leases.json").read_text())
    assert ledger["leases"] == [] and ledger["recycle"] == []
    assert free_3g(mig_rig.host) == 2, "the GPU's room did not come back"


def free_3g(host: FakeHost) -> int:
    """How many 3g.20gb GPU instances fit on GPU 0 now, as NVML says."""
    script = ("import ctypes, sys, pynvml; pynvml.nvmlLib = ctypes.CDLL(sys.argv[1]); pynvml.nvmlInit(); "
              "g = pynvml.nvmlDeviceGetHandleByIndex(0); "
              "p = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(g, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE).id; "
              "print(pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(g, p))")
    proc = subprocess.run([PYTHON, "-I", "-c", script, str(host.nvml_library)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


# --- issue 17: a start killed around bringing up its GPU's MPS daemon leaves no daemon ------------------

MPS_STEPS = [
    # the daemon runs and is recorded, but its pid is not: the hook dies reading the pid file
    # (the daemon writes its pid file first: the second open of it is the hook's read)
    pytest.param("257=nvidia-cuda-mps-control.pid,257=nvidia-cuda-mps-control.pid", False,
                 id="daemon-up-pid-not-recorded"),
    pytest.param("259=nvidia0", True, id="daemon-recorded-apply-mknod"),
]


@pytest.mark.parametrize(("trigger", "pid_recorded"), MPS_STEPS)
def test_hook_killed_around_starting_the_mps_daemon_leaves_none(hook_rig: Rig, report: tuple[Path, int],
                                                               tmp_path_factory: pytest.TempPathFactory,
                                                               trigger: str, pid_recorded: bool) -> None:
    """The in-process hook SIGKILLed at the step of a start on GPU 0 under `sharing: mps` (no poststop, no
    gpuhookd): the ledger records the daemon as the step left it; once `gpuhook status` has reclaimed, no
    lease, no daemon record and no daemon process are left."""
    path, fd = report
    state_dir = tmp_path_factory.mktemp("mpsleases") / "state"
    leasing = Leasing(hook_rig.config(state_dir=state_dir, gpus=[{"device": 0, "sharing": "mps", "replicas": 2}]),
                      state_dir)
    hook = {"path": PYTHON, "args": [PYTHON, "-I", str(KILLAT), str(path), trigger, "hook", "--",
                                     *hook_command(leasing.config)],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    container = hook_rig.container(GPU0, GPU_PROBE, hook=hook)
    result = run_container("runc", container.bundle, unique_id("gpuhook-attack"), timeout=30)
    said = read_report(fd)
    assert said.startswith("killed "), f"the kill never happened (the step was not reached): {said!r}\n{result.stderr}"
    assert result.returncode != 0 and "@@start" not in result.stdout, result.stdout
    ledger = json.loads((state_dir / "leases.json").read_text())
    [daemon] = ledger["daemons"]
    assert (daemon["pid"] is not None) == pid_recorded, daemon
    pid_file = Path(daemon["pipe_dir"]) / "nvidia-cuda-mps-control.pid"
    running = int(pid_file.read_text())
    assert Path(f"/proc/{running}").exists(), "the daemon did not come up before the kill"
    assert leasing.status_holders() == []
    assert json.loads((state_dir / "leases.json").read_text())["daemons"] == []
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    while _running(running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(running), "the orphaned MPS daemon is still running"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
