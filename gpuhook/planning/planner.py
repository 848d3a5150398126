"""make_plan: the heart of gpuhook, a pure function of the request, the inventory, the live facts and the target.

The inventory is what changes only with the driver (cached); the live facts are what
a start reads fresh (extra nodes, Xids, the MIG layout and capability nodes), and
``live_needs`` says which of them a request needs, so that a start reads no more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuhook import catalog
from gpuhook.errors import DiscoveryError, MissingNodeError, RequestError
from gpuhook.inventory import DriverFile, Gpu, HostDevice, Inventory, LiveFacts, LiveNeeds, MigDevice, narrow_to_live
from gpuhook.planning.paths import BIN_DIR, container_path
from gpuhook.planning.plan import (
    BindMount,
    CgroupRule,
    CudaCompat,
    DeviceNode,
    Ldconfig,
    Plan,
    ProcDriverMount,
    Skipped,
    Symlink,
)
from gpuhook.planning.health import HealthPolicy, check_health
from gpuhook.planning.requirements import check_requirements
from gpuhook.planning.select import Selection, select_devices
from gpuhook.request.model import Capability, GpuRequest, MigIndex, MigUuid

#: Development symlinks NVIDIA adds (nvc_mount.c symlink_libraries); SONAME links come from ldconfig.
CUDA_COMPAT_DIR = "/usr/local/cuda/compat"
_DEV_SYMLINKS = (
    ("libcuda.so", "libcuda.so.1"),
    ("libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"),
    # GLVND's indirect-rendering entry point, to the versioned file (nvc_mount.c symlink_libraries): a link
    # to libGLX_nvidia.so.0 would dangle until ldconfig makes that, and ldconfig deletes dangling lib links.
    ("libGLX_indirect.so.0", "libGLX_nvidia.so.{version}"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Facts about the container that placement depends on."""

    libs_dir: str
    libs32_dir: str = "/usr/lib32"
    manage_cgroups: bool = True
    #: look for the image's CUDA forward-compatibility libraries (config ``cuda_compat``)
    cuda_compat: bool = True
    #: what to do with a selected unhealthy GPU: "refuse", "warn" (a Skipped entry) or "ignore"
    unhealthy_gpus: HealthPolicy = HealthPolicy.REFUSE
    #: (major, minor) of nodes the runtime already creates and allows (spec-edit mode): left to it
    runtime_devices: frozenset[tuple[int, int]] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class DevicePlan:
    """The selected GPUs (and MIG parents), MIG devices, and every device node they need."""

    gpus: tuple[Gpu, ...]
    migs: tuple[MigDevice, ...]
    devices: tuple[DeviceNode, ...]
    skipped: tuple[Skipped, ...]


def live_needs(request: GpuRequest, target: Target | None = None) -> LiveNeeds:
    """The live facts planning *request* reads (*target* None: ``plan_devices`` alone, no health check)."""
    return LiveNeeds(
        extra_nodes=bool(request.imex_channels or request.gated),
        xids=target is not None and target.unhealthy_gpus is not HealthPolicy.IGNORE,
        # "all" selects every MIG device too (select_devices)
        mig=(request.all_devices or request.mig_config or request.mig_monitor or bool(request.mig_asks)
             or any(isinstance(d, MigIndex | MigUuid) for d in request.devices)),
        mps=Capability.COMPUTE in request.capabilities,
    )


def plan_devices(request: GpuRequest, inventory: Inventory, live: LiveFacts) -> DevicePlan:
    """Select the GPUs, check the image's requirements, list the nodes; raises RequestError/DiscoveryError."""
    inventory = narrow_to_live(inventory, live)
    selection = select_devices(request, inventory)
    if (selection.migs or request.mig_config or request.mig_monitor) and live.mig_instances is None:
        raise ValueError(f"{request.raw!r} uses MIG, but the MIG layout was not read: ask for live_needs(request)")
    gpus = selection.parents(inventory)
    check_requirements(request.requirements, inventory, gpus)
    skipped: list[Skipped] = []
    control = _control_devices(inventory, request.capabilities, skipped)
    mig = (tuple(_mig_caps(inventory, live, selection.migs))
           + _mig_control_caps(request, inventory, live, selection, gpus))
    extra = _imex_devices(live, request.imex_channels) + _gated_devices(live, request.gated, skipped)
    return DevicePlan(gpus=gpus, migs=selection.migs,
                      devices=control + tuple(_gpu_device(inventory, g) for g in gpus) + mig + extra,
                      skipped=tuple(skipped))


def _mig_caps(inventory: Inventory, live: LiveFacts, migs: tuple[MigDevice, ...]) -> list[DeviceNode]:
    """The GPU-instance and compute-instance ``access`` capability nodes of each MIG device."""
    minors = dict(inventory.mig_minors)
    nodes = {n.minor: n for n in live.caps_nodes}
    out: list[DeviceNode] = []
    for mig in migs:
        parent = inventory.gpus[mig.parent_index]
        for cap in mig_cap_names(parent, mig):
            minor = minors.get(cap)
            node = nodes.get(minor) if minor is not None else None
            if node is None:
                modprobe = catalog.modprobe_capability(cap)
                raise MissingNodeError(
                    f"MIG device {mig.uuid} needs the capability {cap} (minor {minor}), but "
                    f"/dev/nvidia-caps/nvidia-cap{minor} is missing under the dev root; create it with "
                    f"`{_modprobe_text(modprobe)}`", modprobe)
            out.append(_node(node))
    return out


def _mig_control_caps(
    request: GpuRequest, inventory: Inventory, live: LiveFacts, selection: Selection, gpus: tuple[Gpu, ...]
) -> tuple[DeviceNode, ...]:
    """NVIDIA_MIG_CONFIG/MONITOR_DEVICES=all: the config/monitor cap and every instance cap of the GPUs."""
    wanted = [name for name, on in (("config", request.mig_config), ("monitor", request.mig_monitor)) if on]
    if not wanted:
        return ()
    if selection.migs and not request.all_devices:
        raise RequestError("NVIDIA_MIG_CONFIG_DEVICES/NVIDIA_MIG_MONITOR_DEVICES need whole GPUs, not MIG devices")
    prefixes = tuple(f"gpu{g.minor}/" for g in gpus)
    minors = {minor for name, minor in inventory.mig_minors if name in wanted or name.startswith(prefixes)}
    missing = [name for name in wanted if name not in dict(inventory.mig_minors)]
    if missing:
        raise DiscoveryError(f"the driver lists no MIG {', '.join(missing)} capability (is MIG supported?)")
    return tuple(_node(n) for n in live.caps_nodes if n.minor in minors)


def _cap_proc_file(cap: str) -> str:
    """mig-minors says ``gpu0/gi7/access``; the driver's file is ``capabilities/gpu0/mig/gi7/access``."""
    gpu, _, rest = cap.partition("/")
    return f"capabilities/{gpu}/mig/{rest}"


def mig_cap_names(parent: Gpu, mig: MigDevice) -> tuple[str, str]:
    """The mig-minors names of a MIG device's GI and CI access capabilities."""
    gi = f"gpu{parent.minor}/gi{mig.gi}/access"
    return gi, f"gpu{parent.minor}/gi{mig.gi}/ci{mig.ci}/access"


def _imex_devices(live: LiveFacts, channels: tuple[int, ...]) -> tuple[DeviceNode, ...]:
    """/dev/nvidia-caps-imex-channels/channelN for each requested channel; a missing one is refused."""
    have = {n.name: n for n in live.extra_nodes}
    out = []
    for channel in channels:
        node = have.get(f"{catalog.IMEX_DIR}/channel{channel}")
        if node is None:
            raise DiscoveryError(
                f"NVIDIA_IMEX_CHANNELS asks for channel {channel}, but /dev/{catalog.IMEX_DIR}/channel{channel} "
                "does not exist on this host; create it (its major is nvidia-caps-imex-channels in /proc/devices) "
                "or request an existing channel"
            )
        out.append(_node(node))
    return tuple(out)


def _gated_devices(live: LiveFacts, gated: frozenset[str], skipped: list[Skipped]) -> tuple[DeviceNode, ...]:
    """The nodes of each NVIDIA_<NAME>=enabled family that the host has (absent ones are skipped)."""
    out: list[DeviceNode] = []
    for name in sorted(gated):
        found = [n for n in live.extra_nodes if n.name.startswith(catalog.GATED_NODES[name])]
        if not found:
            skipped.append(Skipped(what=f"NVIDIA_{name.upper()}", reason="no such devices on this host"))
        out += [_node(n) for n in found]
    return tuple(out)


def _whole_mig_gpus(request: GpuRequest, inventory: Inventory, device_plan: DevicePlan) -> tuple[str, ...]:
    """A GPU in MIG mode asked for whole: its node lets nvidia-smi see it, but CUDA sees none of it (NVIDIA's
    stack gives it so too, and monitoring containers ask so); said, with what to ask for instead."""
    if request.all_devices:
        return ()
    parents = {m.parent_index for m in device_plan.migs}
    out = []
    for gpu in (g for g in device_plan.gpus if g.mig_enabled and g.index not in parents):
        migs = ", ".join(f"{m.parent_index}:{m.index} ({m.uuid}, {m.profile or '?'})"
                         for m in inventory.mig_devices if m.parent_index == gpu.index) or "none"
        out.append(f"GPU {gpu.index} ({gpu.uuid}) is in MIG mode and asked for whole: CUDA in the container sees "
                   f"none of it. Its MIG devices: {migs}; ask for one of them ({gpu.index}:0, a MIG UUID) or for a "
                   f"new instance ({gpu.index},mig=PROFILE)")
    return tuple(out)


def make_plan(request: GpuRequest, inventory: Inventory, live: LiveFacts, target: Target) -> Plan:
    """Everything to inject for *request*; raises RequestError/DiscoveryError."""
    device_plan = plan_devices(request, inventory, live)
    gpus = device_plan.gpus
    caps = request.capabilities
    skipped = list(device_plan.skipped)
    warnings = check_health(gpus, live, target.unhealthy_gpus) + _whole_mig_gpus(request, inventory, device_plan)
    devices = tuple(d for d in device_plan.devices if (d.major, d.minor) not in target.runtime_devices)
    libraries = _libraries(inventory.libraries, caps, target.libs_dir, skipped)
    if gpus or device_plan.migs:
        _check_required_libraries(inventory, caps, libraries, target.libs_dir)
    libraries32 = (_libraries(inventory.libraries32, caps, target.libs32_dir, skipped, bits="32-bit ")
                   if Capability.COMPAT32 in caps else ())
    mounts = (libraries + libraries32 + _binaries(inventory, caps, skipped) + _firmware(inventory, caps)
              + _ipc(inventory, caps) + _mps_pipe(live, caps) + _configs(inventory, caps))
    mounted = {m.target.rpartition("/")[2] for m in libraries}
    symlinks = tuple(
        Symlink(path=container_path(target.libs_dir, link), target=dest.format(version=inventory.driver_version))
        for link, dest in _DEV_SYMLINKS
        # only when the library the link points at is injected
        if any(name.startswith(dest.split(".so")[0] + ".so.") for name in mounted)
    )
    return Plan(
        gpus=tuple(g.uuid for g in gpus) + tuple(m.uuid for m in device_plan.migs),
        devices=devices,
        mounts=mounts,
        symlinks=symlinks,
        proc_driver=_proc_driver(inventory, device_plan, skipped),
        cgroup_rules=tuple(CgroupRule(major=d.major, minor=d.minor) for d in devices) if target.manage_cgroups else (),
        ldconfig=(Ldconfig(dirs=(target.libs_dir, *((target.libs32_dir,) if libraries32 else ())))
                  if libraries or libraries32 else None),
        cuda_compat=_cuda_compat(inventory, caps, target),
        skipped=tuple(skipped),
        warnings=warnings,
    )


def _node(device: HostDevice) -> DeviceNode:
    """The container node for a host device, same name and numbers."""
    return DeviceNode(path=container_path("dev", device.name), major=device.major, minor=device.minor)


def _gpu_device(inventory: Inventory, gpu: Gpu) -> DeviceNode:
    """/dev/nvidia<minor> for a selected GPU; its absence is a host error."""
    node = inventory.gpu_node(gpu.minor)
    if node is None:
        modprobe = catalog.modprobe_gpu(gpu.minor)
        raise MissingNodeError(f"GPU {gpu.index} ({gpu.uuid}) has no device node nvidia{gpu.minor} under the dev "
                               f"root; create it with `{_modprobe_text(modprobe)}`", modprobe)
    return _node(node)


def _modprobe_text(modprobe: tuple[str, ...]) -> str:
    return " ".join(("nvidia-modprobe", *modprobe))


def _control_devices(
    inventory: Inventory, caps: frozenset[Capability], skipped: list[Skipped]
) -> tuple[DeviceNode, ...]:
    """nvidiactl always; nvidia-uvm(-tools) with compute; nvidia-modeset with display."""
    have = {n.name: n for n in inventory.control_nodes}
    out = []
    for name, needed_by in catalog.CONTROL_NODES.items():
        if needed_by is not None and needed_by not in caps:
            continue
        if name in have:
            out.append(_node(have[name]))
        elif name in catalog.MODPROBE_CONTROL:
            modprobe = catalog.MODPROBE_CONTROL[name]
            why = "every GPU start" if needed_by is None else f"the {needed_by.value} capability"
            raise MissingNodeError(f"/dev/{name}, which {why} needs, is missing under the dev root (its kernel module "
                                   f"is not loaded yet?); create it with `{_modprobe_text(modprobe)}`", modprobe)
        else:
            skipped.append(Skipped(what=f"/dev/{name}", reason="not present on the host"))
    return tuple(out)


def _libraries(
    libraries: tuple[DriverFile, ...], caps: frozenset[Capability], libs_dir: str, skipped: list[Skipped],
    bits: str = "",
) -> tuple[BindMount, ...]:
    """The driver libraries of *caps*, into the container's libs dir."""
    out = []
    for prefix in catalog.library_prefixes(caps):
        found = [f for f in libraries if f.name.startswith(prefix + ".")]
        if not found:
            skipped.append(Skipped(what=f"{bits}{prefix}", reason="not in the driver's libraries"))
        out += [BindMount(source=str(f.host_path), target=container_path(libs_dir, f.name)) for f in found]
    return tuple(out)


def _check_required_libraries(inventory: Inventory, caps: frozenset[Capability], libraries: tuple[BindMount, ...],
                              libs_dir: str) -> None:
    """Refuse GPU nodes without the libraries their capabilities cannot work without (catalog.REQUIRED_LIBRARIES)."""
    names = {m.target.rpartition("/")[2] for m in libraries}
    missing = sorted(p for p in catalog.required_libraries(caps)
                     if not any(n.startswith(p + ".") for n in names))
    if missing:
        wanted = ", ".join(f"{p}.{inventory.driver_version}" for p in missing)
        raise DiscoveryError(
            f"the driver's libraries lack {wanted}, which the capabilities {','.join(sorted(caps))} need "
            f"(NVML reports driver {inventory.driver_version}; a container would get its GPUs without them "
            f"in {libs_dir}): if the driver is being upgraded, retry once the upgrade is done; else reinstall "
            "the driver and run ldconfig"
        )


def _binaries(inventory: Inventory, caps: frozenset[Capability], skipped: list[Skipped]) -> tuple[BindMount, ...]:
    """The driver binaries of *caps*, into /usr/bin."""
    have = {f.name: f for f in inventory.binaries}
    out = []
    for name in catalog.binaries(caps):
        if name in have:
            out.append(BindMount(source=str(have[name].host_path), target=container_path(BIN_DIR, name)))
        else:
            skipped.append(Skipped(what=name, reason="not in the driver's binaries"))
    return tuple(out)


def _firmware(inventory: Inventory, caps: frozenset[Capability]) -> tuple[BindMount, ...]:
    """GSP firmware at its host path, whenever any driver file is injected."""
    if not caps:
        return ()
    return tuple(
        BindMount(source=str(f.host_path), target=container_path(f.name), noexec=True) for f in inventory.firmware
    )


def _configs(inventory: Inventory, caps: frozenset[Capability]) -> tuple[BindMount, ...]:
    """Vulkan/EGL/OpenCL config files for the capabilities (display implies graphics)."""
    wanted = catalog.library_capabilities(caps)
    return tuple(
        BindMount(source=str(f.host_path), target=container_path(f.name), noexec=True)
        for f in inventory.configs
        if catalog.CONFIG_FILES.get(f.name.lstrip("/")) in wanted
    )


def _ipc(inventory: Inventory, caps: frozenset[Capability]) -> tuple[BindMount, ...]:
    """Daemon sockets (persistenced, fabricmanager) for the capability that uses them."""
    return tuple(
        BindMount(source=str(f.host_path), target=container_path(f.name), noexec=True)
        for f in inventory.ipc
        if catalog.IPC_SOCKETS.get(f.name.lstrip("/")) in caps
    )


def _mps_pipe(live: LiveFacts, caps: frozenset[Capability]) -> tuple[BindMount, ...]:
    """The MPS pipe directory for compute, at its path, nosuid, nodev, noexec: the host's read-write, as NVIDIA's
    hook mounts it (libnvidia-container lookup_ipcs; its clients make pipes in it); for a GPU gpuhook shares
    through its own MPS daemon (the one with a /dev/shm of its own), that daemon's client directory, read-only
    (a tenant may connect to the socket in it, but neither replace it nor make one of its own there for the
    other tenants), with the /dev/shm tmpfs the daemon shares with its clients, read-write."""
    if Capability.COMPUTE not in caps:
        return ()
    gpuhooks = live.mps_shm is not None
    return tuple(BindMount(source=str(d.host_path), target=d.name, noexec=True, directory=True,
                           writable=not (gpuhooks and d is live.mps_pipe))
                 for d in (live.mps_pipe, live.mps_shm) if d is not None)


def _proc_driver(inventory: Inventory, device_plan: DevicePlan, skipped: list[Skipped]) -> ProcDriverMount | None:
    """The masked /proc/driver/nvidia, with the selected GPUs' directories and MIG capability files."""
    proc, gpus = inventory.proc_driver, device_plan.gpus
    if proc is None:
        skipped.append(Skipped(what="/proc/driver/nvidia", reason="the host has no /proc/driver/nvidia"))
        return None
    files = tuple((name, _no_device_file_changes(text) if name == "params" else text) for name, text in proc.files)
    gpu_dirs = []
    for gpu in gpus:
        name = _proc_gpu_dir(gpu.pci_bus_id, proc.gpu_dirs)
        if name is None:
            skipped.append(Skipped(what=f"/proc/driver/nvidia/gpus for {gpu.uuid}", reason="not on the host"))
        else:
            gpu_dirs.append((f"{proc.host_dir}/gpus/{name}", name))
    caps = [cap for mig in device_plan.migs for cap in mig_cap_names(inventory.gpus[mig.parent_index], mig)]
    cap_files = tuple((f"{proc.host_dir}/{_cap_proc_file(cap)}", _cap_proc_file(cap)) for cap in caps)
    return ProcDriverMount(target="/proc/driver/nvidia", files=files, gpu_dirs=tuple(gpu_dirs), cap_files=cap_files)


def _cuda_compat(inventory: Inventory, caps: frozenset[Capability], target: Target) -> CudaCompat | None:
    """Check /usr/local/cuda/compat when libcuda is injected (compute, or video which implies it)."""
    if not target.cuda_compat or Capability.COMPUTE not in catalog.library_capabilities(caps):
        return None
    major = inventory.driver_version.split(".")[0]
    return CudaCompat(directory=CUDA_COMPAT_DIR, host_major=int(major)) if major.isdigit() else None


def _no_device_file_changes(params: str) -> str:
    """params with ModifyDeviceFiles: 0, so NVML in the container never mknods."""
    return re.sub(r"(?m)^ModifyDeviceFiles: *1$", "ModifyDeviceFiles: 0", params)


def _proc_gpu_dir(bus_id: str, names: tuple[str, ...]) -> str | None:
    """The gpus/ dir name for an NVML bus id: 32-bit domain form first, then 16-bit (as NVIDIA)."""
    lowered = bus_id.lower()
    short = lowered[4:] if len(lowered.split(":")[0]) == 8 else lowered
    return next((n for n in (lowered, short) if n in names), None)
