"""`nvidia-ctk runtime configure --runtime=docker` under a real dockerd (20.10): the runtime it registers is the
one `docker run --runtime nvidia` uses, and doctor tells a registration dockerd has not loaded from one it has."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhook.cli.enginecheck import docker_view
from gpuhook.doctor import EngineView, Verdict, registration_checks
from integration.daemons import SYSTEM_PATH, Daemon, docker_client, docker_run, import_image, start_dockerd
from integration.fakehost import FakeHost
from integration.rootfs import build_rootfs

REPO = Path(__file__).parents[2]
IMAGE = "gpuhook-busybox:test"
NVIDIA_CTK = Path(sys.executable).with_name("nvidia-ctk")
RELOAD_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory, host: FakeHost) -> Iterator[Daemon]:
    """A private dockerd with no runtime of gpuhook's registered yet (its daemon.json is its own)."""
    if os.geteuid() != 0:
        pytest.fail("the docker tests start a real dockerd and must run as root (make test does)")
    if not os.access(NVIDIA_CTK, os.X_OK):
        pytest.fail(f"{NVIDIA_CTK} is missing: install gpuhook into this venv (pip install -e .) so the script exists")
    base = tmp_path_factory.mktemp("nvctk-docker")
    config = host.write_config(base / "gpuhook.yaml", state_dir=base / "state")
    daemon = start_dockerd(base / "dockerd", env={"GPUHOOK_CONFIG": str(config)})
    try:
        import_image(daemon, build_rootfs(REPO / ".cache" / "rootfs"), IMAGE)
        yield daemon
    finally:
        daemon.stop()


def _view(daemon: Daemon) -> EngineView:
    """What doctor's docker check sees of this dockerd (its socket, its daemon.json)."""
    return docker_view("dockerd", client=docker_client(), daemon_json=daemon.workdir / "daemon.json",
                       host=daemon.host)


def test_nvidia_ctk_runtime_configure_docker_then_runtime_nvidia(dockerd: Daemon) -> None:
    """`nvidia-ctk runtime configure --runtime=docker --config=<dockerd's daemon.json>` (the console script, as
    scripts run it) registers `nvidia`; doctor says dockerd has not loaded it until dockerd reloads its config;
    then `docker run --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=9` is refused with gpuhook's message."""
    daemon_json = dockerd.workdir / "daemon.json"
    done = subprocess.run([str(NVIDIA_CTK), "runtime", "configure", "--runtime=docker", f"--config={daemon_json}"],
                          env={"PATH": SYSTEM_PATH}, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"wrote {daemon_json}" in done.stdout and "restart dockerd" in done.stdout
    pending = registration_checks([_view(dockerd)])[0]
    assert pending.verdict is Verdict.WARN and "nvidia" in pending.message, pending
    assert pending.fix == "systemctl restart docker"
    os.kill(dockerd.pid, signal.SIGHUP)  # dockerd reloads its runtimes on SIGHUP, as a restart would
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while not (view := _view(dockerd)).handlers:
        assert time.monotonic() < deadline, f"dockerd did not load the runtime: {view}\n{dockerd.log_text()}"
        time.sleep(0.1)  # polling dockerd's own answer: it signals nothing when the reload is done
    assert registration_checks([view])[0].verdict is Verdict.OK
    assert any(handler.startswith("runtime nvidia ") for handler in view.handlers), view
    result = docker_run(dockerd, ["--rm", "--network", "none", "--runtime", "nvidia",
                                  "-e", "NVIDIA_VISIBLE_DEVICES=9", IMAGE, "/bin/sh", "-c", "echo started"])
    assert result.returncode != 0
    assert "started" not in result.stdout
    assert "no GPU with index 9" in result.stderr, result.stderr
