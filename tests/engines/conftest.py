"""Fixtures for real daemon engines: one private dockerd with gpuhook as its GPU hook and runtime."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from integration.daemons import SYSTEM_PATH, Daemon, import_image, start_dockerd
from integration.fakehost import FakeHost
from integration.rootfs import build_rootfs

REPO = Path(__file__).parents[2]
IMAGE: Final = "gpuhook-busybox:test"
RUNTIME: Final = "gpuhook"
# The console scripts of the interpreter running the tests (the venv gpuhook is installed in).
HOOK_SCRIPT: Final = Path(sys.executable).with_name("nvidia-container-runtime-hook")
RUNTIME_SCRIPT: Final = Path(sys.executable).with_name("gpuhook-runtime")


@dataclass(frozen=True, slots=True)
class Docker:
    """The test dockerd and the image imported into it."""

    daemon: Daemon
    image: str
    hook_calls: Path

    def calls(self) -> list[str]:
        """The argv of every call dockerd made to the hook wrapper so far, one string each."""
        return self.hook_calls.read_text().splitlines() if self.hook_calls.exists() else []


def write_hook_wrapper(bindir: Path, config: Path, calls: Path) -> Path:
    """An executable ``nvidia-container-runtime-hook`` in *bindir* that runs gpuhook with *config*."""
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = bindir / "nvidia-container-runtime-hook"
    # dockerd calls the hook with only `prestart` and its own environment: pin the config, and
    # drop that environment (gpuhook refuses LD_*/PYTHON* and must not depend on dockerd's).
    # Each call is recorded so that tests can tell whether dockerd involved the hook at all.
    wrapper.write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> {shlex.quote(str(calls))}\n"
        f"exec env -i PATH={SYSTEM_PATH} {shlex.quote(str(HOOK_SCRIPT))} -config {shlex.quote(str(config))} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory, host: FakeHost) -> Iterator[Docker]:
    """A private dockerd: the gpuhook wrapper on its PATH (--gpus), gpuhook-runtime as runtime "gpuhook"."""
    if os.geteuid() != 0:
        pytest.fail("the docker tests start a real dockerd and must run as root (make test does)")
    for script in (HOOK_SCRIPT, RUNTIME_SCRIPT):
        if not os.access(script, os.X_OK):
            pytest.fail(f"{script} is missing: install gpuhook into this interpreter's venv (pip install -e .)")
    rootfs = build_rootfs(REPO / ".cache" / "rootfs")
    base = tmp_path_factory.mktemp("docker")
    bindir = base / "bin"
    calls = base / "hook-calls"
    write_hook_wrapper(bindir, host.config_path, calls)
    daemon = start_dockerd(base / "dockerd", path_dirs=[bindir], env={"GPUHOOK_CONFIG": str(host.config_path)},
                           runtimes={RUNTIME: RUNTIME_SCRIPT})
    try:
        import_image(daemon, rootfs, IMAGE)
        yield Docker(daemon, IMAGE, calls)
    finally:
        daemon.stop()
