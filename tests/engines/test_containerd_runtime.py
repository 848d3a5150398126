"""gpuhook-runtime as a real containerd's runc, with its opt plugin where k3s keeps it (issue #31).

containerd's opt plugin puts ``<its path>/lib`` into containerd's own LD_LIBRARY_PATH, which every shim
and so every runtime inherits; k3s's is /var/lib/rancher/k3s/agent/containerd. Here a private containerd's
opt path has that shape under its own directory, and ``ctr run --runc-binary`` makes its shim run the
front-end (libexec/gpuhook-runtime, as the packages install it) as runc.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.containerd import Containerd
from integration.engines import unique_id
from integration.fakehost import FakeHost
from integration.relay import runtime_for
from integration.rootfs import build_rootfs

REPO = Path(__file__).parents[2]
IMAGE = "docker.io/library/gpuhook-busybox:test"
SCRIPT = "devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidia3; dltest libcuda.so.1"


@pytest.fixture(scope="module")
def k3s_containerd(tmp_path_factory: pytest.TempPathFactory, host: FakeHost) -> Iterator[Containerd]:
    """A private containerd whose opt plugin lives at <base>/var/lib/rancher/k3s/agent/containerd, with gpuhook's
    config (and a gpuhookd socket nobody serves) in its environment, as its shims' runtime gets them."""
    if os.geteuid() != 0:
        pytest.fail("the containerd tests start a real containerd and containers and must run as root (make test does)")
    base = tmp_path_factory.mktemp("k3s")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUHOOK_CONFIG": str(host.config_path),
           "GPUHOOK_DAEMON_SOCKET": str(base / "nobody.sock")}
    daemon = Containerd(base / "containerd", opt=base / "var/lib/rancher/k3s/agent/containerd", env=env)
    try:
        daemon.start()
        daemon.import_rootfs(build_rootfs(REPO / ".cache" / "rootfs"), IMAGE)
        yield daemon
    finally:
        daemon.stop()


def run_gpu_container(daemon: Containerd, runtime: Path) -> tuple[int, str, str]:
    """``ctr run --runc-binary RUNTIME --env NVIDIA_VISIBLE_DEVICES=1,3``: status, stdout, stderr."""
    result = daemon.run(IMAGE, unique_id("k3s"), "/bin/sh", "-c", SCRIPT,
                        options=("--runc-binary", str(runtime), "--env", "NVIDIA_VISIBLE_DEVICES=1,3"))
    return result.returncode, result.stdout, result.stderr


def test_a_gpu_container_starts_under_k3s_containerd(k3s_containerd: Containerd, relay: Path) -> None:
    """Through the front-end: GPUs 1 and 3 are injected and allowed, GPU 0 is not there, libcuda loads
    (before: "the hook's environment sets LD_LIBRARY_PATH")."""
    status, out, err = run_gpu_container(k3s_containerd, runtime_for(relay))
    assert status == 0, err
    assert out.splitlines() == ["/dev/nvidia0 ENOENT", "/dev/nvidia1 ENXIO", "/dev/nvidia3 ENXIO",
                                "dlopen libcuda.so.1: OK"]


def test_the_python_wrapper_as_runc_names_the_front_end(k3s_containerd: Containerd, relay: Path) -> None:
    """The Python wrapper itself as runc (BinaryName pointing at it): its interpreter got containerd's library
    path, so it refuses, and ctr shows why and which program to register instead."""
    front_end = runtime_for(relay)
    python_wrapper = relay.with_name("gpuhook-runtime")
    status, out, err = run_gpu_container(k3s_containerd, python_wrapper)
    assert status != 0 and out == ""
    assert "gpuhook: the hook's environment sets LD_LIBRARY_PATH" in err, err
    assert f"register {front_end} as the runtime instead" in err, err
