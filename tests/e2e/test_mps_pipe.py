"""Issue 17, parity: the host's MPS pipe directory reaches compute containers as NVIDIA's hook gives it.

libnvidia-container (lookup_ipcs) mounts ``$CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``, only with
the compute capability, at the same path; the toolkit mounts it nosuid,nodev,noexec and, since 1.18.2,
read-write (MPS clients make their pipes there). Each test makes the directory in a simulated host of its
own (``<driver root>/tmp/nvidia-mps``, as ``/tmp/nvidia-mps`` is on a host whose driver root is /), with a
FIFO standing for the control daemon's ``control`` pipe.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host

from .conftest import MakeContainer, hook_entry

#: What the container sees of /tmp/nvidia-mps: its control FIFO, whether it may make a pipe there, and the
#: options of the mount over it (mountinfo's fields 6: per-mount options).
PROBE = ("test -p /tmp/nvidia-mps/control && echo control-fifo; mkfifo /tmp/nvidia-mps/client && echo can-write; "
         "awk '$5 == \"/tmp/nvidia-mps\" {print \"opts=\" $6}' /proc/self/mountinfo; true")


@pytest.fixture
def mps_host(tmp_path: Path) -> FakeHost:
    return create_host(tmp_path / "host", gpus=1)


def pipe_dir(host: FakeHost, *, mode: int = 0o755) -> Path:
    path = host.root / "tmp" / "nvidia-mps"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    os.mkfifo(path / "control")
    return path


def run(make_container: MakeContainer, host: FakeHost, caps: str) -> str:
    hook = hook_entry(host.config_path, "prestart")
    result = make_container(PROBE, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": caps},
                            hook=hook).run()
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_compute_container_gets_the_pipe_directory_read_write_nosuid_nodev_noexec(
        make_container: MakeContainer, mps_host: FakeHost) -> None:
    """A compute container sees the control FIFO, may make its own pipe there (it lands on the host), and the
    mount is rw with nosuid, nodev and noexec."""
    host_dir = pipe_dir(mps_host)
    out = run(make_container, mps_host, "compute,utility")
    assert "control-fifo" in out and "can-write" in out, out
    [opts] = [line.removeprefix("opts=") for line in out.split() if line.startswith("opts=")]
    assert set(opts.split(",")) >= {"rw", "nosuid", "nodev", "noexec"}, opts
    assert (host_dir / "client").exists()


def test_utility_only_container_does_not_get_it(make_container: MakeContainer, mps_host: FakeHost) -> None:
    pipe_dir(mps_host)
    out = run(make_container, mps_host, "utility")
    assert "control-fifo" not in out and "opts=" not in out, out


@pytest.mark.parametrize("unsafe", ["world-writable", "symlink", "not-root"])
def test_a_pipe_directory_someone_else_could_have_made_is_not_mounted(
        make_container: MakeContainer, mps_host: FakeHost, tmp_path: Path, unsafe: str) -> None:
    """/tmp is everyone's: a world-writable directory, a symlink (to a root-owned directory elsewhere) or a
    directory another user owns is never mounted read-write into a container."""
    if unsafe == "symlink":
        elsewhere = pipe_dir(mps_host).rename(tmp_path / "elsewhere")
        (mps_host.root / "tmp" / "nvidia-mps").symlink_to(elsewhere)
    elif unsafe == "world-writable":
        pipe_dir(mps_host, mode=0o777)
    else:
        os.chown(pipe_dir(mps_host), 65534, 65534)
    out = run(make_container, mps_host, "compute,utility")
    assert "control-fifo" not in out and "opts=" not in out, out
