"""make_plan: the pure heart, on hand-built inventories."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuhook.errors import DiscoveryError, MissingNodeError, RequestError, UnknownDeviceError
from gpuhook.inventory import (
    DriverFile,
    Gpu,
    HostDevice,
    Inventory,
    LiveFacts,
    LiveNeeds,
    MigDevice,
    MigInstance,
    ProcDriver,
    narrow_to_live,
    unseen_instances,
)
from gpuhook.planning.health import HealthPolicy
from gpuhook.planning.paths import container_path, libs_dir
from gpuhook.planning.planner import Target, live_needs, make_plan, plan_devices
from gpuhook.request.model import ALL_CAPABILITIES, Capability, GpuIndex, GpuRequest, GpuUuid, MigIndex, MigUuid

VER = "550.54.15"
LIBS = "/usr/lib/x86_64-linux-gnu"
TARGET = Target(libs_dir=LIBS)
#: a start that reads nothing live (no extra nodes asked for, no Xids, no MIG)
LIVE = LiveFacts()


def _gpu(i: int) -> Gpu:
    """GPU i with minor i."""
    return Gpu(index=i, uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", minor=i, brand="Tesla", arch="9.0",
               pci_bus_id=f"00000000:{0x17 + i:02X}:00.0", model="NVIDIA H100 80GB HBM3")


def _dev(name: str, major: int, minor: int) -> HostDevice:
    """A host node under /host/dev."""
    return HostDevice(name=name, host_path=Path("/host/dev", name), major=major, minor=minor)


def _file(name: str) -> DriverFile:
    """A host driver file."""
    return DriverFile(name=name, host_path=Path("/host/lib", name))


def inventory(gpus: int = 4) -> Inventory:
    """A 4-GPU host with the usual driver files."""
    return Inventory(
        driver_version=VER, cuda_version="12.4",
        gpus=tuple(_gpu(i) for i in range(gpus)),
        gpu_nodes=tuple(_dev(f"nvidia{i}", 195, i) for i in range(gpus)),
        control_nodes=(_dev("nvidiactl", 195, 255), _dev("nvidia-uvm", 511, 0), _dev("nvidia-uvm-tools", 511, 1),
                       _dev("nvidia-modeset", 195, 254)),
        libraries=tuple(_file(f"{p}.{VER}") for p in ("libcuda.so", "libnvidia-ml.so", "libnvidia-encode.so",
                                                      "libGLX_nvidia.so", "libnvidia-ptxjitcompiler.so")),
        binaries=(_file("nvidia-smi"), _file("nvidia-cuda-mps-control")),
        firmware=(DriverFile(name=f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin", host_path=Path("/host/fw")),),
        ipc=(DriverFile(name="/run/nvidia-persistenced/socket", host_path=Path("/host/sock")),),
        proc_driver=ProcDriver(host_dir=Path("/host/proc/driver/nvidia"),
                               files=(("params", "EnableMSI: 1\nModifyDeviceFiles: 1\n"), ("version", "NVRM")),
                               gpu_dirs=("0000:18:00.0", "0000:1a:00.0")),
    )


def req(*devices, caps=frozenset({Capability.COMPUTE, Capability.UTILITY}), all_devices=False) -> GpuRequest:  # type: ignore[no-untyped-def]
    """A request as the parser would make it."""
    return GpuRequest(all_devices=all_devices, devices=tuple(devices), capabilities=frozenset(caps), raw="x")


def test_two_gpus_compute_utility() -> None:
    """GPUs 1 and 3: their nodes, the control nodes, compute+utility files, exact cgroup rules."""
    plan = make_plan(req(GpuIndex(1), GpuIndex(3)), inventory(), LIVE, TARGET)
    assert [d.path for d in plan.devices] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                              "/dev/nvidia1", "/dev/nvidia3"]
    rules = ["c 195:255 rw", "c 511:0 rw", "c 511:1 rw", "c 195:1 rw", "c 195:3 rw"]
    assert [str(r) for r in plan.cgroup_rules] == rules
    targets = {m.target for m in plan.mounts}
    assert {f"{LIBS}/libcuda.so.{VER}", f"{LIBS}/libnvidia-ml.so.{VER}", "/usr/bin/nvidia-smi",
            "/usr/bin/nvidia-cuda-mps-control", f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin",
            "/run/nvidia-persistenced/socket"} <= targets
    assert f"{LIBS}/libnvidia-encode.so.{VER}" not in targets  # video only
    assert f"{LIBS}/libGLX_nvidia.so.{VER}" not in targets  # graphics only
    assert plan.ldconfig is not None and plan.ldconfig.dirs == (LIBS,)
    assert [(s.path, s.target) for s in plan.symlinks] == [(f"{LIBS}/libcuda.so", "libcuda.so.1")]
    assert plan.gpus == (_gpu(1).uuid, _gpu(3).uuid)


def test_proc_driver_is_masked_and_per_gpu() -> None:
    """ModifyDeviceFiles becomes 0; only the selected GPUs' proc dirs are bound (32-bit domain→16-bit)."""
    plan = make_plan(req(GpuIndex(1), GpuIndex(3)), inventory(), LIVE, TARGET)
    assert plan.proc_driver is not None
    assert dict(plan.proc_driver.files)["params"] == "EnableMSI: 1\nModifyDeviceFiles: 0\n"
    assert [name for _, name in plan.proc_driver.gpu_dirs] == ["0000:18:00.0", "0000:1a:00.0"]


def test_none_injects_the_driver_without_gpus() -> None:
    """NVIDIA_VISIBLE_DEVICES=none: control nodes and libraries, no /dev/nvidiaN."""
    plan = make_plan(req(), inventory(), LIVE, TARGET)
    assert not any(d.path.startswith("/dev/nvidia") and d.path[11:].isdigit() for d in plan.devices)
    assert plan.mounts and plan.gpus == ()


def test_all_and_uuid_selection() -> None:
    """all selects every GPU; a UUID matches case-insensitively."""
    assert len(make_plan(req(all_devices=True), inventory(), LIVE, TARGET).gpus) == 4
    plan = make_plan(req(GpuUuid("GPU-" + _gpu(2).uuid[4:].upper())), inventory(), LIVE, TARGET)
    assert plan.gpus == (_gpu(2).uuid,)


def test_video_implies_compute_libs_and_display_implies_graphics() -> None:
    """libnvidia-container's implied sets."""
    video = {m.target for m in make_plan(req(caps={Capability.VIDEO}), inventory(), LIVE, TARGET).mounts}
    assert f"{LIBS}/libcuda.so.{VER}" in video and f"{LIBS}/libnvidia-encode.so.{VER}" in video
    display = make_plan(req(caps={Capability.DISPLAY}), inventory(), LIVE, TARGET)
    assert f"{LIBS}/libGLX_nvidia.so.{VER}" in {m.target for m in display.mounts}
    assert "/dev/nvidia-modeset" in {d.path for d in display.devices}


def test_unknown_index_names_it_and_lists_what_exists() -> None:
    """NVIDIA_VISIBLE_DEVICES=9 on a 4-GPU host."""
    with pytest.raises(UnknownDeviceError) as excinfo:
        make_plan(req(GpuIndex(9)), inventory(), LIVE, TARGET)
    message = str(excinfo.value)
    assert "no GPU with index 9" in message and "it has 4 GPUs" in message and _gpu(3).uuid in message


def test_mig_on_a_host_without_mig() -> None:
    """A MIG index is refused with a clear reason when the host has no MIG devices."""
    with pytest.raises(UnknownDeviceError, match=r"no MIG device 0:1 .*MIG devices: none"):
        make_plan(req(MigIndex(0, 1)), inventory(), LIVE, TARGET)


def test_missing_gpu_node_and_control_node_are_host_errors() -> None:
    """A selected GPU without its node, no nvidiactl, or no nvidia-uvm for compute is a MissingNodeError naming
    the nvidia-modprobe arguments that create it (load_kmods runs them)."""
    inv = inventory()
    no_node = Inventory(**{**_fields(inv), "gpu_nodes": inv.gpu_nodes[:1]})
    with pytest.raises(MissingNodeError, match="create it with `nvidia-modprobe -c 1`") as gpu:
        make_plan(req(GpuIndex(1)), no_node, LIVE, TARGET)
    no_ctl = Inventory(**{**_fields(inv), "control_nodes": ()})
    with pytest.raises(MissingNodeError, match="/dev/nvidiactl, which every GPU start needs, is missing") as ctl:
        make_plan(req(GpuIndex(0)), no_ctl, LIVE, TARGET)
    no_uvm = Inventory(**{**_fields(inv), "control_nodes": tuple(n for n in inv.control_nodes
                                                                  if not n.name.startswith("nvidia-uvm"))})
    with pytest.raises(MissingNodeError, match="/dev/nvidia-uvm, which the compute capability needs") as uvm:
        make_plan(req(GpuIndex(0)), no_uvm, LIVE, TARGET)
    assert (gpu.value.modprobe, ctl.value.modprobe, uvm.value.modprobe) == (("-c", "1"), ("-c", "255"),
                                                                           ("-u", "-c", "0"))
    assert make_plan(req(GpuIndex(0), caps=frozenset({Capability.UTILITY})), no_uvm, LIVE, TARGET).devices


def test_missing_optional_items_are_skipped_as_data() -> None:
    """Absent optional libraries and nodes become Skipped entries, not silence."""
    inv = inventory()
    without_proc = Inventory(**{**_fields(inv), "proc_driver": None})
    plan = make_plan(req(GpuIndex(0), caps=ALL_CAPABILITIES), without_proc, LIVE, TARGET)
    skipped = {s.what for s in plan.skipped}
    assert {"libnvidia-ngx.so", "nvidia-debugdump", "/proc/driver/nvidia"} <= skipped


def test_cgroups_can_be_left_to_the_runtime() -> None:
    """no_cgroups: nodes are still created, no rules planned."""
    plan = make_plan(req(GpuIndex(0)), inventory(), LIVE, Target(libs_dir=LIBS, manage_cgroups=False))
    assert plan.devices and plan.cgroup_rules == ()


def test_libs_dir_rule_and_container_paths() -> None:
    """Debian-like rootfs → multiarch dir, else /usr/lib64; '..' is refused."""
    assert libs_dir(debian_like=True, machine="x86_64") == LIBS
    assert libs_dir(debian_like=False, machine="x86_64") == "/usr/lib64"
    assert container_path("usr/bin", "nvidia-smi") == "/usr/bin/nvidia-smi"
    with pytest.raises(ValueError, match=r"\.\."):
        container_path("usr/lib", "../../etc/shadow")


def _fields(inv: Inventory) -> dict[str, object]:
    """An inventory's fields, to copy with changes."""
    return {name: getattr(inv, name) for name in inv.__dataclass_fields__}


def test_imex_channels_and_gated_devices() -> None:
    """Requested IMEX channels and enabled gated families become exact nodes; a missing channel is refused."""
    extra = (_dev("nvidia-caps-imex-channels/channel0", 509, 0), _dev("nvidia-caps-imex-channels/channel3", 509, 3),
             _dev("nvidia-fs0", 507, 0), _dev("infiniband/uverbs0", 231, 192), _dev("gdrdrv", 506, 0))
    inv, live = inventory(), LiveFacts(extra_nodes=extra)
    request = GpuRequest(all_devices=False, devices=(GpuIndex(0),), capabilities=frozenset({Capability.COMPUTE}),
                         imex_channels=(3,), gated=frozenset({"gds", "mofed", "nvswitch"}))
    plan = make_plan(request, inv, live, TARGET)
    paths = [d.path for d in plan.devices]
    assert {"/dev/nvidia-caps-imex-channels/channel3", "/dev/nvidia-fs0", "/dev/infiniband/uverbs0"} <= set(paths)
    assert "/dev/nvidia-caps-imex-channels/channel0" not in paths and "/dev/gdrdrv" not in paths
    assert "c 509:3 rw" in {str(r) for r in plan.cgroup_rules}
    assert "NVIDIA_NVSWITCH" in {s.what for s in plan.skipped}
    with pytest.raises(DiscoveryError, match="channel 7"):
        make_plan(GpuRequest(all_devices=False, devices=(), capabilities=frozenset(), imex_channels=(7,)), inv, live,
                  TARGET)


def test_graphics_configs_and_glx_link() -> None:
    """graphics brings the Vulkan ICD/EGL vendor files and the libGLX_indirect link; compute the OpenCL ICD."""
    configs = (DriverFile(name="/usr/share/vulkan/icd.d/nvidia_icd.json", host_path=Path("/h/icd")),
               DriverFile(name="/etc/OpenCL/vendors/nvidia.icd", host_path=Path("/h/ocl")))
    inv = Inventory(**{**_fields(inventory()), "configs": configs})
    graphics = make_plan(req(GpuIndex(0), caps={Capability.GRAPHICS}), inv, LIVE, TARGET)
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in {m.target for m in graphics.mounts}
    assert "/etc/OpenCL/vendors/nvidia.icd" not in {m.target for m in graphics.mounts}
    links = {(s.path, s.target) for s in graphics.symlinks}
    assert (f"{LIBS}/libGLX_indirect.so.0", f"libGLX_nvidia.so.{VER}") in links
    compute = make_plan(req(GpuIndex(0)), inv, LIVE, TARGET)
    assert "/etc/OpenCL/vendors/nvidia.icd" in {m.target for m in compute.mounts}
    assert all("GLX" not in s.path for s in compute.symlinks)


def _mig_inventory() -> Inventory:
    """GPU 0 split into two 1g MIG devices (GI 7 and 8, CI 0 each), as NVML reported them."""
    migs = (MigDevice(parent_index=0, index=0, uuid="MIG-aaaaaaaa-0000-0000-0000-000000000000", gi=7, ci=0),
            MigDevice(parent_index=0, index=1, uuid="MIG-bbbbbbbb-0000-0000-0000-000000000000", gi=8, ci=0))
    minors = (("config", 1), ("monitor", 2), ("gpu0/gi7/access", 66), ("gpu0/gi7/ci0/access", 67),
              ("gpu0/gi8/access", 75), ("gpu0/gi8/ci0/access", 76))
    layout = (MigInstance(gpu_minor=0, gi=7, ci=0), MigInstance(gpu_minor=0, gi=8, ci=0))
    return Inventory(**{**_fields(inventory()), "mig_devices": migs, "mig_layout": layout, "mig_minors": minors})


def _mig_live(*gis: int) -> LiveFacts:
    """GPU 0's instances in GIs *gis* (CI 0 each) exist, with their caps nodes and config/monitor's."""
    minors = {7: (66, 67), 8: (75, 76), 9: (84, 85)}
    caps = tuple(_dev(f"nvidia-caps/nvidia-cap{m}", 510, m) for m in (1, 2, *(m for gi in gis for m in minors[gi])))
    return LiveFacts(mig_instances=frozenset(MigInstance(gpu_minor=0, gi=gi, ci=0) for gi in gis), caps_nodes=caps)


MIG_LIVE = _mig_live(7, 8)


def test_mig_index_selects_parent_and_exactly_its_caps() -> None:
    """0:1 gives /dev/nvidia0 and the GI/CI access caps of that MIG device only, with exact rules."""
    plan = make_plan(req(MigIndex(0, 1)), _mig_inventory(), MIG_LIVE, TARGET)
    paths = {d.path for d in plan.devices}
    assert {"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap75", "/dev/nvidia-caps/nvidia-cap76"} <= paths
    assert not {"/dev/nvidia-caps/nvidia-cap66", "/dev/nvidia-caps/nvidia-cap67", "/dev/nvidia1"} & paths
    assert {"c 510:75 rw", "c 510:76 rw"} <= {str(r) for r in plan.cgroup_rules}
    assert plan.gpus[-1] == "MIG-bbbbbbbb-0000-0000-0000-000000000000"
    assert plan.proc_driver is not None and [rel for _, rel in plan.proc_driver.cap_files] == [
        "capabilities/gpu0/mig/gi8/access", "capabilities/gpu0/mig/gi8/ci0/access"]


def test_mig_uuid_forms_and_unknown_mig() -> None:
    """A MIG UUID and the legacy MIG-GPU-<uuid>/gi/ci form select; 0:5 is refused, listing what exists."""
    inv = _mig_inventory()
    by_uuid = make_plan(req(MigUuid("MIG-AAAAAAAA-0000-0000-0000-000000000000")), inv, MIG_LIVE, TARGET)
    assert "/dev/nvidia-caps/nvidia-cap66" in {d.path for d in by_uuid.devices}
    legacy = make_plan(req(MigUuid(f"MIG-{_gpu(0).uuid}/8/0")), inv, MIG_LIVE, TARGET)
    assert "/dev/nvidia-caps/nvidia-cap76" in {d.path for d in legacy.devices}
    with pytest.raises(UnknownDeviceError, match=r"no MIG device 0:5 .*MIG devices: 0:0 \(MIG-aaaaaaaa"):
        make_plan(req(MigIndex(0, 5)), inv, MIG_LIVE, TARGET)


def test_mig_config_is_for_whole_gpus() -> None:
    """NVIDIA_MIG_CONFIG_DEVICES=all adds the config cap and the instance caps of the selected GPU."""
    request = GpuRequest(all_devices=False, devices=(GpuIndex(0),), capabilities=frozenset(), mig_config=True)
    plan = make_plan(request, _mig_inventory(), MIG_LIVE, TARGET)
    assert {f"/dev/nvidia-caps/nvidia-cap{m}" for m in (1, 66, 67, 75, 76)} <= {d.path for d in plan.devices}
    assert "/dev/nvidia-caps/nvidia-cap2" not in {d.path for d in plan.devices}
    with pytest.raises(RequestError, match="need whole GPUs"):
        make_plan(GpuRequest(all_devices=False, devices=(MigIndex(0, 0),), capabilities=frozenset(), mig_config=True),
                  _mig_inventory(), MIG_LIVE, TARGET)


def test_destroyed_mig_device_is_not_offered_and_the_rest_move_down() -> None:
    """GI 7 destroyed since the inventory was built: its device is gone, GI 8's device becomes 0:0 (as NVML counts)."""
    live = _mig_live(8)
    plan = make_plan(req(MigIndex(0, 0)), _mig_inventory(), live, TARGET)
    assert plan.gpus[-1] == "MIG-bbbbbbbb-0000-0000-0000-000000000000"
    assert {"/dev/nvidia-caps/nvidia-cap75", "/dev/nvidia-caps/nvidia-cap76"} <= {d.path for d in plan.devices}
    with pytest.raises(UnknownDeviceError, match=r"MIG-AAAAAAAA.*MIG devices: 0:0 \(MIG-bbbbbbbb[^,]*\)\. Fix"):
        make_plan(req(MigUuid("MIG-AAAAAAAA-0000-0000-0000-000000000000")), _mig_inventory(), live, TARGET)
    everything = make_plan(req(all_devices=True), _mig_inventory(), live, TARGET)
    assert "MIG-aaaaaaaa-0000-0000-0000-000000000000" not in everything.gpus
    assert "/dev/nvidia-caps/nvidia-cap66" not in {d.path for d in everything.devices}


def test_narrowing_is_idempotent_and_skipped_without_a_layout() -> None:
    """Narrowing twice is narrowing once; an unread layout (None) leaves the inventory as NVML saw it."""
    inv, live = _mig_inventory(), _mig_live(8)
    once = narrow_to_live(inv, live)
    assert [(m.index, m.gi) for m in once.mig_devices] == [(0, 8)]
    assert narrow_to_live(once, live) == once
    assert narrow_to_live(inv, MIG_LIVE) is inv and narrow_to_live(inv, LIVE) is inv


def test_unseen_instances_are_only_those_nvml_was_never_asked_about() -> None:
    """GI 9 is new; GI 7 and 8 were seen; an instance on a GPU the inventory does not have is not ours to ask about."""
    live = _mig_live(7, 8, 9)
    other_gpu = LiveFacts(mig_instances=frozenset({MigInstance(gpu_minor=9, gi=1, ci=0)}))
    assert unseen_instances(_mig_inventory(), live) == (MigInstance(gpu_minor=0, gi=9, ci=0),)
    assert unseen_instances(_mig_inventory(), MIG_LIVE) == ()
    assert unseen_instances(_mig_inventory(), other_gpu) == () and unseen_instances(_mig_inventory(), LIVE) == ()
    # seen when NVML was asked, though NVML reported no device for it: not asked about again
    seen = Inventory(**{**_fields(_mig_inventory()), "mig_layout": (MigInstance(gpu_minor=0, gi=9, ci=0),)})
    assert unseen_instances(seen, live) == ()


def test_mig_without_the_layout_read_is_a_programming_error() -> None:
    """Selecting a MIG device with live facts that lack the MIG layout says which call was missed."""
    with pytest.raises(ValueError, match="live_needs"):
        plan_devices(req(MigIndex(0, 0)), _mig_inventory(), LIVE)


@pytest.mark.parametrize(
    ("request_", "target", "needs"),
    [
        pytest.param(req(GpuIndex(0)), None, LiveNeeds(mps=True), id="whole-gpu-devices-only"),
        pytest.param(req(GpuIndex(0), caps={Capability.UTILITY}), None, LiveNeeds(), id="utility-only-no-mps-pipe"),
        pytest.param(req(GpuIndex(0)), TARGET, LiveNeeds(xids=True, mps=True), id="whole-gpu-health"),
        pytest.param(req(GpuIndex(0)), Target(libs_dir=LIBS, unhealthy_gpus=HealthPolicy.IGNORE), LiveNeeds(mps=True),
                     id="health-ignored"),
        pytest.param(req(MigIndex(0, 1)), None, LiveNeeds(mig=True, mps=True), id="mig-index"),
        pytest.param(req(MigUuid("MIG-x")), None, LiveNeeds(mig=True, mps=True), id="mig-uuid"),
        pytest.param(req(all_devices=True), None, LiveNeeds(mig=True, mps=True), id="all"),
        pytest.param(GpuRequest(all_devices=False, devices=(GpuIndex(0),), capabilities=frozenset(), mig_monitor=True),
                     None, LiveNeeds(mig=True), id="mig-monitor"),
        pytest.param(GpuRequest(all_devices=False, devices=(), capabilities=frozenset(), imex_channels=(1,)),
                     None, LiveNeeds(extra_nodes=True), id="imex"),
        pytest.param(GpuRequest(all_devices=False, devices=(), capabilities=frozenset(), gated=frozenset({"gds"})),
                     None, LiveNeeds(extra_nodes=True), id="gated"),
    ],
)
def test_live_needs(request_: GpuRequest, target: Target | None, needs: LiveNeeds) -> None:
    """A start reads only what its plan looks at: MIG facts for MIG requests and all, Xids when health counts,
    the MPS pipe directory for compute."""
    assert live_needs(request_, target) == needs


@pytest.mark.parametrize(
    ("caps", "missing"),
    [
        pytest.param({Capability.COMPUTE}, "libcuda.so", id="compute-without-libcuda"),
        pytest.param({Capability.UTILITY}, "libnvidia-ml.so", id="utility-without-nvml"),
        pytest.param({Capability.VIDEO}, "libcuda.so", id="video-implies-compute"),
    ],
)
def test_gpu_nodes_are_never_planned_without_their_required_libraries(caps: set[Capability], missing: str) -> None:
    """An inventory whose libraries do not match the driver (an upgrade mid-discovery) refuses, naming the library."""
    inv = inventory()
    without = replace(inv, libraries=tuple(f for f in inv.libraries if not f.name.startswith(missing + ".")))
    with pytest.raises(DiscoveryError, match=rf"lack {missing}\.{VER}.*NVML reports driver {VER}.*retry once"):
        make_plan(req(GpuIndex(0), caps=caps), without, LIVE, TARGET)
    no_libraries = replace(inv, libraries=())
    with pytest.raises(DiscoveryError, match=rf"lack .*{missing}\.{VER}"):
        make_plan(req(GpuIndex(0), caps=caps), no_libraries, LIVE, TARGET)


def test_required_libraries_only_bind_a_start_with_gpus() -> None:
    """Graphics-only libraries stay optional (skipped), and a start with no GPU selected needs none."""
    inv = inventory()
    no_libraries = replace(inv, libraries=())
    plan = make_plan(req(GpuIndex(0), caps={Capability.GRAPHICS}), no_libraries, LIVE, TARGET)
    assert plan.devices and "libGLX_nvidia.so" in {s.what for s in plan.skipped}
    assert make_plan(req(caps={Capability.COMPUTE}), no_libraries, LIVE, TARGET).devices[0].path == "/dev/nvidiactl"


def test_a_whole_gpu_in_mig_mode_is_given_with_a_warning_naming_its_mig_devices() -> None:
    """GPU 0 in MIG mode asked for whole: given (nvidia-smi sees it, as with NVIDIA's stack), with a warning
    that CUDA sees none of it, its MIG devices, and what to ask for instead; `all` and GPU 1 get none."""
    inv = inventory()
    mig = MigDevice(parent_index=0, index=0, uuid="MIG-00000000-1111-2222-3333-444444444444", gi=1, ci=0,
                    profile="3g.40gb")
    inv = replace(inv, gpus=(replace(inv.gpus[0], mig_enabled=True), *inv.gpus[1:]), mig_devices=(mig,))
    [warning] = make_plan(req(GpuIndex(0), GpuIndex(1)), inv, LiveFacts(mig_instances=frozenset()), TARGET).warnings
    assert warning.startswith("GPU 0 (GPU-00000000-") and "is in MIG mode" in warning
    assert f"0:0 ({mig.uuid}, 3g.40gb)" in warning and "0,mig=PROFILE" in warning
    assert make_plan(req(all_devices=True), inv, LiveFacts(mig_instances=frozenset()), TARGET).warnings == ()
