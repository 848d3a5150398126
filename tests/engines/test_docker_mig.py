"""Issue 16 under docker: ``--gpus '"device=0,mig=3g.20gb#instance1"'`` makes the instance, and its end destroys it.

A private dockerd as in test_docker (gpuhook-relay under NVIDIA's hook name, served by a gpuhookd)
on a simulated A100-40GB in MIG mode with no instances. docker passes the device list through
unchanged as NVIDIA_VISIBLE_DEVICES and runs no poststop for --gpus: the instance is destroyed by
gpuhookd's watch on the container's init, once it exits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.daemons import docker_run
from integration.fakehost import FakeHost, create_host
from integration.fakehost.mig import ci_minor, gi_minor
from tests.e2e.test_mig_on_demand import A100_40, nvml_instances

from .conftest import Docker, private_docker
from .test_docker import RELEASE_DEADLINE_S, gpuhook_status

RUN = ["--rm", "--network", "none"]


@pytest.fixture(scope="module")
def a100(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """An A100-40GB in MIG mode with no instances, readable by the daemons."""
    return create_host(tmp_path_factory.mktemp("a100") / "host", gpus=1, model=A100_40, mig={0: ()})


@pytest.fixture(scope="module")
def mig_docker(tmp_path_factory: pytest.TempPathFactory, a100: FakeHost, relay: Path) -> Iterator[Docker]:
    with private_docker(tmp_path_factory, a100, relay, ()) as docker:
        yield docker


def wait_destroyed(host: FakeHost) -> None:
    """Wait until NVML lists no MIG device (gpuhookd's watch destroys the instance after the exit)."""
    start = time.monotonic()
    while (left := nvml_instances(host)):
        assert time.monotonic() - start < RELEASE_DEADLINE_S, f"still there {RELEASE_DEADLINE_S:g} s on: {left}"
        time.sleep(0.1)


def test_docker_gpus_mig_makes_the_instance_and_destroys_it_after(mig_docker: Docker, a100: FakeHost) -> None:
    """The container sees GPU 0's node and exactly the new instance's two caps nodes; once it has exited (and
    --rm removed it) the instance is gone, and the ledger holds nothing."""
    result = docker_run(mig_docker.daemon, [*RUN, "--gpus", '"device=0,mig=3g.20gb#instance1"', mig_docker.image,
                                            "/bin/sh", "-c", "ls /dev | grep '^nvidia[0-9]'; ls /dev/nvidia-caps"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    caps = sorted(n for n in lines if n.startswith("nvidia-cap"))
    assert "nvidia0" in lines
    # docker --rm waits for the exit; the instance it had was GI 1 (the first 3g placement), CI 0
    assert caps == sorted([f"nvidia-cap{gi_minor(0, 1)}", f"nvidia-cap{ci_minor(0, 1, 0)}"]), result.stdout
    wait_destroyed(a100)
    assert gpuhook_status(mig_docker)["mig_devices"] == []


def test_docker_mig_refusal_is_gpuhooks_one_line(mig_docker: Docker) -> None:
    """An unknown profile: docker's error carries gpuhook's line listing the GPU's profiles."""
    result = docker_run(mig_docker.daemon, [*RUN, "--gpus", '"device=0,mig=5g.30gb"', mig_docker.image,
                                            "/bin/sh", "-c", "echo started"])
    assert result.returncode != 0 and "started" not in result.stdout
    assert "no MIG profile '5g.30gb'" in result.stderr and "3g.20gb (19.5 GiB" in result.stderr, result.stderr
