"""gpuhook under a real dockerd (20.10): `docker run --gpus` and `docker run --runtime gpuhook`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from integration.daemons import docker_run

from .conftest import RUNTIME, Docker


def log_size(log: Path) -> int:
    """Where the hook log's next events will start."""
    return log.stat().st_size if log.exists() else 0


def events_after(log: Path, offset: int) -> list[dict[str, Any]]:
    """The hook log's events past *offset*."""
    return [json.loads(line) for line in log.read_bytes()[offset:].splitlines()]

# --rm: nothing is left in the daemon; --network none: no network set-up to wait for.
RUN = ["--rm", "--network", "none"]
PROBE = "devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidia2; dltest libcuda.so.1 libnvidia-ml.so.1"
COUNT_GPUS = "ls /dev | grep -c '^nvidia[0-9]'"
# dltest exits non-zero when a library does not load; these probes expect that, so the exit
# status of the container still only says whether it ran.
PROBE_MAY_FAIL = PROBE + "; true"


def lines(output: str) -> set[str]:
    """Output lines as a set."""
    return {line.strip() for line in output.splitlines() if line.strip()}


def test_gpus_device_selects_one_gpu(docker: Docker) -> None:
    """--gpus '"device=1"': dockerd calls the hook; only /dev/nvidia1 is there, libcuda loads."""
    before, offset = len(docker.calls()), log_size(docker.log)
    result = docker_run(docker.daemon, [*RUN, "--gpus", '"device=1"', docker.image, "/bin/sh", "-c", PROBE])
    assert result.returncode == 0, result.stderr
    assert {
        "/dev/nvidia1 ENXIO",  # injected: the cgroup allows it, there is no driver
        "/dev/nvidia0 ENOENT", "/dev/nvidia2 ENOENT",  # not selected, not created
        "dlopen libcuda.so.1: OK", "dlopen libnvidia-ml.so.1: OK",
    } <= lines(result.stdout)
    assert docker.calls()[before:] == ["prestart"]  # exactly how dockerd calls it (lab §4)
    # gpuhook-relay under NVIDIA's name handed it to gpuhookd, which did the work
    assert {e["served_by"] for e in events_after(docker.log, offset)} == {"gpuhookd"}


def test_gpus_all_sees_every_gpu(docker: Docker) -> None:
    """--gpus all: NVIDIA_VISIBLE_DEVICES=all, all four GPUs of the host."""
    result = docker_run(docker.daemon, [*RUN, "--gpus", "all", docker.image, "/bin/sh", "-c", COUNT_GPUS])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"


def test_gpus_capabilities_limit_the_libraries(docker: Docker) -> None:
    """--gpus '"capabilities=utility",device=0': GPU 0 and NVML, but no CUDA library."""
    result = docker_run(docker.daemon, [*RUN, "--gpus", '"capabilities=utility",device=0', docker.image,
                                        "/bin/sh", "-c", PROBE_MAY_FAIL])
    assert result.returncode == 0, result.stderr
    out = lines(result.stdout)
    assert {"/dev/nvidia0 ENXIO", "/dev/nvidia1 ENOENT", "dlopen libnvidia-ml.so.1: OK"} <= out
    assert any(line.startswith("dlopen libcuda.so.1: FAIL") for line in out), result.stdout


def test_plain_run_is_untouched(docker: Docker) -> None:
    """No --gpus: no GPU in the container, and dockerd does not even call the hook."""
    before = len(docker.calls())
    result = docker_run(docker.daemon, [*RUN, docker.image, "/bin/sh", "-c", "ls /dev; dltest libcuda.so.1; true"])
    assert result.returncode == 0, result.stderr
    assert "nvidia" not in result.stdout.replace("dlopen libcuda.so.1", "")
    assert any(line.startswith("dlopen libcuda.so.1: FAIL") for line in lines(result.stdout))
    assert docker.calls()[before:] == []


def test_bad_gpu_is_refused_with_gpuhooks_message(docker: Docker) -> None:
    """--gpus '"device=9"' on a 4-GPU host: the container does not start and the error names the value."""
    result = docker_run(docker.daemon, [*RUN, "--gpus", '"device=9"', docker.image, "/bin/sh", "-c", "echo started"])
    assert result.returncode != 0
    assert "started" not in result.stdout
    assert "no GPU with index 9" in result.stderr


def test_runtime_wrapper_injects_the_requested_gpu(docker: Docker) -> None:
    """--runtime gpuhook with -e NVIDIA_VISIBLE_DEVICES=2: the spec is edited, /dev/nvidia2 opens (ENXIO)."""
    before = len(docker.calls())
    result = docker_run(docker.daemon, [*RUN, "--runtime", RUNTIME, "-e", "NVIDIA_VISIBLE_DEVICES=2", docker.image,
                                        "/bin/sh", "-c", PROBE])
    assert result.returncode == 0, result.stderr
    assert {"/dev/nvidia2 ENXIO", "/dev/nvidia0 ENOENT", "/dev/nvidia1 ENOENT", "dlopen libcuda.so.1: OK"} <= lines(
        result.stdout)
    assert docker.calls()[before:] == []  # the runtime adds its own hook; dockerd's --gpus hook is not used


def test_runtime_wrapper_leaves_plain_containers_alone(docker: Docker) -> None:
    """--runtime gpuhook without NVIDIA variables: runc runs the container unchanged."""
    result = docker_run(docker.daemon, [*RUN, "--runtime", RUNTIME, docker.image, "/bin/sh", "-c", COUNT_GPUS])
    assert result.stdout.strip() == "0", result.stderr
