"""Fixtures for the attack suite: the rig, runc's default device rules, and small compiled helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration.engines import require_tool
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.rootfs import build_rootfs

from .rig import HERE, Rig, Via, plain_spec_rules

REPO = HERE.parents[1]
PROGS = HERE / "progs"


@pytest.fixture(autouse=True)
def _need_root() -> None:
    """These tests start real runc containers; running them unprivileged is a set-up error, not a skip."""
    if os.geteuid() != 0:
        pytest.fail("the attack suite starts real runc containers and must run as root (make test does)")


@pytest.fixture(scope="session")
def rootfs_src() -> Path:
    """The cached busybox+glibc Debian-style rootfs (with dltest and devopen)."""
    return build_rootfs(REPO / ".cache" / "rootfs")


@pytest.fixture(scope="session")
def default_rules(tmp_path_factory: pytest.TempPathFactory, rootfs_src: Path) -> frozenset[str]:
    """runc's own device-cgroup rules for our spec, measured once from a container without hooks."""
    return plain_spec_rules(tmp_path_factory.mktemp("baseline"), rootfs_src)


#: Every attack runs three times: against the Python hook doing the work itself, against gpuhookd
#: doing it for the Python hook (another process, forked ahead, entering the hook's view), and
#: against gpuhook-relay handing the whole call to gpuhookd (which then also reads config.json,
#: through the hook's root). An older revision under test (GPUHOOK_ATTACK_SOURCE) predates both.
MODES = ["hook"] if os.environ.get("GPUHOOK_ATTACK_SOURCE") else ["hook", "gpuhookd", "relay"]
#: What each mode's log events must say served them.
SERVED_BY = {"hook": "hook", "gpuhookd": "gpuhookd", "relay": "gpuhookd"}


@pytest.fixture(scope="session")
def gpuhookd(tmp_path_factory: pytest.TempPathFactory, host: FakeHost) -> Iterator[Gpuhookd]:
    """One daemon for the suite's gpuhookd pass, serving the simulated host's config; no request may crash
    a worker. (A case with a config of its own gets a daemon of its own: Rig.config.)"""
    daemon = Gpuhookd(sys.executable, tmp_path_factory.mktemp("gpuhookd") / "run", config=host.config_path)
    yield daemon
    journal = daemon.stop()
    assert "request failed" not in journal, journal


@pytest.fixture(params=MODES)
def rig(request: pytest.FixtureRequest, tmp_path: Path, host: FakeHost, rootfs_src: Path,
        default_rules: frozenset[str]) -> Iterator[Rig]:
    """A per-test attack rig on the simulated 4-GPU host; stray processes left in its tree are killed after."""
    mode = request.param
    socket = "none" if mode == "hook" else request.getfixturevalue("gpuhookd").socket
    via = Via(socket, request.getfixturevalue("relay") if mode == "relay" else None)
    rig = Rig(tmp_path, host, rootfs_src, default_rules, via=via)
    log = host.root / "gpuhook.log"
    offset = log.stat().st_size if log.exists() else 0
    yield rig
    rig.kill_leftovers()
    rig.stop_daemons()
    # Whatever the hooks logged came from the pass's own mode: gpuhookd never declined and left the
    # work to the (Python) hook, and the hook pass never reached a daemon. (A gpuhookd of this host
    # releases the lease of every exited container, whichever mode started it: not a served call.)
    lines = log.read_bytes()[offset:].splitlines() if log.exists() else []
    events = [json.loads(line) for line in lines]
    served = {e.get("served_by") for e in events if e.get("why") != "holder exited"} - {None}
    assert served <= {SERVED_BY[mode]}, served


@pytest.fixture
def hook_rig(tmp_path: Path, host: FakeHost, rootfs_src: Path, default_rules: frozenset[str]) -> Iterator[Rig]:
    """A rig whose hooks always work in-process: for attacks on the hook process itself (a seccomp
    filter or a forged parent around it), which a daemon doing the work would not be under."""
    rig = Rig(tmp_path, host, rootfs_src, default_rules)
    yield rig
    rig.kill_leftovers()


@dataclass(frozen=True, slots=True)
class Progs:
    """Helper binaries built once per session from ``tests/attack/progs``."""

    #: a shared object whose constructor writes ``marker`` (the NVIDIAScape payload)
    poc_so: Path
    #: a shared object that does nothing (LD_PRELOAD without side effects)
    noop_so: Path
    #: a real shared library with SONAME libmarker.so.1, named libmarker.so.1.0
    libmarker: Path
    #: a static executable that prints "boom" and exits 1 (a failing ldconfig)
    exit1: Path
    #: a static executable that prints its host name and network interfaces, then exits 1
    nsprobe: Path
    #: where poc.so writes when it runs
    marker: Path


@pytest.fixture(scope="session")
def progs(tmp_path_factory: pytest.TempPathFactory) -> Progs:
    """Compile the C helpers with gcc."""
    gcc = require_tool("gcc")
    out = tmp_path_factory.mktemp("progs")
    out.chmod(0o755)
    marker = out / "owned"

    def cc(*args: str) -> None:
        proc = subprocess.run([gcc, "-O2", "-Wall", "-Werror", *args], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr

    progs = Progs(poc_so=out / "poc.so", noop_so=out / "noop.so", libmarker=out / "libmarker.so.1.0",
                  exit1=out / "exit1", nsprobe=out / "nsprobe", marker=marker)
    cc("-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(progs.poc_so), str(PROGS / "poc.c"))
    cc("-shared", "-fPIC", "-o", str(progs.noop_so), str(PROGS / "noop.c"))
    cc("-shared", "-fPIC", "-Wl,-soname,libmarker.so.1", "-o", str(progs.libmarker), str(PROGS / "noop.c"))
    cc("-static", "-o", str(progs.exit1), str(PROGS / "exit1.c"))
    cc("-static", "-o", str(progs.nsprobe), str(PROGS / "nsprobe.c"))
    return progs
