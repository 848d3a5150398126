"""load_kmods under real runc: a missing NVIDIA node is made by the host's nvidia-modprobe, or the start is refused.

The simulated host is built without ``/dev/nvidia-uvm`` (and ``-tools``), as a host is after a boot
before anything loaded nvidia-uvm; its ``nvidia-modprobe`` stand-in makes nodes the way the real one
does and logs each call's argv.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from integration.engines import RunResult, default_spec, run_container, unique_id, write_bundle
from integration.fakehost import FakeHost, create_host
from integration.rootfs import copy_rootfs

from .conftest import hook_entry

PROBE = "devopen /dev/nvidia-uvm /dev/nvidia-uvm-tools /dev/nvidia1"
UVM = ("nvidia-uvm", "nvidia-uvm-tools")

Start = Callable[..., RunResult]


@pytest.fixture
def booted(tmp_path: Path) -> FakeHost:
    """A 2-GPU host whose nvidia-uvm module no one has loaded yet: no /dev/nvidia-uvm(-tools)."""
    return create_host(tmp_path / "host", gpus=2, missing_nodes=UVM)


@pytest.fixture
def start(rootfs_src: Path, tmp_path: Path) -> Start:
    """Start a compute container asking for GPU 1 under runc, gpuhook's hook reading *config*."""
    counter = iter(range(1000))

    def run(config: Path, devices: str = "1") -> RunResult:
        bundle = tmp_path / f"bundle{next(counter)}"
        copy_rootfs(rootfs_src, bundle / "rootfs")
        env = ["PATH=/usr/local/bin:/usr/bin:/bin", f"NVIDIA_VISIBLE_DEVICES={devices}",
               "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
        write_bundle(bundle, default_spec("rootfs", ["/bin/sh", "-c", PROBE], env,
                                          hooks={"prestart": [hook_entry(config, "prestart")]}))
        return run_container("runc", bundle, unique_id("kmods"))

    return run


def with_setting(host: FakeHost, line: str, path: Path) -> Path:
    """The host's config with *line* added."""
    path.write_text(host.config_path.read_text() + line + "\n")
    return path


def modprobe_args(host: FakeHost) -> list[tuple[str, ...]]:
    """The arguments of each nvidia-modprobe call so far (argv[0] left out)."""
    return [call[1:] for call in host.modprobe_calls()]


def logged(host: FakeHost, event: str) -> list[dict[str, object]]:
    """The hook log's events named *event*."""
    log = host.root / "gpuhook.log"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [e for e in events if e.get("event") == event]


def test_a_missing_uvm_node_is_made_before_the_start(booted: FakeHost, start: Start) -> None:
    """load_kmods (the default): `nvidia-modprobe -u -c 0` runs once, makes both nodes, the container gets them."""
    assert not (booted.root / "dev/nvidia-uvm").exists()
    result = start(booted.config_path)
    assert result.returncode == 0, result.stderr
    assert {"/dev/nvidia-uvm ENXIO", "/dev/nvidia-uvm-tools ENXIO", "/dev/nvidia1 ENXIO"} <= set(
        result.stdout.splitlines()), result.stdout
    assert modprobe_args(booted) == [("-u", "-c", "0")]
    assert (booted.root / "dev/nvidia-uvm").is_char_device()
    assert [e["command"] for e in logged(booted, "node_created")] == [f"{booted.modprobe_path} -u -c 0"]
    again = start(booted.config_path)
    assert again.returncode == 0, again.stderr
    assert modprobe_args(booted) == [("-u", "-c", "0")]  # the nodes exist now: not run again


def test_a_missing_gpu_node_is_made_too(tmp_path: Path, start: Start) -> None:
    """/dev/nvidia1 missing: `nvidia-modprobe -c 1` makes it."""
    host = create_host(tmp_path / "host1", gpus=2, missing_nodes=("nvidia1",))
    result = start(host.config_path)
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout.splitlines()
    assert modprobe_args(host) == [("-c", "1")]


def test_with_load_kmods_off_the_refusal_names_the_command(booted: FakeHost, start: Start, tmp_path: Path) -> None:
    """load_kmods: false: nothing runs, the start is refused with the command to run by hand."""
    result = start(with_setting(booted, "load_kmods: false", tmp_path / "off.yaml"))
    assert result.returncode != 0
    assert "/dev/nvidia-uvm, which the compute capability needs, is missing" in result.stderr, result.stderr
    assert "create it with `nvidia-modprobe -u -c 0` (load_kmods is off)" in result.stderr
    assert "Traceback" not in result.stderr
    assert modprobe_args(booted) == []
    assert not (booted.root / "dev/nvidia-uvm").exists()


def test_a_failing_modprobe_refuses_the_start_with_its_words(booted: FakeHost, start: Start) -> None:
    """nvidia-modprobe exits 1: refused, naming the exact command and what it said; no lease is left."""
    booted.break_modprobe("FATAL: Module nvidia_uvm not found in directory /lib/modules/6.1.0")
    result = start(booted.config_path)
    assert result.returncode != 0
    assert f"load_kmods: `{booted.modprobe_path} -u -c 0` failed (exit status 1)" in result.stderr, result.stderr
    assert "Module nvidia_uvm not found" in result.stderr
    assert "Traceback" not in result.stderr
    state_dir = next(line.split(":", 1)[1].strip().strip('"') for line in booted.config_path.read_text().splitlines()
                     if line.startswith("state_dir:"))
    ledger = Path(state_dir) / "leases.json"
    assert json.loads(ledger.read_text())["leases"] == []  # reserved before the plan, dropped with the refusal
