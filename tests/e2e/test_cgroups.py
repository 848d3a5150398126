"""Device access under real runc on cgroup v1 (devices.allow) and cgroup v2 (eBPF program swap)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from integration.fakehost import FakeHost

from .conftest import HOOK_ENV, MakeContainer, hook_entry

PROBE = ("devopen /dev/nvidia1 /dev/nvidia3 /dev/null; mknod /tmp/gpu0 c 195 0; mknod /tmp/mem c 1 1; "
         "devopen /tmp/gpu0 /tmp/mem")
EXPECTED = {"/dev/nvidia1 ENXIO", "/dev/nvidia3 ENXIO", "/dev/null OK", "/tmp/gpu0 EPERM", "/tmp/mem EPERM"}
RECORDER = Path(__file__).with_name("record_device_programs.py")


@pytest.mark.parametrize("engine", ["runc", "runc-cgroup2"], ids=["cgroup-v1", "cgroup-v2"])
def test_exactly_the_selected_gpus_are_allowed(make_container: MakeContainer, engine: str) -> None:
    """GPUs 1 and 3 open (ENXIO), GPU 0 and /dev/mem made by the container do not (EPERM), /dev/null works."""
    result = make_container(PROBE, {"NVIDIA_VISIBLE_DEVICES": "1,3"}, engine=engine).run()
    assert result.returncode == 0, result.stderr
    assert {line.strip() for line in result.stdout.splitlines()} >= EXPECTED


def _programs(make_container: MakeContainer, host: FakeHost, tmp_path: Path, env: dict[str, str], *,
              gpuhook: bool = True) -> list[str]:
    """The device programs on the container's cgroup after the prestart hooks, as a later hook reads them."""
    out = tmp_path / f"programs-{len(list(tmp_path.glob('programs-*')))}.txt"
    recorder = {"path": sys.executable, "args": [sys.executable, "-I", str(RECORDER), str(out)], "env": HOOK_ENV}
    hooks = [hook_entry(host.config_path, "prestart"), recorder] if gpuhook else [recorder]
    result = make_container("true", env, engine="runc-cgroup2", hooks=hooks).run()
    assert result.returncode == 0, result.stderr
    return out.read_text().splitlines()


def test_containers_without_gpus_keep_the_runtimes_program(
    make_container: MakeContainer, host: FakeHost, tmp_path: Path
) -> None:
    """No GPU asked: the attached program is exactly the one runc made; a GPU container's is runc's, extended."""
    baseline = _programs(make_container, host, tmp_path, {}, gpuhook=False)
    assert len(baseline) == 1
    assert _programs(make_container, host, tmp_path, {}) == baseline
    gpu = _programs(make_container, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "1"})
    assert len(gpu) == 1 and gpu != baseline and gpu[0].endswith(baseline[0])  # rules in front, runc's kept
