"""Corpus B: races against the hook while it works in the rootfs (security.md §4 B17, B18, B21)."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .rig import GPU0, HERE, LIBS_DIR, PYTHON, Container, Outcome, Rig, hook_entry

RACE_S = 3.0
#: The starts a race needs to say anything.
MIN_STARTS = 3
SYS_FCHMODAT = 268


def race_runs(rig: Rig, container: Container, mode: str, *paths: Path,
              between: Callable[[], None] | None = None) -> list[Outcome]:
    """Start *container* again and again for RACE_S seconds while *paths* are swapped; (o2)-(o4) on every run.

    *between* runs before each start (to re-arm the trap the previous run may have disarmed).
    """
    outcomes = []
    cpus = sorted(os.sched_getaffinity(0))
    # With two CPUs or more, give the racer one of its own and keep runc and the hook on another,
    # so that the racer runs *while* the hook works instead of between its time slices.
    racer_cpus, our_cpus = ({cpus[-1]}, set(cpus[:-1])) if len(cpus) > 1 else (set(cpus), set(cpus))
    proc = subprocess.Popen([PYTHON, "-I", str(HERE / "racer.py"), mode, str(RACE_S + 30), *map(str, paths)],
                            stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(proc.pid, racer_cpus)
    os.sched_setaffinity(0, our_cpus)
    try:
        time.sleep(0.05)  # let it start swapping
        deadline = time.monotonic() + RACE_S
        # at least MIN_STARTS, however slow a loaded machine makes each (the racer races RACE_S + 30 s)
        while time.monotonic() < deadline or (len(outcomes) < MIN_STARTS and time.monotonic() < deadline + 25):
            if between is not None:
                between()
            outcome = rig.run(container, timeout=15)
            assert "Traceback" not in outcome.result.stderr, outcome.result.stderr
            outcomes.append(outcome)
    finally:
        os.sched_setaffinity(0, cpus)
        proc.terminate()  # the racer stops, restores the layout and prints its count
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and int(out) > 1000, f"the racer did not race: {out!r}"
    assert len(outcomes) >= MIN_STARTS, "too few container starts to race against"
    return outcomes


def _started_ok(rig: Rig, outcome: Outcome, libs_dirs: set[str]) -> None:
    """A container that started under the race still has exactly GPU 0's rules and confined mounts."""
    rig.check_cgroup(outcome, rig.expected_rules([0]))
    for rel, mountpoint, _ in rig.gpuhook_mounts(outcome):
        if rel.startswith("usr/lib/x86_64-linux-gnu/"):
            assert any(mountpoint == f"{d}/{rel.rsplit('/', 1)[1]}" for d in libs_dirs), (rel, mountpoint)
        elif rel:
            assert mountpoint == "/" + rel, (rel, mountpoint)


def test_lib_dir_exchanged_with_host_symlink(rig: Rig) -> None:
    """B17: the lib dir swapped with a symlink to a host dir (RENAME_EXCHANGE loop): nothing ever lands on the host."""
    holder: dict[str, Path] = {}

    def prepare(rootfs: Path) -> None:
        holder["swap"] = rootfs / "usr/lib/.swap"
        holder["swap"].symlink_to(rig.victim)

    container = rig.container(GPU0, prepare=prepare)
    outcomes = race_runs(rig, container, "exchange", container.rootfs / LIBS_DIR.lstrip("/"), holder["swap"])
    for outcome in outcomes:
        if outcome.started:
            _started_ok(rig, outcome, {LIBS_DIR, "/usr/lib/.swap", str(rig.victim)})  # .swap: the dir, renamed
    assert sorted(p.name for p in rig.victim.iterdir()) == ["marker"]


def test_race_harness_catches_a_naive_hook(rig: Rig) -> None:
    """Control for B17: a naive hook that creates files by path string under the same race does hit the host dir."""
    naive = 'for i in 0 1 2 3 4 5 6 7 8 9; do for j in 0 1 2 3 4 5 6 7 8 9; do ' \
            ': > "$R/usr/lib/x86_64-linux-gnu/naive-$i$j" 2>/dev/null || true; done; done'
    holder: dict[str, Path] = {}

    def prepare(rootfs: Path) -> None:
        holder["swap"] = rootfs / "usr/lib/.swap"
        holder["swap"].symlink_to(rig.victim)

    container = rig.container({}, prepare=prepare, pre_hook=naive)  # no GPU asked: gpuhook does nothing
    with pytest.raises(AssertionError, match=r"host files changed:\nnew: host/victim/naive-"):
        race_runs(rig, container, "exchange", container.rootfs / LIBS_DIR.lstrip("/"), holder["swap"])


def test_dev_node_swapped_with_symlink_to_host_file(rig: Rig) -> None:
    """B18: ``/dev/nvidia0`` swapped between a 0600 ``c 195:0`` node and a symlink to a 0600 host file: no chmod."""
    def prepare(rootfs: Path) -> None:
        (rootfs / "dev/nvidia0").symlink_to(rig.secret)
        os.mknod(rootfs / "dev/.alt", 0o020600, os.makedev(195, 0))
        os.chmod(rootfs / "dev/.alt", 0o600)

    def rearm() -> None:
        # gpuhook chmods the node to 0666 when it finds it; set it back to 0600 so that every run has
        # to chmod it, which is the window in which the symlink may be swapped in. By O_PATH fd: the
        # racer is running, and a path chmod here could itself follow the symlink.
        for name in ("nvidia0", ".alt"):
            fd = os.open(dev / name, os.O_PATH | os.O_NOFOLLOW)
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.chmod(f"/proc/self/fd/{fd}", 0o600)
            finally:
                os.close(fd)

    container = rig.container(GPU0, dev_tmpfs=False, prepare=prepare)
    dev = container.rootfs / "dev"
    outcomes = race_runs(rig, container, "exchange", dev / "nvidia0", dev / ".alt", between=rearm)
    for outcome in outcomes:
        if outcome.started:
            _started_ok(rig, outcome, {LIBS_DIR})
        else:
            outcome.assert_refused()
    assert rig.secret.read_text() == "host secret\n" and (rig.secret.stat().st_mode & 0o777) == 0o600


def test_dev_node_swapped_exactly_between_check_and_chmod(hook_rig: Rig) -> None:
    """B18, pinpointed: ``/dev/nvidia0`` becomes a symlink to a host file right as gpuhook chmods it: no host chmod.

    In-process only: the seccomp notifier watches the hook process, where gpuhookd's worker is not."""
    rig = hook_rig
    # pinpoint.py stops gpuhook at its fchmodat(…"nvidia0"…) (seccomp user notification), swaps the
    # 0600 node it has just checked with a symlink to the host file, and lets the call go on: the
    # timing a racer needs luck for, every run.
    def prepare(rootfs: Path) -> None:
        os.mknod(rootfs / "dev/nvidia0", 0o020600, os.makedev(195, 0))
        os.chmod(rootfs / "dev/nvidia0", 0o600)
        (rootfs / "dev/.alt").symlink_to(rig.secret)

    dev = rig.tmp / "bundle0/rootfs/dev"
    wrapper = [str(HERE / "pinpoint.py"), str(SYS_FCHMODAT), "nvidia0", str(dev / "nvidia0"), str(dev / ".alt")]
    container = rig.container(GPU0, dev_tmpfs=False, prepare=prepare, hook=hook_entry(rig.base_config, wrapper=wrapper))
    assert container.rootfs / "dev" == dev
    outcome = rig.run(container)
    if not outcome.started:
        outcome.assert_refused("/dev/nvidia0")
    assert rig.secret.read_text() == "host secret\n" and (rig.secret.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("fifo", ["etc/debian_version", "etc/ld.so.conf", f"{LIBS_DIR.lstrip('/')}/libcuda.so.1"],
                         ids=["B21-debian_version", "B21-ld.so.conf", "B21-libcuda.so.1"])
def test_fifo_on_a_read_path_does_not_hang(rig: Rig, fifo: str) -> None:
    """B21: a FIFO where the hook or its ldconfig reads: the run ends within the 5 s timeout, leaving no process."""
    def prepare(rootfs: Path) -> None:
        (rootfs / fifo).unlink(missing_ok=True)
        os.mkfifo(rootfs / fifo)

    container = rig.container(GPU0, prepare=prepare, config=rig.config(timeout_seconds=5))
    outcome = rig.run(container, timeout=15)
    assert outcome.result.duration_s < 10, outcome.result.duration_s
    if outcome.started:
        rig.check_cgroup(outcome, rig.expected_rules([0]))
    else:
        outcome.assert_refused()
