"""gpuhook-relay: real runc/crun containers whose hook is the static relay, served by gpuhookd.

The relay's own protocol handling is tested against a scripted server in tests/unit/test_relay.py;
here it runs as the packages register it, against a real daemon and real engines (and in
tests/e2e/test_daemon.py's runc/crun/cgroup v2 runs beside the Python hook).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


from gpuhook import __version__
from gpuhook.daemon import client, wire
from integration.engines import default_spec, write_bundle
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.relay import relay_for

from .conftest import HOOK_ENV, MakeContainer, relay_entry
from .test_daemon import events_after, log_size
from .test_hook import PROBE, TWO_GPUS, lines

NO_GPU = {"CUDA_HOME": "/nowhere"}


def test_relay_under_nvidias_name(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd,
                                  relay: Path) -> None:
    """The package's libexec/nvidia-container-runtime-hook (the relay, found on dockerd's PATH for
    ``--gpus``) takes NVIDIA's flags: gpuhookd decodes them and serves the GPUs."""
    nvidia = relay_for(relay, "nvidia-container-runtime-hook")
    offset = log_size(host)
    hook = {"path": str(nvidia), "args": ["nvidia-container-runtime-hook", "-config", str(host.config_path),
                                          "--daemon-socket", daemon.socket, "prestart"], "env": HOOK_ENV}
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "nvidia-smi OK" in lines(result.stdout)
    assert {e["served_by"] for e in events_after(host.root / "gpuhook.log", offset)} == {"gpuhookd"}
    version = run_relay(nvidia, "-version")  # not a hook call: the Python hook under NVIDIA's name answers
    assert (version.returncode, version.stdout.strip()) == (
        0, f"gpuhook {__version__} (nvidia-container-runtime-hook compatible)"), version.stderr


def test_no_gpu_containers_cost_the_daemon_no_fork(make_container: MakeContainer, host: FakeHost,
                                                   daemon: Gpuhookd, relay: Path) -> None:
    """A container that asks for no GPU is answered by the relay, whose `no-gpu` notice a waiting worker logs
    and keeps waiting: the daemon's processes are the same before and after three such starts, and each is
    logged once (the metrics count them), and nothing else."""
    hook = relay_entry(relay, host.config_path, "--daemon-socket", daemon.socket, "prestart")
    containers = [make_container("echo ran", NO_GPU, hook=hook) for _ in range(3)]
    # At rest first: a fresh daemon's spares may still be forking their children on a busy machine.
    daemon.settled()
    before, offset = sorted(daemon.processes()), log_size(host)
    for container in containers:
        result = container.run()
        assert (result.returncode, result.stdout.strip()) == (0, "ran"), result.stderr
    assert sorted(daemon.processes()) == before
    deadline = time.monotonic() + 60  # each is written just after its answer went out
    while len(logged := events_after(host.root / "gpuhook.log", offset)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(e["event"], e["served_by"]) for e in logged] == [("no_gpu_requested", "gpuhookd")] * 3, logged
    assert len({e["container_id"] for e in logged}) == 3


def test_without_a_daemon_the_relay_runs_the_python_hook(make_container: MakeContainer, host: FakeHost,
                                                         relay: Path, tmp_path: Path) -> None:
    """No socket: the relay execs the ``gpuhook`` beside it with the same argv and the state it read."""
    absent = str(tmp_path / "absent" / "gpuhookd.sock")
    hook = relay_entry(relay, host.config_path, "--daemon-socket", absent, "prestart")
    offset = log_size(host)
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "nvidia-smi OK" in lines(result.stdout)
    events = events_after(host.root / "gpuhook.log", offset)
    assert {e["served_by"] for e in events} == {"hook"}
    assert next(e for e in events if e["event"] == "request_parsed")["daemon"] == (
        f"no gpuhookd at {absent} (No such file or directory)")
    no_gpu = make_container("echo ran", NO_GPU, hook=hook).run()
    assert (no_gpu.returncode, no_gpu.stdout.strip()) == (0, "ran"), no_gpu.stderr


def test_the_fallback_keeps_what_the_hook_needs(make_container: MakeContainer, host: FakeHost, relay: Path,
                                                tmp_path: Path) -> None:
    """No daemon, the config named only by $GPUHOOK_CONFIG and a file-less LANG: they reach the Python
    hook through the relay's allow-list, and the GPU container starts as configured."""
    absent = str(tmp_path / "absent" / "gpuhookd.sock")
    hook = {"path": str(relay), "args": [str(relay), "--daemon-socket", absent, "prestart"],
            "env": [*HOOK_ENV, f"GPUHOOK_CONFIG={host.config_path}", "LANG=C.UTF-8", "HOME=/root"]}
    offset = log_size(host)
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "nvidia-smi OK" in lines(result.stdout)
    assert {e["served_by"] for e in events_after(host.root / "gpuhook.log", offset)} == {"hook"}


def test_a_relay_copied_under_its_commands_name_refuses_once(make_container: MakeContainer, host: FakeHost,
                                                             relay: Path, tmp_path: Path) -> None:
    """A copy installed as bin/gpuhook stands for itself: with no gpuhookd, runc gets one clear
    refusal naming the fix (it used to exec itself until runc was killed), and the container never runs."""
    copy = tmp_path / "prefix" / "bin" / "gpuhook"
    copy.parent.mkdir(parents=True)
    shutil.copy2(relay, copy)
    absent = str(tmp_path / "absent" / "gpuhookd.sock")
    result = make_container("echo ran", TWO_GPUS,
                            hook=relay_entry(copy, host.config_path, "--daemon-socket", absent, "prestart")).run()
    assert (result.returncode != 0, result.timed_out, "ran" in result.stdout) == (True, False, False), result.stderr
    assert (f"gpuhook: gpuhook-relay {copy} would fall back to {copy} for calls gpuhookd does not serve, which is "
            f"this relay itself; put the Python hook `gpuhook` there, or make {copy} a symlink to the installed "
            "relay instead of a copy") in result.stderr


def run_relay(relay: Path, *argv: str, state: str = "", cwd: str = "/",
              wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The relay run by hand with *state* on stdin and the hook's usual environment."""
    return subprocess.run([*wrap, str(relay), *argv], input=state, capture_output=True, text=True, timeout=30,
                          cwd=cwd, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, check=False)


def test_other_commands_go_to_gpuhook(daemon: Gpuhookd, relay: Path) -> None:
    """The daemon declines anything but a hook call; the relay's fallback (gpuhook's own CLI) answers."""
    version = run_relay(relay, "--daemon-socket", daemon.socket, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"gpuhook {__version__}"), version.stderr
    usage = run_relay(relay, "--daemon-socket", daemon.socket, "no-such-stage")
    assert usage.returncode == 2 and "invalid choice: 'no-such-stage'" in usage.stderr
    assert run_relay(relay, "--daemon-socket", daemon.socket, "poststop", state="{}").returncode == 0


def test_config_json_is_read_in_the_hooks_view(host: FakeHost, daemon: Gpuhookd, relay: Path, tmp_path: Path) -> None:
    """A hook in a private mount namespace (crun, a runtime in a pod) names a bundle that exists only
    there: the daemon reads that config.json, not the file at the same path in its own view."""
    shared = tmp_path / "view"
    (shared / "bundle").mkdir(parents=True)
    # the daemon's view: not JSON, and with a GPU marker in it, so that it is decoded (and refused)
    (shared / "bundle" / "config.json").write_text("not the hook's config.json: NVIDIA_VISIBLE_DEVICES")
    private = tmp_path / "private-config.json"
    # A GPU marker, asking for none: the relay leaves it to the daemon, which must read this file, not its own.
    spec: dict[str, Any] = default_spec("rootfs", ["true"], ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void"])
    write_bundle(tmp_path / "private", spec)
    private.write_bytes((tmp_path / "private" / "config.json").read_bytes())
    state = json.dumps({"ociVersion": "1.0.2", "id": "view", "status": "creating", "pid": 1,
                        "bundle": str(shared / "bundle")})
    argv = ("--config", str(host.config_path), "--daemon-socket", daemon.socket, "prestart")
    seen_from_outside = run_relay(relay, *argv, state=state)
    assert seen_from_outside.returncode == 1 and "config.json" in seen_from_outside.stderr
    script = (f"mount -t tmpfs view {shared} && mkdir {shared}/bundle && cp {private} {shared}/bundle/config.json "
              f'&& exec "$@"')
    inside = run_relay(relay, *argv, state=state, wrap=("unshare", "--mount", "--propagation", "private", "--",
                                                        "sh", "-c", script, "sh"))
    assert inside.returncode == 0, inside.stderr


def relay_request(socket: str, argv: list[str], env: dict[str, str], state: bytes = b"{}",
                  version: str = __version__) -> tuple[bytes, int, str]:
    """A ``relay`` request as gpuhook-relay sends it (from this process, with its namespaces and root)."""
    parts = [version.encode(), "\0".join(argv).encode(), "\0".join(f"{k}={v}" for k, v in env.items()).encode(),
             state]
    return client.exchange(socket, wire.encode_request(b"relay", parts))


def test_the_daemon_checks_a_relay_call_as_the_hook_would(daemon: Gpuhookd) -> None:
    """The daemon does not rely on the relay's own checks: loader variables refuse the call, another
    version or anything but a hook call is declined (the relay then runs the Python hook)."""
    hook = ["gpuhook", "prestart"]
    verdict, status, message = relay_request(daemon.socket, hook, {"PATH": "/bin", "LD_PRELOAD": "/x.so"})
    assert (verdict, status) == (b"done", 1) and "sets LD_PRELOAD" in message and "CVE-2025-23266" in message
    assert relay_request(daemon.socket, hook, {}, version="0.0.1")[0] == b"declined"
    assert relay_request(daemon.socket, ["gpuhook", "--help"], {})[:2] == (b"declined", 0)
    assert relay_request(daemon.socket, ["gpuhook-relay", "prestart"], {})[:2] == (b"declined", 0)  # no such command
    verdict, status, message = relay_request(daemon.socket, hook, {}, state=b'{"bundle": "relative"}')
    assert (verdict, status) == (b"done", 1) and "must be an absolute path" in message
