"""The device plugin's strategies through the same parser: volume-mounts end to end under runc."""

from __future__ import annotations

import json
from pathlib import Path

from integration.fakehost import FakeHost

from .conftest import MakeContainer, hook_entry

PROBE = "devopen /dev/nvidia0 /dev/nvidia2"


def _with_device_list(bundle: Path, names: list[str]) -> None:
    """Add the /dev/null mounts the device plugin's volume-mounts strategy asks the kubelet for."""
    spec = json.loads((bundle / "config.json").read_text())
    spec["mounts"] += [{"destination": f"/var/run/nvidia-container-devices/{name}", "type": "bind",
                        "source": "/dev/null", "options": ["bind", "ro"]} for name in names]
    (bundle / "config.json").write_text(json.dumps(spec))


def test_volume_mounts_strategy(make_container: MakeContainer, host: FakeHost, tmp_path: Path) -> None:
    """With accept_volume_mounts and the env refused for unprivileged pods, only the allocated GPU appears."""
    config = tmp_path / "k8s.yaml"
    config.write_text(host.config_path.read_text()
                      + "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n")
    # The pod also sets NVIDIA_VISIBLE_DEVICES=all itself: under this policy that must not widen anything.
    container = make_container(PROBE, {"NVIDIA_VISIBLE_DEVICES": "all"}, hook=hook_entry(config, "prestart"))
    _with_device_list(container.bundle, [host.gpus[2].uuid])
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia2 ENXIO" in result.stdout and "/dev/nvidia0 ENOENT" in result.stdout


def test_env_request_ignored_without_the_plugin(make_container: MakeContainer, host: FakeHost,
                                                tmp_path: Path) -> None:
    """The same policy with no device-plugin mounts: an unprivileged pod's NVIDIA_VISIBLE_DEVICES=all gets nothing."""
    config = tmp_path / "k8s.yaml"
    config.write_text(host.config_path.read_text()
                      + "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n")
    result = make_container(PROBE, {"NVIDIA_VISIBLE_DEVICES": "all"}, hook=hook_entry(config, "prestart")).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia0 ENOENT" in result.stdout and "/dev/nvidia2 ENOENT" in result.stdout


def test_cdi_annotations_strategy(make_container: MakeContainer, host: FakeHost, tmp_path: Path) -> None:
    """accept_cdi_annotations: the kubelet's cdi.k8s.io annotation picks GPU 3 for an unprivileged pod."""
    config = tmp_path / "k8s.yaml"
    config.write_text(host.config_path.read_text()
                      + "accept_cdi_annotations: true\naccept_envvar_when_unprivileged: false\n")
    container = make_container("devopen /dev/nvidia0 /dev/nvidia3", {}, hook=hook_entry(config, "prestart"))
    spec = json.loads((container.bundle / "config.json").read_text())
    spec["annotations"] = {"cdi.k8s.io/nvidia-device-plugin_uuid": "nvidia.com/gpu=3"}
    (container.bundle / "config.json").write_text(json.dumps(spec))
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia3 ENXIO" in result.stdout and "/dev/nvidia0 ENOENT" in result.stdout
