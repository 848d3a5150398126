"""MIG under real runc, on a simulated host with GPU 0 split into two 1g.10gb instances."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host

from .conftest import MakeContainer, hook_entry


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """Two H100s; GPU 0 in MIG mode with two 1g.10gb devices (GI 7 and 8)."""
    return create_host(tmp_path_factory.mktemp("mighost") / "host", gpus=2, mig={0: ("1g.10gb", "1g.10gb")})


def test_mig_index_gets_the_parent_and_exactly_its_caps(make_container: MakeContainer, mig_host: FakeHost) -> None:
    """NVIDIA_VISIBLE_DEVICES=0:1: /dev/nvidia0 and that device's two caps nodes; the other's is refused."""
    second, first = mig_host.mig_devices[1], mig_host.mig_devices[0]
    script = (f"ls /dev/nvidia-caps; devopen /dev/nvidia0 /dev/nvidia-caps/nvidia-cap{second.gi_cap_minor} "
              f"/dev/nvidia-caps/nvidia-cap{second.ci_cap_minor}; "
              f"mknod /tmp/other c {mig_host.caps_major} {first.gi_cap_minor} && devopen /tmp/other")
    hook = hook_entry(mig_host.config_path, "prestart")
    result = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0:1"}, hook=hook).run()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert sorted(n for n in lines if n.startswith("nvidia-cap") and "/" not in n) == sorted(
        [f"nvidia-cap{second.gi_cap_minor}", f"nvidia-cap{second.ci_cap_minor}"])
    out = result.stdout
    assert "/dev/nvidia0 ENXIO" in out
    assert f"/dev/nvidia-caps/nvidia-cap{second.gi_cap_minor} ENXIO" in out
    assert f"/dev/nvidia-caps/nvidia-cap{second.ci_cap_minor} ENXIO" in out
    assert "/tmp/other EPERM" in out


def test_mig_uuid_selects_and_unknown_index_is_refused(make_container: MakeContainer, mig_host: FakeHost) -> None:
    """A MIG UUID works like its G:M index; 0:5 is refused naming it and listing the MIG devices."""
    first = mig_host.mig_devices[0]
    hook = hook_entry(mig_host.config_path, "prestart")
    ok = make_container(f"devopen /dev/nvidia-caps/nvidia-cap{first.ci_cap_minor}",
                        {"NVIDIA_VISIBLE_DEVICES": first.uuid}, hook=hook).run()
    assert ok.returncode == 0, ok.stderr
    assert f"nvidia-cap{first.ci_cap_minor} ENXIO" in ok.stdout
    refused = make_container("echo started", {"NVIDIA_VISIBLE_DEVICES": "0:5"}, hook=hook).run()
    assert refused.returncode != 0 and "started" not in refused.stdout
    assert "no MIG device 0:5" in refused.stderr and first.uuid in refused.stderr


def test_mig_host_info_lists_the_instances(mig_host: FakeHost, tmp_path: Path) -> None:
    """`gpuhook plan` on the MIG host shows the MIG device among the selected ones."""
    import json
    import subprocess
    import sys

    bundle = tmp_path / "bundle"
    (bundle / "rootfs/etc").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                    "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0:0"]}}))
    out = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(mig_host.config_path), "plan",
                          "--bundle", str(bundle)], capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)["plan"]
    assert mig_host.mig_devices[0].uuid in plan["gpus"]
