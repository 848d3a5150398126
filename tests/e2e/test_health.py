"""Unhealthy GPUs under real runc: a critical Xid in the kernel log, pending retired pages from NVML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host

from .conftest import MakeContainer, hook_entry


@pytest.fixture(scope="module")
def sick_host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """Three GPUs: 1 fell off the bus (Xid 79 in dev/kmsg), 2 has retired pages pending (NVML)."""
    return create_host(tmp_path_factory.mktemp("sick") / "host", gpus=3,
                       unhealthy={1: ("xid:79",), 2: ("retired-pages",)})


@pytest.mark.parametrize(("gpu", "problem"), [
    pytest.param("1", "critical Xid 79 in the kernel log", id="xid"),
    pytest.param("2", "retired memory pages are pending", id="retired-pages"),
])
def test_unhealthy_gpu_is_refused_by_name(make_container: MakeContainer, sick_host: FakeHost, gpu: str,
                                          problem: str) -> None:
    """The container is refused naming the GPU, its bus id and what is wrong."""
    hook = hook_entry(sick_host.config_path, "prestart")
    result = make_container("echo started", {"NVIDIA_VISIBLE_DEVICES": gpu}, hook=hook).run()
    assert result.returncode != 0 and "started" not in result.stdout
    target = sick_host.gpus[int(gpu)]
    assert f"GPU {gpu} ({target.uuid}, {target.pci_bus_id}) is unhealthy: {problem}" in result.stderr


def test_healthy_gpu_and_warn_policy(make_container: MakeContainer, sick_host: FakeHost, tmp_path: Path) -> None:
    """GPU 0 is fine; with `unhealthy_gpus: warn` GPU 1 is given out and the log says why it is risky."""
    hook = hook_entry(sick_host.config_path, "prestart")
    assert make_container("devopen /dev/nvidia0", {"NVIDIA_VISIBLE_DEVICES": "0"}, hook=hook).run().returncode == 0
    config = tmp_path / "warn.yaml"
    config.write_text(sick_host.config_path.read_text() + "unhealthy_gpus: warn\n")
    result = make_container("devopen /dev/nvidia1", {"NVIDIA_VISIBLE_DEVICES": "1"},
                            hook=hook_entry(config, "prestart")).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout
    events = [json.loads(line) for line in (sick_host.root / "gpuhook.log").read_text().splitlines()]
    assert any(e["event"] == "plan_warning" and "critical Xid 79" in e["message"] for e in events)
