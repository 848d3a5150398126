"""Spec-edit mode: the runtime creates and allows the GPU devices itself, on cgroup v1 and v2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration.engines import unique_id
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.relay import runtime_for

from .conftest import MakeContainer
from .test_cgroups import EXPECTED, PROBE


def _spec_edit(host: FakeHost, bundle: object) -> None:
    """Run `gpuhook spec-edit` on the bundle, as a runtime wrapper would."""
    subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "spec-edit",
                    "--bundle", str(bundle)], check=True, capture_output=True, text=True)


@pytest.mark.parametrize("engine", ["runc", "runc-cgroup2"], ids=["cgroup-v1", "cgroup-v2"])
def test_same_view_with_the_runtime_owning_the_devices(make_container: MakeContainer, host: FakeHost,
                                                      engine: str) -> None:
    """After spec-edit the container sees the same devices, and the hook adds no node or rule of its own."""
    container = make_container(PROBE + "; dltest libcuda.so.1", {"NVIDIA_VISIBLE_DEVICES": "1,3"}, engine=engine)
    _spec_edit(host, container.bundle)
    spec = json.loads((container.bundle / "config.json").read_text())
    assert {"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3, "fileMode": 0o666, "uid": 0, "gid": 0} \
        in spec["linux"]["devices"]
    rule = {"allow": True, "type": "c", "major": 195, "minor": 3, "access": "rw"}
    assert rule in spec["linux"]["resources"]["devices"]
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in result.stdout.splitlines()}
    last_plan = [json.loads(line) for line in (host.root / "gpuhook.log").read_text().splitlines()
                 if '"plan_built"' in line][-1]
    assert (last_plan["devices"], last_plan["cgroup_rules"]) == (0, 0)


def test_spec_edit_is_idempotent_and_leaves_non_gpu_specs_alone(make_container: MakeContainer,
                                                                  host: FakeHost) -> None:
    """Running it twice adds nothing more; a spec that asks for no GPU is not rewritten."""
    container = make_container("true", {"NVIDIA_VISIBLE_DEVICES": "0"})
    _spec_edit(host, container.bundle)
    once = (container.bundle / "config.json").read_text()
    _spec_edit(host, container.bundle)
    assert (container.bundle / "config.json").read_text() == once
    plain = make_container("true", {})
    before = (plain.bundle / "config.json").stat()
    _spec_edit(host, plain.bundle)
    after = (plain.bundle / "config.json").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_precreate_stage_edits_stdin_to_stdout(make_container: MakeContainer, host: FakeHost) -> None:
    """podman's precreate contract: the spec on stdin, the edited spec on stdout."""
    container = make_container("true", {"NVIDIA_VISIBLE_DEVICES": "2"})
    out = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "precreate"],
                         input=(container.bundle / "config.json").read_bytes(), capture_output=True, check=True)
    paths = [d["path"] for d in json.loads(out.stdout)["linux"]["devices"]]
    assert "/dev/nvidia2" in paths and "/dev/nvidia0" not in paths


def test_runtime_wrapper_edits_then_runs_runc(make_container: MakeContainer, host: FakeHost) -> None:
    """`gpuhook-runtime run` (docker --runtime gpuhook): no hook registered, yet the container gets its GPU."""
    container = make_container(PROBE + "; dltest libcuda.so.1", {"NVIDIA_VISIBLE_DEVICES": "1,3"}, hooks=[])
    wrapper = Path(sys.executable).with_name("gpuhook-runtime")
    run = subprocess.run([str(wrapper), "run", "--bundle", str(container.bundle), unique_id("wrapper")],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": str(host.config_path)})
    assert run.returncode == 0, run.stderr
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in run.stdout.splitlines()}
    hooks = json.loads((container.bundle / "config.json").read_text())["hooks"]["prestart"]
    assert [h["args"][-1] for h in hooks] == ["prestart"]


def test_the_runtime_front_end_registers_the_relay(make_container: MakeContainer, host: FakeHost,
                                                   relay: Path) -> None:
    """libexec/gpuhook-runtime as the packages install it: the GPU container's spec gets gpuhook-relay as its
    prestart and poststop hook (served by gpuhookd where it runs; here its fallback, the Python hook)."""
    container = make_container(PROBE + "; dltest libcuda.so.1", {"NVIDIA_VISIBLE_DEVICES": "1,3"}, hooks=[])
    run = subprocess.run([str(runtime_for(relay)), "run", "--bundle", str(container.bundle), unique_id("front")],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": str(host.config_path)})
    assert run.returncode == 0, run.stderr
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in run.stdout.splitlines()}
    hooks = json.loads((container.bundle / "config.json").read_text())["hooks"]
    assert [(h["path"], h["args"][1:]) for stage in ("prestart", "poststop") for h in hooks[stage]] == [
        (str(relay), ["--config", str(host.config_path), "prestart"]),
        (str(relay), ["--config", str(host.config_path), "poststop"])]


def test_gpuhookd_edits_the_spec_for_the_runtime_front_end(make_container: MakeContainer, host: FakeHost,
                                                          relay: Path, tmp_path: Path) -> None:
    """With gpuhookd serving the config (found as the engine's environment says), the front-end's GPU create
    gets its spec edited by the daemon through gpuhook-relay, no interpreter started, then runc runs the
    container with its GPUs and the relay as its hooks."""
    daemon = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    log = host.root / "gpuhook.log"
    offset = log.stat().st_size if log.exists() else 0
    try:
        container = make_container(PROBE + "; dltest libcuda.so.1", {"NVIDIA_VISIBLE_DEVICES": "1,3"}, hooks=[])
        run = subprocess.run([str(runtime_for(relay)), "run", "--bundle", str(container.bundle), unique_id("served")],
                             capture_output=True, text=True, timeout=60, check=False,
                             env={"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": str(host.config_path),
                                  "GPUHOOK_DAEMON_SOCKET": daemon.socket})
    finally:
        journal = daemon.stop()
    assert run.returncode == 0, run.stderr + journal
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in run.stdout.splitlines()}
    hooks = json.loads((container.bundle / "config.json").read_text())["hooks"]
    assert [h["path"] for stage in ("prestart", "poststop") for h in hooks[stage]] == [str(relay)] * 2
    with log.open("rb") as handle:
        handle.seek(offset)
        events = [json.loads(line) for line in handle.read().splitlines()]
    edits = [e for e in events if e.get("event") == "runtime_spec_edited"]
    assert [e.get("served_by") for e in edits] == ["gpuhookd"], events
    assert [e["served_by"] for e in events if e.get("event") == "applied"] == ["gpuhookd"]  # its hook too


@pytest.mark.parametrize("case", ["foreign-config", "relative-bundle"])
def test_a_runtime_edit_gpuhookd_does_not_serve_is_the_python_wrappers(make_container: MakeContainer,
                                                                      host: FakeHost, relay: Path, tmp_path: Path,
                                                                      case: str) -> None:
    """gpuhookd declines a config that is not its own, or a bundle given relative to the caller's cwd: the
    Python wrapper edits the spec instead, and the container still gets its GPUs."""
    daemon = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    config = host.config_path
    if case == "foreign-config":
        config = tmp_path / "copy.yaml"
        config.write_text(host.config_path.read_text())
    log = host.root / "gpuhook.log"
    offset = log.stat().st_size if log.exists() else 0
    try:
        container = make_container(PROBE + "; dltest libcuda.so.1", {"NVIDIA_VISIBLE_DEVICES": "1,3"}, hooks=[])
        bundle = "." if case == "relative-bundle" else str(container.bundle)
        run = subprocess.run([str(runtime_for(relay)), "run", "--bundle", bundle, unique_id("declined")],
                             capture_output=True, text=True, timeout=60, check=False, cwd=container.bundle,
                             env={"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": str(config),
                                  "GPUHOOK_DAEMON_SOCKET": daemon.socket})
    finally:
        journal = daemon.stop()
    assert run.returncode == 0, run.stderr + journal
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in run.stdout.splitlines()}
    assert "declined: " in journal
    with log.open("rb") as handle:
        handle.seek(offset)
        assert b"runtime_spec_edited" not in handle.read()
