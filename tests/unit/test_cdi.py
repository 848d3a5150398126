"""CDI spec rendering: names, per-device and shared edits, the version choice, the ldcache hook, YAML/JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhook.cdi import KIND, MOUNT_OPTIONS, Rendered, device_ids, ldcache_hook, minimum_version, render_spec
from gpuhook.cli import main
from gpuhook.cli.cdi import encode
from gpuhook.inventory import DriverFile, Gpu, HostDevice, Inventory, LiveFacts, MigDevice, MigInstance
from gpuhook.planning.planner import Target
from gpuhook.request.model import GpuIndex, MigIndex
from integration.fakehost import FakeHost

VER = "550.54.15"
LIBS = "/usr/lib/x86_64-linux-gnu"
TARGET = Target(libs_dir=LIBS)
HOOK = ["/usr/lib/gpuhook/bin/python", "-I", "-m", "gpuhook"]
UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(2)]
MIGS = ["MIG-aaaaaaaa-0000-0000-0000-000000000000", "MIG-bbbbbbbb-0000-0000-0000-000000000000"]


def _dev(name: str, major: int, minor: int) -> HostDevice:
    """A host node under /host/dev."""
    return HostDevice(name=name, host_path=Path("/host/dev", name), major=major, minor=minor)


def _file(name: str) -> DriverFile:
    """A host driver library."""
    return DriverFile(name=name, host_path=Path("/host/lib", name))


def inventory(*, mig: bool = True) -> Inventory:
    """Two GPUs; GPU 1 split into two MIG devices (GI 7 and 8)."""
    migs = (MigDevice(parent_index=1, index=0, uuid=MIGS[0], gi=7, ci=0),
            MigDevice(parent_index=1, index=1, uuid=MIGS[1], gi=8, ci=0)) if mig else ()
    minors = (("gpu1/gi7/access", 66), ("gpu1/gi7/ci0/access", 67),
              ("gpu1/gi8/access", 75), ("gpu1/gi8/ci0/access", 76))
    return Inventory(
        driver_version=VER, cuda_version="12.4",
        gpus=tuple(Gpu(index=i, uuid=UUIDS[i], minor=i, pci_bus_id=f"00000000:1{i}:00.0", model="H100")
                   for i in range(2)),
        gpu_nodes=tuple(_dev(f"nvidia{i}", 195, i) for i in range(2)),
        control_nodes=(_dev("nvidiactl", 195, 255), _dev("nvidia-uvm", 511, 0), _dev("nvidia-uvm-tools", 511, 1),
                       _dev("nvidia-modeset", 195, 254)),
        libraries=tuple(_file(f"{p}.{VER}") for p in ("libcuda.so", "libnvidia-ml.so", "libGLX_nvidia.so")),
        binaries=(_file("nvidia-smi"),),
        firmware=(DriverFile(name=f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin", host_path=Path("/host/fw")),),
        ipc=(),
        mig_devices=migs,
        mig_minors=minors if mig else (),
    )


def live(*, mig: bool = True) -> LiveFacts:
    """What a render reads at the time: GPU 1's two instances and their capability nodes (none without MIG)."""
    return LiveFacts(
        mig_instances=frozenset(MigInstance(gpu_minor=1, gi=gi, ci=0) for gi in (7, 8)) if mig else frozenset(),
        caps_nodes=tuple(_dev(f"nvidia-caps/nvidia-cap{m}", 510, m) for m in (66, 67, 75, 76)) if mig else (),
    )


def _device(rendered: Rendered, name: str) -> dict[str, Any]:
    """The device entry called *name*."""
    return next(d for d in rendered.spec["devices"] if d["name"] == name)


def _paths(edits: dict[str, Any]) -> list[str]:
    """The container paths of an edit's device nodes."""
    return [n["path"] for n in edits["deviceNodes"]]


def test_names_index_uuid_mig_and_all() -> None:
    """Every GPU by index and UUID, every MIG device by G:M and UUID, then all; list prints them qualified."""
    rendered = render_spec(inventory(), live(), TARGET)
    expected = ["0", UUIDS[0], "1", UUIDS[1], "1:0", MIGS[0], "1:1", MIGS[1], "all"]
    assert [d["name"] for d in rendered.spec["devices"]] == expected
    assert rendered.names == tuple(f"nvidia.com/gpu={n}" for n in expected)
    assert rendered.spec["kind"] == KIND


def test_legacy_mig_uuid_is_not_a_cdi_name() -> None:
    """A MIG-GPU-<uuid>/<gi>/<ci> UUID holds '/', invalid in a CDI name: only its G:M name is listed."""
    legacy = f"MIG-{UUIDS[1]}/7/0"
    inv = inventory()
    inv = Inventory(**{**{f: getattr(inv, f) for f in inv.__dataclass_fields__},
                       "mig_devices": (MigDevice(parent_index=1, index=0, uuid=legacy, gi=7, ci=0),)})
    names = [name for name, _ in device_ids(inv)]
    assert "1:0" in names and legacy not in names
    assert dict(device_ids(inv))["1:0"] == MigIndex(1, 0) and dict(device_ids(inv))["0"] == GpuIndex(0)


def test_device_edits_are_that_devices_nodes_only() -> None:
    """A GPU gets its /dev/nvidiaN; a MIG device its parent's node and its GI/CI caps; all gets every GPU node."""
    rendered = render_spec(inventory(), live(), TARGET)
    assert _paths(_device(rendered, "1")["containerEdits"]) == ["/dev/nvidia1"]
    assert _device(rendered, UUIDS[0])["containerEdits"] == _device(rendered, "0")["containerEdits"]
    assert _paths(_device(rendered, "1:1")["containerEdits"]) == [
        "/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap75", "/dev/nvidia-caps/nvidia-cap76"]
    # all = every GPU and, as the hook's NVIDIA_VISIBLE_DEVICES=all, every MIG device's caps
    assert _paths(_device(rendered, "all")["containerEdits"]) == ["/dev/nvidia0", "/dev/nvidia1"] + [
        f"/dev/nvidia-caps/nvidia-cap{m}" for m in (66, 67, 75, 76)]
    node = _device(rendered, "1")["containerEdits"]["deviceNodes"][0]
    assert node == {"path": "/dev/nvidia1", "hostPath": "/host/dev/nvidia1", "type": "c", "major": 195, "minor": 1,
                    "fileMode": 0o666, "permissions": "rw"}


def test_spec_edits_are_the_driver_for_utility_compute() -> None:
    """Control nodes (no modeset: that is display), compute+utility libraries, binaries, firmware; legacy hook off."""
    edits = render_spec(inventory(), live(), TARGET).spec["containerEdits"]
    assert _paths(edits) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert set(mounts) == {f"{LIBS}/libcuda.so.{VER}", f"{LIBS}/libnvidia-ml.so.{VER}", "/usr/bin/nvidia-smi",
                           f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin"}  # no libGLX: graphics only
    assert mounts[f"{LIBS}/libcuda.so.{VER}"] == {"hostPath": f"/host/lib/libcuda.so.{VER}",
                                                  "containerPath": f"{LIBS}/libcuda.so.{VER}",
                                                  "options": list(MOUNT_OPTIONS)}
    assert mounts[f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin"]["options"] == ["ro", "nosuid", "nodev", "noexec", "bind"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert "hooks" not in edits


def test_ldcache_hook_when_asked_and_what_stays_uncovered() -> None:
    """With a hook argv, one createContainer hook runs gpuhook's update-ldcache over the libs dir."""
    without = render_spec(inventory(), live(), TARGET)
    assert any("ld.so.cache" in item for item in without.not_covered)
    rendered = render_spec(inventory(), live(), TARGET, HOOK)
    assert rendered.spec["containerEdits"]["hooks"] == [{
        "hookName": "createContainer", "path": HOOK[0],
        "args": [*HOOK, "cdi-hook", "update-ldcache", "--folder", LIBS], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
    }]
    assert not any("ld.so.cache" in item for item in rendered.not_covered)
    assert rendered.not_covered == (f"symlink {LIBS}/libcuda.so -> libcuda.so.1",
                                    "CUDA forward compatibility from /usr/local/cuda/compat")
    with pytest.raises(ValueError, match="absolute"):
        ldcache_hook(["python3", "-m", "gpuhook"], [LIBS])


def test_version_is_the_lowest_covering_the_fields() -> None:
    """0.5.0 for host paths and digit-first names (as NVIDIA's); each newer field raises it; older specs stay low."""
    assert render_spec(inventory(), live(), TARGET).spec["cdiVersion"] == "0.5.0"
    base: dict[str, Any] = {"kind": KIND, "devices": [{"name": "gpu", "containerEdits": {
        "deviceNodes": [{"path": "/dev/nvidia0"}]}}]}
    assert minimum_version(base) == "0.3.0"
    mount_type = {**base, "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}}
    assert minimum_version(mount_type) == "0.4.0"
    assert minimum_version({**base, "devices": [{"name": "0", "containerEdits": {}}]}) == "0.5.0"
    assert minimum_version({**base, "annotations": {"a": "b"}}) == "0.6.0"
    assert minimum_version({**base, "kind": "nvidia.com/gpu.x"}) == "0.6.0"
    assert minimum_version({**base, "containerEdits": {"additionalGids": [5]}}) == "0.7.0"
    assert minimum_version({**base, "containerEdits": {"netDevices": [{"name": "x", "hostInterfaceName": "y"}]}}) \
        == "1.1.0"


def test_no_mig_host() -> None:
    """Without MIG devices: index and UUID names only, and the caps of no MIG device anywhere."""
    rendered = render_spec(inventory(mig=False), live(mig=False), TARGET)
    assert [d["name"] for d in rendered.spec["devices"]] == ["0", UUIDS[0], "1", UUIDS[1], "all"]
    assert "nvidia-caps" not in json.dumps(rendered.spec)


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip(fmt: str) -> None:
    """The encoded spec reads back equal (YAML: names like '0' and '1:0' stay strings, fileMode an int)."""
    rendered = render_spec(inventory(), live(), TARGET, HOOK)
    text = encode(rendered, fmt)
    back = yaml.safe_load(text) if fmt == "yaml" else json.loads(text)
    assert back == rendered.spec
    assert all(isinstance(d["name"], str) for d in back["devices"])
    if fmt == "yaml":
        assert text.startswith("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")


def test_cli_generate_and_list(host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cdi generate --output X.json` writes JSON (format from the name) with this interpreter as the hook; `list`."""
    out = tmp_path / "nvidia.json"
    assert main(["--config", str(host.config_path), "cdi", "generate", "--output", str(out)]) == 0
    spec = json.loads(out.read_text())
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", KIND)
    hook = spec["containerEdits"]["hooks"][0]
    assert hook["path"] == os.path.abspath(sys.executable)
    assert hook["args"][1:6] == ["-I", "-m", "gpuhook", "--config", str(host.config_path.absolute())]
    assert [p.name for p in tmp_path.iterdir()] == ["nvidia.json"]  # no temporary file left
    capsys.readouterr()
    assert main(["--config", str(host.config_path), "cdi", "list"]) == 0
    names = capsys.readouterr().out.split()
    assert names[0] == "nvidia.com/gpu=0" and names[-1] == "nvidia.com/gpu=all" and len(names) == 9


def test_cdi_hook_refuses_the_hosts_root(host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """update-ldcache on a bundle whose rootfs is the host's / refuses before running ldconfig."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "/"}, "process": {"args": ["true"], "env": []}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 4242, "bundle": str(bundle)})
    (tmp_path / "state.json").write_text(state)
    stdin = (tmp_path / "state.json").open(encoding="utf-8")  # a real fd: the hook polls stdin with a timeout
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["--config", str(host.config_path), "cdi-hook", "update-ldcache", "--folder", LIBS]) == 1
    assert "is the host's /" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["cdi-hook", "update-ldcache"])  # --folder is required
    assert usage.value.code == 2
    stdin.close()
