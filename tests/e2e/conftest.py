"""Fixtures for end-to-end runs: a simulated 4-GPU host, a busybox+glibc rootfs, real engines."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration.engines import (
    CRUN_HOOK_OUTPUT_ANNOTATIONS, RunResult, default_spec, run_container, unique_id, write_bundle,
)
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.rootfs import build_rootfs, copy_rootfs, mount_image
from integration.scratchfs import unmount

REPO = Path(__file__).parents[2]
HOOK_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]


@pytest.fixture(scope="session")
def rootfs_src() -> Path:
    """The cached busybox+glibc rootfs (with dltest and devopen)."""
    return build_rootfs(REPO / ".cache" / "rootfs")


def relay_entry(relay: Path, config: Path, *argv: str) -> dict[str, Any]:
    """gpuhook-relay registered as the packages do: the binary itself, gpuhook's argv, explicit env."""
    return {"path": str(relay), "args": [str(relay), "--config", str(config), *argv], "env": HOOK_ENV}


def hook_entry(config: Path, *argv: str) -> dict[str, Any]:
    """The hook as it should be registered: absolute interpreter in args[0], isolated mode, explicit env."""
    return {"path": sys.executable, "args": [sys.executable, "-I", "-m", "gpuhook", "--config", str(config), *argv],
            "env": HOOK_ENV}


@dataclass(frozen=True, slots=True)
class Container:
    """One prepared bundle and how to run it."""

    bundle: Path
    rootfs: Path
    engine: str

    def run(self) -> RunResult:
        """Start it under its engine, in the foreground."""
        return run_container(self.engine, self.bundle, unique_id("gpuhook"))  # type: ignore[arg-type]


MakeContainer = Callable[..., Container]


@pytest.fixture
def make_container(tmp_path: Path, host: FakeHost, rootfs_src: Path) -> Iterator[MakeContainer]:
    """Prepare a bundle running *script* with *env*, gpuhook as its prestart hook; its rootfs a copy of the
    test rootfs, or *image* on overlayfs (unmounted when the test ends)."""
    counter = iter(range(1000))
    mounted: list[Path] = []

    def make(script: str, env: dict[str, str], *, engine: str = "runc", hook: dict[str, Any] | None = None,
             hooks: list[dict[str, Any]] | None = None, prepare: Callable[[Path], None] | None = None,
             image: Path | None = None) -> Container:
        bundle = tmp_path / f"bundle{next(counter)}"
        bundle.mkdir()
        if image is None:
            rootfs = copy_rootfs(rootfs_src, bundle / "rootfs")
        else:
            rootfs = mount_image(image, bundle)
            mounted.append(rootfs)
        if prepare is not None:
            prepare(rootfs)
        spec = default_spec(
            "rootfs", ["/bin/sh", "-c", script],
            ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in env.items())],
            hooks={"prestart": hooks if hooks is not None else [hook or hook_entry(host.config_path, "prestart")]},
            capabilities=["CAP_MKNOD"],
            annotations=dict(CRUN_HOOK_OUTPUT_ANNOTATIONS) if engine == "crun" else None,
        )
        write_bundle(bundle, spec)
        return Container(bundle=bundle, rootfs=rootfs, engine=engine)

    yield make
    for rootfs in mounted:
        unmount(rootfs)


@pytest.fixture(autouse=True)
def _need_root() -> None:
    """These tests start real containers; running them unprivileged is a set-up error, not a skip."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tests start real runc/crun containers and must run as root (make test does)")


@pytest.fixture
def daemon(tmp_path: Path, host: FakeHost) -> Iterator[Gpuhookd]:
    """A running gpuhookd serving the simulated host's config; its journal must show no failed request."""
    running = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    try:
        yield running
    finally:
        journal = running.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal
