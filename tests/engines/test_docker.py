"""gpuhook under a real dockerd (20.10): `docker run --gpus` and `docker run --runtime gpuhook`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhook.provision import ledger_store
from integration.daemons import SYSTEM_PATH, docker_run
from integration.daemons import docker as docker_cmd
from integration.engines import unique_id

from .conftest import NVIDIA_RUNTIME, RUNTIME, Docker


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


@pytest.mark.parametrize("runtime", [RUNTIME, NVIDIA_RUNTIME])
def test_runtime_wrapper_refusal_shows_gpuhooks_message(docker: Docker, runtime: str) -> None:
    """--runtime gpuhook (or nvidia, the name `install --name nvidia` gives it) with -e NVIDIA_VISIBLE_DEVICES=9:
    containerd's shim reads the runtime's reason from its --log (log.json, runc's contract), so docker's error
    is gpuhook's line, not "unable to retrieve OCI runtime error"."""
    result = docker_run(docker.daemon, [*RUN, "--runtime", runtime, "-e", "NVIDIA_VISIBLE_DEVICES=9", docker.image,
                                        "/bin/sh", "-c", "echo started"])
    assert result.returncode != 0
    assert "started" not in result.stdout
    assert "no GPU with index 9" in result.stderr, result.stderr
    assert "unable to retrieve OCI runtime error" not in result.stderr, result.stderr


def test_runtime_wrapper_leaves_plain_containers_alone(docker: Docker) -> None:
    """--runtime gpuhook without NVIDIA variables: runc runs the container unchanged."""
    result = docker_run(docker.daemon, [*RUN, "--runtime", RUNTIME, docker.image, "/bin/sh", "-c", COUNT_GPUS])
    assert result.stdout.strip() == "0", result.stderr


# --- the sharing policy (issue 15): GPU 0 exclusive (conftest.POLICY), leases in the fixture's state_dir -----

LIST_GPUS = "ls /dev | grep '^nvidia[0-9]'"
#: gpuhookd's watch releases a lease within a second of the holder's exit; a loaded machine gets more.
RELEASE_DEADLINE_S = 30.0


@contextlib.contextmanager
def held(docker: Docker, gpus: str, *, command: str = "sleep 1000") -> Iterator[str]:
    """A detached container started with ``--gpus GPUS`` running *command*; its id. Removed on the way out."""
    name = unique_id("hold")
    try:
        result = docker_run(docker.daemon, ["-d", "--name", name, "--network", "none", "--gpus", gpus, docker.image,
                                            "/bin/sh", "-c", command])
        assert result.returncode == 0, result.stderr
        yield result.stdout.strip()
    finally:
        docker_cmd(docker.daemon, ["rm", "-f", name])


def gpuhook_status(docker: Docker) -> dict[str, Any]:
    """``gpuhook --config CONFIG status --json``, as an admin runs it (it reclaims the leases of gone holders)."""
    proc = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(docker.config), "status", "--json"],
                          env={"PATH": SYSTEM_PATH}, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def holder_ids(docker: Docker, index: int) -> list[str]:
    """The container ids `gpuhook status` names as holders of GPU *index*."""
    gpu = next(g for g in gpuhook_status(docker)["gpus"] if g["index"] == index)
    return [h["container_id"] for h in gpu["holders"]]


def leased(docker: Docker) -> set[str]:
    """The container ids in the ledger file as it is, read without the lock (reading reclaims nothing)."""
    return {lease.container_id for lease in ledger_store.read(docker.state_dir).leases}


def init_pid(docker: Docker, container_id: str) -> int:
    """The host pid of the container's init (the lease's holder)."""
    result = docker_cmd(docker.daemon, ["inspect", "-f", "{{.State.Pid}}", container_id])
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def wait_released(docker: Docker, container_id: str) -> float:
    """Wait until *container_id* has no lease in the ledger file; the seconds it took."""
    start = time.monotonic()
    while container_id in leased(docker):
        assert time.monotonic() - start < RELEASE_DEADLINE_S, (
            f"{container_id}'s lease is still in the ledger {RELEASE_DEADLINE_S:g} s after it exited: "
            f"{ledger_store.read(docker.state_dir)}")
        time.sleep(0.05)
    return time.monotonic() - start


def release_events(log: Path, offset: int, container_id: str) -> list[dict[str, Any]]:
    """The hook log's ``lease_released`` events of *container_id* past *offset*."""
    return [e for e in events_after(log, offset) if e["event"] == "lease_released" and e.get("container_id") ==
            container_id]


def test_count_gets_two_free_gpus(docker: Docker) -> None:
    """--gpus '"device=count=2"' (issue 15's token, through docker's own flag): two GPUs, the lowest free ones."""
    result = docker_run(docker.daemon, [*RUN, "--gpus", '"device=count=2"', docker.image, "/bin/sh", "-c", LIST_GPUS])
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout) == {"nvidia0", "nvidia1"}


def test_count_skips_the_held_exclusive_gpu(docker: Docker) -> None:
    """With GPU 0 exclusive and held, count=2 gets two other GPUs: 1 and 2 (least leased, then lowest index)."""
    with held(docker, '"device=0"') as holder:
        assert holder_ids(docker, 0) == [holder]
        result = docker_run(docker.daemon, [*RUN, "--gpus", '"device=count=2"', docker.image,
                                            "/bin/sh", "-c", LIST_GPUS])
        assert result.returncode == 0, result.stderr
        assert lines(result.stdout) == {"nvidia1", "nvidia2"}


def test_held_exclusive_gpu_is_refused_naming_its_holder(docker: Docker) -> None:
    """GPU 0 exclusive, held by a running container A: --gpus '"device=0"' does not start, and docker's error
    carries gpuhook's line naming GPU 0, its policy and A's id; the refused start leaves no lease."""
    refused = unique_id("refused")
    with held(docker, '"device=0"') as holder:
        try:
            status = gpuhook_status(docker)
            gpu0 = next(g for g in status["gpus"] if g["index"] == 0)
            assert gpu0["sharing"] == "exclusive"
            assert [(h["container_id"], h["pid"]) for h in gpu0["holders"]] == [(holder, init_pid(docker, holder))]
            result = docker_run(docker.daemon, ["--name", refused, *RUN, "--gpus", '"device=0"', docker.image,
                                                "/bin/sh", "-c", "echo started"])
            assert result.returncode != 0
            assert "started" not in result.stdout
            assert "GPU 0" in result.stderr and "exclusive" in result.stderr, result.stderr
            assert f"held by {holder}" in result.stderr, result.stderr
            assert "gpuhook release" in result.stderr, result.stderr  # the way out
            assert leased(docker) == {holder}  # B reserved nothing that stayed
            assert holder_ids(docker, 0) == [holder]
        finally:
            docker_cmd(docker.daemon, ["rm", "-f", refused])


def test_lease_is_released_when_the_container_is_removed(docker: Docker) -> None:
    """docker runs no poststop for --gpus: after `docker rm -f` of the holder, gpuhookd's pidfd watch drops its
    lease from the ledger within seconds (read as it is, without a reclaim), and the next device=0 starts."""
    offset = log_size(docker.log)
    with held(docker, '"device=0"') as holder:
        assert leased(docker) == {holder}
        removed = docker_cmd(docker.daemon, ["rm", "-f", holder])
        assert removed.returncode == 0, removed.stderr
        wait_released(docker, holder)
        assert [e["why"] for e in release_events(docker.log, offset, holder)] == ["holder exited"]  # the watch's
        assert holder_ids(docker, 0) == []
        result = docker_run(docker.daemon, [*RUN, "--gpus", '"device=0"', docker.image, "/bin/sh", "-c", LIST_GPUS])
        assert result.returncode == 0, result.stderr
        assert lines(result.stdout) == {"nvidia0"}


def test_lease_is_released_when_the_container_exits(docker: Docker) -> None:
    """A holder whose init exits on its own (no rm, no poststop): the watch releases its lease, GPU 0 is free
    for the next container while the exited one still exists."""
    offset = log_size(docker.log)
    with held(docker, '"device=0"', command="while [ ! -e /tmp/go ]; do sleep 0.05; done") as holder:
        assert leased(docker) == {holder}
        told = docker_cmd(docker.daemon, ["exec", holder, "touch", "/tmp/go"])
        assert told.returncode == 0, told.stderr
        waited = docker_cmd(docker.daemon, ["wait", holder])
        assert (waited.returncode, waited.stdout.strip()) == (0, "0"), waited.stderr
        wait_released(docker, holder)
        assert [e["why"] for e in release_events(docker.log, offset, holder)] == ["holder exited"]
        assert holder_ids(docker, 0) == []
        with held(docker, '"device=0"') as successor:
            assert holder_ids(docker, 0) == [successor]
