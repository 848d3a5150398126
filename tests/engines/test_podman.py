"""gpuhook under real podman 4.3: the shipped hooks.d files, and the CDI spec ``gpuhook cdi generate`` writes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from integration.engines import unique_id
from integration.fakehost import FakeHost
from integration.rootfs import build_rootfs, copy_rootfs

REPO = Path(__file__).parents[2]
SHIPPED_HOOK = REPO / "packaging" / "oci-hooks.d" / "gpuhook.json"
SHIPPED_POSTSTOP = REPO / "packaging" / "oci-hooks.d" / "gpuhook-poststop.json"
# podman 4.3.1 reads CDI specs only from /etc/cdi and /var/run/cdi: its containers.conf has no
# cdi_spec_dirs yet (that came with podman 4.5) and `run` no flag for it.
CDI_DIR: Final = Path("/var/run/cdi")
# Two specs in one CDI dir that define the same nvidia.com/gpu devices conflict and podman drops
# those devices, so concurrent test runs on this machine take turns on the dir.
CDI_LOCK: Final = Path("/run/lock/gpuhook-test-cdi.lock")
LIBS: Final = "/usr/lib/x86_64-linux-gnu"
# lab §3: crun fails on this hybrid cgroup host; podman's default rlimits exceed what runc may set
# without CAP_SYS_RESOURCE; --network none keeps netavark/iptables out.
RUN: Final = ["run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
              "--network", "none"]
PROBE: Final = "devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl; dltest libcuda.so.1"


@dataclass(frozen=True, slots=True)
class Podman:
    """A podman with private storage, state and tmp under one test directory."""

    base: Path
    rootfs_src: Path

    def __call__(self, *args: str, hooks_dir: Path) -> subprocess.CompletedProcess[str]:
        """Run podman with this store and *hooks_dir* as its only hooks directory."""
        argv = ["podman", "--root", str(self.base / "root"), "--runroot", str(self.base / "runroot"),
                "--tmpdir", str(self.base / "tmp"), "--storage-driver", "vfs", "--events-backend", "none",
                "--cgroup-manager", "cgroupfs", "--hooks-dir", str(hooks_dir), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)

    def rootfs(self) -> Path:
        """A fresh copy of the busybox+glibc rootfs: with --rootfs, mount targets persist in it."""
        return copy_rootfs(self.rootfs_src, self.base / unique_id("rootfs"))


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """Private podman storage; at teardown, no container is left and nothing of it stays mounted."""
    if os.geteuid() != 0:
        pytest.fail("the podman tests start real containers and must run as root (make test does)")
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: apt-get install podman (make deps does)")
    store = Podman(tmp_path_factory.mktemp("podman"), build_rootfs(REPO / ".cache" / "rootfs"))
    try:
        yield store
    finally:
        store("rm", "--all", "--force", hooks_dir=store.base)
        _unmount_under(store.base)
        shutil.rmtree(store.base, ignore_errors=True)


def _unmount_under(base: Path) -> None:
    """Lazily unmount anything left mounted below *base*, deepest first (a failed --rm could leave shm)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        points = [line.split()[4] for line in info]
    for point in sorted((p for p in points if p.startswith(f"{base}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


@pytest.fixture
def hooks_dir(tmp_path: Path) -> Path:
    """An empty hooks directory: podman runs no hook but the ones a test puts there."""
    path = tmp_path / "hooks.d"
    path.mkdir()
    return path


def lines(output: str) -> set[str]:
    """Output lines as a set."""
    return {line.strip() for line in output.splitlines() if line.strip()}


def test_shipped_hooks_d_file(podman: Podman, hooks_dir: Path, host: FakeHost) -> None:
    """The packaging hooks.d entry (path/args pointed at this venv): NVIDIA_VISIBLE_DEVICES=1 gets GPU 1 only."""
    shipped = json.loads(SHIPPED_HOOK.read_text())
    argv = [sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "prestart"]
    entry = {**shipped, "hook": {**shipped["hook"], "path": sys.executable, "args": argv}}
    assert (entry["when"], entry["stages"]) == ({"always": True}, ["prestart"])
    (hooks_dir / "gpuhook.json").write_text(json.dumps(entry))
    result = podman(*RUN, "-e", "NVIDIA_VISIBLE_DEVICES=1", "--rootfs", str(podman.rootfs()),
                    "/bin/sh", "-c", PROBE, hooks_dir=hooks_dir)
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout) == {"/dev/nvidia1 ENXIO", "/dev/nvidia0 ENOENT", "/dev/nvidiactl ENXIO",
                                    "dlopen libcuda.so.1: OK"}


def test_shipped_hooks_d_file_leaves_other_containers_alone(podman: Podman, hooks_dir: Path, host: FakeHost) -> None:
    """`always` runs the hook for every container; one that asks for no GPU gets nothing."""
    shipped = json.loads(SHIPPED_HOOK.read_text())
    argv = [sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "prestart"]
    (hooks_dir / "gpuhook.json").write_text(json.dumps({**shipped, "hook": {**shipped["hook"], "path": sys.executable,
                                                                             "args": argv}}))
    result = podman(*RUN, "--rootfs", str(podman.rootfs()), "/bin/sh", "-c", "ls /dev | grep -c nvidia; true",
                    hooks_dir=hooks_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


def test_shipped_poststop_file_runs_at_deletion(podman: Podman, hooks_dir: Path, host: FakeHost,
                                               tmp_path: Path) -> None:
    """Both shipped files in one hooks.d: the GPU container gets its GPU from gpuhook.json's prestart,
    and at its deletion podman runs gpuhook-poststop.json's hook once, with stage ``poststop`` and the
    stopped container's state; gpuhook's poststop exits 0.

    The poststop entry's path is a spy that records what it was given, then runs gpuhook with the
    same stage and state.
    """
    shipped = json.loads(SHIPPED_HOOK.read_text())
    argv = [sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "prestart"]
    (hooks_dir / "gpuhook.json").write_text(json.dumps({**shipped, "hook": {**shipped["hook"], "path": sys.executable,
                                                                             "args": argv}}))
    poststop = json.loads(SHIPPED_POSTSTOP.read_text())
    assert (poststop["when"], poststop["stages"], poststop["hook"]["args"][-1]) == (
        {"always": True}, ["poststop"], "poststop")
    assert {k: v for k, v in poststop["hook"].items() if k != "args"} == \
        {k: v for k, v in shipped["hook"].items() if k != "args"}
    record = tmp_path / "poststop"
    spy = tmp_path / "poststop-spy"
    spy.write_text(f"#!/bin/sh\ncat > {record}.state\necho \"$*\" >> {record}.args\n"
                   f"{sys.executable} -I -m gpuhook --config {host.config_path} \"$@\" < {record}.state\n"
                   f"echo $? >> {record}.rc\n")
    spy.chmod(0o755)
    hook = {**poststop["hook"], "path": str(spy), "args": [str(spy), *poststop["hook"]["args"][1:]]}
    (hooks_dir / "gpuhook-poststop.json").write_text(json.dumps({**poststop, "hook": hook}))
    result = podman(*RUN, "-e", "NVIDIA_VISIBLE_DEVICES=1", "--rootfs", str(podman.rootfs()),
                    "/bin/sh", "-c", PROBE, hooks_dir=hooks_dir)
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in lines(result.stdout)
    assert Path(f"{record}.args").read_text() == "poststop\n"
    assert Path(f"{record}.rc").read_text() == "0\n"
    state = json.loads(Path(f"{record}.state").read_text())
    assert state["status"] == "stopped" and state["id"], state


@pytest.fixture(scope="module")
def cdi_spec(host: FakeHost) -> Iterator[Path]:
    """``gpuhook cdi generate`` into podman's dynamic CDI dir, under a unique name; removed at teardown."""
    CDI_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(CDI_LOCK, "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        created = not CDI_DIR.exists()
        CDI_DIR.mkdir(parents=True, exist_ok=True)
        spec = CDI_DIR / f"{unique_id('gpuhook-test')}.yaml"
        try:
            generate = subprocess.run(
                [sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "cdi", "generate",
                 "--output", str(spec)], capture_output=True, text=True, timeout=60, check=False)
            assert generate.returncode == 0, generate.stderr
            yield spec
        finally:
            spec.unlink(missing_ok=True)
            if created:
                # OSError: something else put a spec there meanwhile, and it is not ours to remove
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()


def test_cdi_device_gets_the_same_view(podman: Podman, hooks_dir: Path, cdi_spec: Path) -> None:
    """--device nvidia.com/gpu=1 with no hooks.d hook: GPU 1's node, the control node, the libraries read-only.

    libcuda.so.1 loads only because the spec's createContainer hook rebuilt the ld.so.cache (and
    made the SONAME link): the mounts alone carry only libcuda.so.<version>.
    """
    script = (f"{PROBE}; echo env=$NVIDIA_VISIBLE_DEVICES; "
              f"grep ' {LIBS}/libcuda.so' /proc/self/mountinfo | cut -d' ' -f5,6")
    result = podman(*RUN, "--device", "nvidia.com/gpu=1", "--rootfs", str(podman.rootfs()),
                    "/bin/sh", "-c", script, hooks_dir=hooks_dir)
    assert result.returncode == 0, result.stderr
    out = lines(result.stdout)
    assert {"/dev/nvidia1 ENXIO", "/dev/nvidia0 ENOENT", "/dev/nvidiactl ENXIO", "dlopen libcuda.so.1: OK",
            "env=void"} <= out  # void: a legacy hook that also runs leaves the container alone
    mounts = [line for line in out if line.startswith(f"{LIBS}/libcuda.so.")]
    assert len(mounts) == 1 and mounts[0].split()[1].split(",")[0] == "ro", out


def test_cdi_all_and_unknown_device(podman: Podman, hooks_dir: Path, cdi_spec: Path) -> None:
    """nvidia.com/gpu=all gives the host's four GPUs; an unknown device name refuses the container."""
    every = podman(*RUN, "--device", "nvidia.com/gpu=all", "--rootfs", str(podman.rootfs()),
                   "/bin/sh", "-c", "ls /dev | grep -c '^nvidia[0-9]'", hooks_dir=hooks_dir)
    assert every.returncode == 0, every.stderr
    assert every.stdout.strip() == "4"
    unknown = podman(*RUN, "--device", "nvidia.com/gpu=9", "--rootfs", str(podman.rootfs()),
                     "/bin/true", hooks_dir=hooks_dir)
    assert unknown.returncode != 0
    assert "nvidia.com/gpu=9" in unknown.stderr
