"""The inventory cache under real runc: a warm cache means no NVML call; a changed driver means a rebuild."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from integration.engines import RunResult, default_spec, run_container, unique_id, write_bundle
from integration.fakehost import FakeHost, create_host
from integration.rootfs import copy_rootfs

from .conftest import hook_entry

GPUS = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
PROBE = "devopen /dev/nvidia0 /dev/nvidia1; dltest libcuda.so.1"

Start = Callable[[], RunResult]


@pytest.fixture
def cache_host(tmp_path: Path) -> FakeHost:
    """A 2-GPU host of this test's own (its config keeps the cache in the host's run/gpuhook)."""
    return create_host(tmp_path / "host", gpus=2)


@pytest.fixture
def start(cache_host: FakeHost, rootfs_src: Path, tmp_path: Path) -> Start:
    """Start one GPU container under runc with gpuhook as its prestart hook, each from a fresh rootfs."""
    counter = iter(range(1000))

    def run() -> RunResult:
        bundle = tmp_path / f"bundle{next(counter)}"
        copy_rootfs(rootfs_src, bundle / "rootfs")
        spec = default_spec("rootfs", ["/bin/sh", "-c", PROBE],
                            ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in GPUS.items())],
                            hooks={"prestart": [hook_entry(cache_host.config_path, "prestart")]})
        write_bundle(bundle, spec)
        return run_container("runc", bundle, unique_id("cache"))

    return run


def cache_outcomes(host: FakeHost) -> list[str]:
    """The ``cache`` field of every host_discovered event in the hook's log, in order."""
    log = host.root / "gpuhook.log"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [e["cache"] for e in events if e["event"] == "host_discovered"]


def test_warm_cache_means_zero_nvml_calls(cache_host: FakeHost, start: Start) -> None:
    """The first GPU start asks NVML and writes the cache; the next makes no NVML call and still gets its GPUs."""
    first = start()
    assert first.returncode == 0, first.stderr
    assert sum(count for _, count in cache_host.nvml_calls()) > 0
    files = list((cache_host.root / "run/gpuhook").glob("inventory-*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o644
    calls_before = cache_host.calls_log_path.read_bytes()
    second = start()
    assert second.returncode == 0, second.stderr
    assert cache_host.calls_log_path.read_bytes() == calls_before  # not one NVML call, from any process
    assert {"/dev/nvidia0 ENXIO", "/dev/nvidia1 ENXIO", "dlopen libcuda.so.1: OK"} <= set(second.stdout.splitlines())
    assert cache_outcomes(cache_host) == ["absent", "hit"]


def _touch_ld_cache(host: FakeHost) -> None:
    """ldconfig rewrote the driver root's ld.so.cache (a driver install)."""
    st = host.ld_cache.stat()
    os.utime(host.ld_cache, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _add_node(host: FakeHost) -> None:
    """A new /dev/nvidiaN appears."""
    os.mknod(host.root / "dev/nvidia5", stat.S_IFCHR | 0o666, os.makedev(host.nvidia_major, 5))


@pytest.mark.parametrize("change", [pytest.param(_touch_ld_cache, id="ld-so-cache-touched"),
                                    pytest.param(_add_node, id="gpu-node-added")])
def test_driver_change_rebuilds_the_cache(cache_host: FakeHost, start: Start,
                                          change: Callable[[FakeHost], None]) -> None:
    """After the driver's identity changes, the next start asks NVML again; the one after is a hit."""
    assert start().returncode == 0
    change(cache_host)
    calls_before = cache_host.calls_log_path.read_bytes()
    rebuilt = start()
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert cache_host.calls_log_path.read_bytes() != calls_before
    calls_before = cache_host.calls_log_path.read_bytes()
    assert start().returncode == 0
    assert cache_host.calls_log_path.read_bytes() == calls_before
    assert cache_outcomes(cache_host) == ["absent", "stale", "hit"]


def test_removed_node_is_not_served_from_a_stale_cache(cache_host: FakeHost, start: Start) -> None:
    """/dev/nvidia1 removed after caching: with load_kmods off the container asking for it is refused (naming
    the command that makes the node), never given a ghost node."""
    assert start().returncode == 0
    (cache_host.root / "dev/nvidia1").unlink()
    with cache_host.config_path.open("a") as config:
        config.write("load_kmods: false\n")
    refused = start()
    assert refused.returncode != 0
    assert "has no device node nvidia1" in refused.stderr and "Traceback" not in refused.stderr
    assert "`nvidia-modprobe -c 1` (load_kmods is off)" in refused.stderr, refused.stderr
    assert cache_outcomes(cache_host) == ["absent", "stale"]
