"""Fixtures for real daemon engines: one private dockerd with gpuhook as its GPU hook and runtime."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from integration.daemons import SYSTEM_PATH, Daemon, import_image, start_dockerd
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.relay import relay_for, runtime_for
from integration.rootfs import build_rootfs

REPO = Path(__file__).parents[2]
IMAGE: Final = "gpuhook-busybox:test"
RUNTIME: Final = "gpuhook"
#: The same wrapper under NVIDIA's name, as `gpuhook install --runtime docker --name nvidia` registers it.
NVIDIA_RUNTIME: Final = "nvidia"


@dataclass(frozen=True, slots=True)
class Docker:
    """The test dockerd and the image imported into it."""

    daemon: Daemon
    image: str
    hook_calls: Path
    #: the hook log (the simulated host's config)
    log: Path
    #: the gpuhook.yaml dockerd's hook, runtime and gpuhookd use (the host's, with POLICY)
    config: Path
    #: its lease ledger's dir
    state_dir: Path

    def calls(self) -> list[str]:
        """The argv of every call dockerd made to the hook wrapper so far, one string each."""
        return self.hook_calls.read_text().splitlines() if self.hook_calls.exists() else []


def write_hook_wrapper(bindir: Path, config: Path, calls: Path, hook: Path, *, daemon_socket: str) -> Path:
    """An executable ``nvidia-container-runtime-hook`` in *bindir* that runs *hook* (NVIDIA's name and
    flags: the Python script, or gpuhook-relay's copy under that name) with *config* and *daemon_socket*."""
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = bindir / "nvidia-container-runtime-hook"
    # dockerd calls the hook with only `prestart` and its own environment: pin the config, and
    # drop that environment (gpuhook refuses LD_*/PYTHON* and must not depend on dockerd's).
    # Each call is recorded so that tests can tell whether dockerd involved the hook at all.
    wrapper.write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> {shlex.quote(str(calls))}\n"
        f"exec env -i PATH={SYSTEM_PATH} {shlex.quote(str(hook))} -config {shlex.quote(str(config))} "
        f"--daemon-socket {shlex.quote(daemon_socket)} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


# GPU 0 exclusive, the others unlimited (NVIDIA's behaviour): the tests that ask for one GPU, or `all`,
# run one container at a time and see no difference; the lease tests hold GPU 0.
POLICY: Final = ({"device": "0", "sharing": "exclusive"}, {"device": "all", "sharing": "unlimited"})


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory, host: FakeHost, relay: Path) -> Iterator[Docker]:
    """A private dockerd: the gpuhook wrapper on its PATH (--gpus: gpuhook-relay under NVIDIA's name, served
    by a gpuhookd, as the packages install it), gpuhook-runtime (its C front-end, which runs the Python wrapper
    for a GPU container's create, as the packages install it) as runtime "gpuhook"; the host's config with
    GPU 0 exclusive (POLICY) and a state_dir of its own."""
    with private_docker(tmp_path_factory, host, relay, POLICY) as docker:
        yield docker


@contextlib.contextmanager
def private_docker(tmp_path_factory: pytest.TempPathFactory, host: FakeHost, relay: Path,
                   policy: Sequence[Mapping[str, Any]]) -> Iterator[Docker]:
    """The ``docker`` fixture's dockerd and gpuhookd, for *host* under *policy*."""
    if os.geteuid() != 0:
        pytest.fail("the docker tests start a real dockerd and must run as root (make test does)")
    rootfs = build_rootfs(REPO / ".cache" / "rootfs")
    base = tmp_path_factory.mktemp("docker")
    calls = base / "hook-calls"
    state_dir = base / "state"
    config = host.write_config(base / "gpuhook.yaml", state_dir=state_dir, gpus=policy)
    nvidia_relay = relay_for(relay, "nvidia-container-runtime-hook")
    gpuhookd = Gpuhookd(sys.executable, base / "gpuhookd", config=config)
    try:
        write_hook_wrapper(base / "bin", config, calls, nvidia_relay, daemon_socket=gpuhookd.socket)
        daemon = start_dockerd(base / "dockerd", path_dirs=[base / "bin"],
                               env={"GPUHOOK_CONFIG": str(config)},
                               runtimes={RUNTIME: runtime_for(relay), NVIDIA_RUNTIME: runtime_for(relay)})
        try:
            import_image(daemon, rootfs, IMAGE)
            yield Docker(daemon, IMAGE, calls, host.root / "gpuhook.log", config, state_dir)
        finally:
            daemon.stop()
    finally:
        journal = gpuhookd.stop()
    assert "request failed" not in journal, journal
