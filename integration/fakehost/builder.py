"""Builds a simulated NVIDIA GPU host in a directory (see create_host)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import mig as migs
from . import native, texts
from .mig import FakeMigDevice
from .models import (
    FakeGpu,
    encode_cuda_version,
    lookup_model,
    make_gpus,
    render_topology,
    validate_driver_version,
    validate_model_name,
)

DEFAULT_DRIVER = "550.54.15"
DEFAULT_CUDA = "12.4"
DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"

# Inert stand-ins; nvidia-cuda-mps-control is a real program (native.build_mps_control, mpscontrol.c).
_TOOLS = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
# sun_path holds 108 bytes; longer socket paths are bound via /proc/self/fd.
_SUN_PATH_MAX = 107

IMEX_CHANNELS = (0, 1, 2, 3)
# Nodes of the other drivers a DGX-class host loads (NVSwitch, GPUDirect
# Storage, GDRCopy, RDMA), which gpuhook hands out only on request:
# (path relative to dev, major, minor).
GATED_NODES: tuple[tuple[str, int, int], ...] = (
    ("nvidia-nvswitchctl", texts.NVSWITCH_MAJOR, 255),
    ("nvidia-nvswitch0", texts.NVSWITCH_MAJOR, 0),
    ("nvidia-nvswitch1", texts.NVSWITCH_MAJOR, 1),
    ("nvidia-fs0", texts.NVIDIA_FS_MAJOR, 0),
    ("nvidia-fs1", texts.NVIDIA_FS_MAJOR, 1),
    ("gdrdrv", texts.GDRDRV_MAJOR, 0),
    ("infiniband/uverbs0", texts.INFINIBAND_MAJOR, 192),
    ("infiniband/rdma_cm", texts.MISC_MAJOR, 58),
)
# The loader manifests and data files the driver installs for graphics,
# relative to root.
GRAPHICS_FILES = (
    "usr/share/vulkan/icd.d/nvidia_icd.json",
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
    "etc/OpenCL/vendors/nvidia.icd",
    "usr/share/nvidia/nvoptix.bin",
)


class FakeHostError(Exception):
    """The simulated host cannot be built as asked."""


@dataclass(frozen=True, slots=True)
class FakeHost:
    """A built simulated GPU host; paths are absolute."""

    root: Path
    config_path: Path
    driver_version: str
    cuda_version: str
    model: str
    gpus: tuple[FakeGpu, ...]
    uvm_major: int
    caps_major: int
    nvidia_major: int
    # MIG devices in GPU order, then creation order (empty without MIG).
    mig_devices: tuple[FakeMigDevice, ...] = ()
    imex_major: int = texts.IMEX_MAJOR
    imex_channels: tuple[int, ...] = IMEX_CHANNELS
    gated_nodes: tuple[tuple[str, int, int], ...] = GATED_NODES
    nvswitch_major: int = texts.NVSWITCH_MAJOR
    nvidia_fs_major: int = texts.NVIDIA_FS_MAJOR
    gdrdrv_major: int = texts.GDRDRV_MAJOR
    #: GPU index → problems: "retired-pages", "row-remap-pending", "row-remap-failure" (NVML) and
    #: "xid:<n>" (an NVRM Xid line in dev/kmsg, as the kernel log shows it)
    unhealthy: tuple[tuple[int, tuple[str, ...]], ...] = ()
    #: Nodes (relative to dev) the build left out, as after a boot before anything loaded their module;
    #: /proc/devices still lists the module, so usr/bin/nvidia-modprobe can make them.
    missing_nodes: tuple[str, ...] = ()

    @property
    def modprobe_path(self) -> Path:
        """The nvidia-modprobe stand-in (modprobe.c), which makes nodes under root/dev."""
        return self.root / native.NVIDIA_MODPROBE

    @property
    def modprobe_log_path(self) -> Path:
        """Where the nvidia-modprobe stand-in appends each call's argv (tab-separated)."""
        return self.root / "etc" / "mock-nvml" / "modprobe.log"

    def modprobe_calls(self) -> list[tuple[str, ...]]:
        """The argv (argv[0] included) of each nvidia-modprobe call so far, in order."""
        return [tuple(line.split("\t")) for line in self.modprobe_log_path.read_text().splitlines()]

    def break_modprobe(self, message: str = "FATAL: Module nvidia-uvm not found (simulated failure)") -> None:
        """Makes every later nvidia-modprobe call fail: exit 1, *message* on stderr (the call is still logged)."""
        if not message or "\n" in message:
            raise FakeHostError(f"break_modprobe: the message must be one non-empty line, got {message!r}")
        _write(self.root / "etc" / "mock-nvml" / "modprobe-broken", message + "\n")

    def repair_modprobe(self) -> None:
        """Undoes break_modprobe."""
        (self.root / "etc" / "mock-nvml" / "modprobe-broken").unlink(missing_ok=True)

    def write_config(self, path: Path, *, state_dir: Path, gpus: Sequence[Mapping[str, Any]] = ()) -> Path:
        """This host's gpuhook config at *path* with a lease ledger of its own in *state_dir* and the
        per-GPU sharing policy *gpus* (a ``gpus:`` list; none: every GPU unlimited)."""
        kept = [line for line in self.config_path.read_text().splitlines() if not line.startswith("state_dir:")]
        policy = [f"gpus: {json.dumps([dict(entry) for entry in gpus])}"] if gpus else []  # JSON is YAML too
        path.write_text("\n".join([*kept, f"state_dir: {json.dumps(str(state_dir))}", *policy]) + "\n")
        return path

    @property
    def mig_enabled(self) -> bool:
        """Whether any GPU is in MIG mode (and so the MIG caps exist)."""
        return any(gpu.mig_enabled for gpu in self.gpus)

    @property
    def mig_minors_path(self) -> Path:
        """/proc/driver/nvidia-caps/mig-minors (present on a MIG host)."""
        return self.root / "proc" / "driver" / "nvidia-caps" / "mig-minors"

    @property
    def capabilities_dir(self) -> Path:
        """/proc/driver/nvidia/capabilities."""
        return self.root / "proc" / "driver" / "nvidia" / "capabilities"

    @property
    def cuda_driver_version(self) -> int:
        """The CUDA version as NVML reports it (12.4 -> 12040)."""
        return encode_cuda_version(self.cuda_version)

    @property
    def lib_dir(self) -> Path:
        """Where the driver libraries live."""
        return self.root / native.LIB_DIR

    @property
    def nvml_library(self) -> Path:
        """The versioned mock NVML, e.g. .../libnvidia-ml.so.550.54.15."""
        return self.lib_dir / native.NVML_LIBRARY.file_name(self.driver_version)

    @property
    def ld_cache(self) -> Path:
        """The host's ld.so.cache (paths in it are relative to root)."""
        return self.root / "etc" / "ld.so.cache"

    @property
    def topology_path(self) -> Path:
        """The file the mock NVML answers from."""
        return self.root / "etc" / "mock-nvml" / "topology"

    @property
    def calls_log_path(self) -> Path:
        """Where the mock NVML appends '<pid> <calls>' lines."""
        return self.root / "etc" / "mock-nvml" / "calls.log"

    def nvml_calls(self) -> list[tuple[int, int]]:
        """The (pid, calls) lines logged so far; empty means no NVML call was made."""
        lines = self.calls_log_path.read_text().split()
        return [(int(pid), int(count)) for pid, count in zip(lines[0::2], lines[1::2], strict=True)]

    def set_gpu_processes(
        self,
        entries: Iterable[tuple[int, int, int | None] | tuple[int, int, int | None, int, int]],
        *,
        graphics: Iterable[tuple[int, int, int | None]] = (),
    ) -> None:
        """Sets the processes the mock NVML lists as running on the GPUs, for every process at once.

        *entries* are compute processes (nvmlDeviceGetComputeRunningProcesses): ``(gpu index, pid,
        used bytes)``, or ``(gpu index, pid, used bytes, gi, ci)`` on a MIG device of a GPU in MIG
        mode; *graphics* are ``(gpu index, pid, used bytes)`` graphics processes
        (nvmlDeviceGetGraphicsRunningProcesses; none in MIG mode).  Used bytes None is reported as
        NVML_VALUE_NOT_AVAILABLE.  pids are this machine's: the mock leaves out those no longer
        running.  Writes etc/mock-nvml/processes (see mocknvml.c) by rename, so readers see the old
        list or the new one; an empty call clears it.
        """
        lines = []
        for kind, rows in (("", entries), ("graphics ", graphics)):
            for row in rows:
                gpu, pid, used, *ids = row
                if not 0 <= gpu < len(self.gpus):
                    raise FakeHostError(f"GPU {gpu} does not exist (the host has {len(self.gpus)})")
                if not 0 < pid <= 2**31 - 1 or (used is not None and not 0 <= used < 2**64 - 1):
                    raise FakeHostError(f"bad pid or used bytes in {row!r}")
                mig_mode = self.gpus[gpu].mig_enabled
                if kind and mig_mode:
                    raise FakeHostError(f"GPU {gpu} is in MIG mode, which has no graphics processes")
                if not kind and mig_mode != bool(ids):
                    raise FakeHostError(f"{row!r}: a process on a GPU in MIG mode names its gi and ci, and only there")
                if ids and (len(ids) != 2 or not 0 <= ids[0] <= 14 or not 0 <= ids[1] <= 7):
                    raise FakeHostError(f"{row!r}: gi must be 0-14 and ci 0-7")
                fields = [gpu, pid, "-" if used is None else used, *ids]
                lines.append(kind + " ".join(str(field) for field in fields) + "\n")
        path = self.root / "etc" / "mock-nvml" / "processes"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".processes.")
        try:
            with os.fdopen(fd, "w") as file:
                file.write("".join(lines))
            os.chmod(tmp, 0o644)  # every process reads it
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _write(path: Path, content: str | bytes, mode: int = 0o644) -> None:
    """Writes a file (creating parents) with an exact mode, umask notwithstanding."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    path.chmod(mode)


def _mknod(path: Path, major: int, minor: int, mode: int = 0o666) -> None:
    """Creates a character device node, 0666 unless told, as the NVIDIA driver does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o755)  # /dev and its subdirectories, umask notwithstanding
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    path.chmod(mode)


def _make_socket(path: Path) -> None:
    """Leaves a unix socket inode at path, like a running nvidia-persistenced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            sock.bind(str(path))
            return
        # Deep temporary directories overflow sun_path; naming the parent
        # through a short /proc/self/fd link avoids a process-wide chdir.
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
        finally:
            os.close(dir_fd)


def _prepare_root(root: Path) -> bool:
    """Checks root is absent or an empty directory; returns whether it existed."""
    if not root.exists():
        root.mkdir(parents=True)
        return False
    if not root.is_dir():
        raise FakeHostError(f"{root} exists and is not a directory")
    if any(root.iterdir()):
        raise FakeHostError(
            f"{root} is not empty; a simulated GPU host is only created in a new or empty directory"
        )
    return True


def _discard(root: Path, existed: bool) -> None:
    """Removes what a failed build left, keeping a directory the caller made."""
    if not existed:
        shutil.rmtree(root, ignore_errors=True)
        return
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink()


def _topology(host: FakeHost) -> str:
    """The mock NVML's topology: the file on the host, built into the library for the driver's view."""
    topology = render_topology(host.driver_version, host.cuda_version, host.gpus, host.mig_devices)
    for index, problems in host.unhealthy:
        flags = [int(kind in problems) for kind in ("retired-pages", "row-remap-pending", "row-remap-failure")]
        topology += f"health {index} {flags[0]} {flags[1]} {flags[2]}\n"
    return topology


def _write_driver_files(host: FakeHost, topology: str) -> None:
    """Tools, firmware and the mock NVML's topology and call logs."""
    root, driver = host.root, host.driver_version
    for tool in _TOOLS:
        _write(root / "usr/bin" / tool, texts.tool_script(tool, driver), 0o755)
    for firmware in _FIRMWARE:
        _write(
            root / "lib/firmware/nvidia" / driver / firmware, f"simulated GSP firmware {firmware} {driver}\n"
        )
    _write(host.topology_path, topology)
    # The kernel log as /dev/kmsg hands it out ("prio,seq,usec,flags;message"), with the driver's Xid lines.
    records = ["6,1,1000,-;Linux version 6.18.44 (simulated)"]
    for index, problems in host.unhealthy:
        bus = host.gpus[index].pci_bus_id[4:-2].lower()  # NVRM prints PCI:0000:18:00
        records += [f"3,{len(records) + 1},2000,-;NVRM: Xid (PCI:{bus}): {p[4:]}, pid=1234, name=python, "
                    "Ch 00000008" for p in problems if p.startswith("xid:")]
    _write(root / "dev/kmsg", "".join(r + "\n" for r in records))
    # World-writable so that unprivileged processes under test can log too.
    _write(host.calls_log_path, "", 0o666)
    _write(host.modprobe_log_path, "")


def _driver_nodes(host: FakeHost) -> list[tuple[str, int, int]]:
    """The nodes the NVIDIA modules make, relative to dev: (name, major, minor)."""
    return [
        *((f"nvidia{gpu.minor}", host.nvidia_major, gpu.minor) for gpu in host.gpus),
        ("nvidiactl", host.nvidia_major, texts.NVIDIACTL_MINOR),
        ("nvidia-modeset", host.nvidia_major, texts.MODESET_MINOR),
        ("nvidia-uvm", host.uvm_major, 0),
        ("nvidia-uvm-tools", host.uvm_major, 1),
    ]


def _write_devices(host: FakeHost) -> None:
    """The /dev nodes the driver creates (ModifyDeviceFiles: 1), less the missing ones."""
    dev = host.root / "dev"
    dev.mkdir(mode=0o755, exist_ok=True)
    for name, major, minor in _driver_nodes(host):
        if name not in host.missing_nodes:
            _mknod(dev / name, major, minor)
    for channel in host.imex_channels:
        _mknod(dev / "nvidia-caps-imex-channels" / f"channel{channel}", host.imex_major, channel)
    for name, major, minor in host.gated_nodes:
        _mknod(dev / name, major, minor)
    if host.mig_enabled:
        # What nvidia-modprobe -f makes from the capability files: their
        # DeviceFileMode is the node's mode.
        caps = dev / "nvidia-caps"
        _mknod(caps / f"nvidia-cap{migs.CONFIG_MINOR}", host.caps_major, migs.CONFIG_MINOR, migs.CONFIG_MODE)
        _mknod(caps / f"nvidia-cap{migs.MONITOR_MINOR}", host.caps_major, migs.MONITOR_MINOR, migs.ACCESS_MODE)
        for device in host.mig_devices:
            for minor in (device.gi_cap_minor, device.ci_cap_minor):
                _mknod(caps / f"nvidia-cap{minor}", host.caps_major, minor, migs.ACCESS_MODE)


def _write_procfs(host: FakeHost) -> None:
    """The procfs files the kernel and the NVIDIA module expose."""
    proc = host.root / "proc"
    nvidia = proc / "driver" / "nvidia"
    _write(proc / "devices", texts.proc_devices(), 0o444)
    _write(nvidia / "version", texts.proc_version(host.driver_version), 0o444)
    _write(nvidia / "params", texts.proc_params(), 0o444)
    _write(nvidia / "registry", texts.proc_registry(), 0o444)
    for gpu in host.gpus:
        info = texts.proc_gpu_information(gpu, host.driver_version)
        _write(nvidia / "gpus" / gpu.proc_bus_id / "information", info, 0o444)
    host.capabilities_dir.mkdir(parents=True)
    if host.mig_enabled:
        _write_mig_procfs(host)


def _write_mig_procfs(host: FakeHost) -> None:
    """The MIG capability minors and the capability files of the instances that exist.

    A capability file's mode is the access it grants, as the driver makes it.
    """
    _write(host.mig_minors_path, migs.mig_minors(len(host.gpus)), 0o444)
    caps = host.capabilities_dir
    _write(caps / "mig/config", migs.capability_file(migs.CONFIG_MINOR, migs.CONFIG_MODE), migs.CONFIG_MODE)
    _write(caps / "mig/monitor", migs.capability_file(migs.MONITOR_MINOR, migs.ACCESS_MODE), migs.ACCESS_MODE)
    for device in host.mig_devices:
        for path, minor in ((device.gi_proc_path, device.gi_cap_minor), (device.ci_proc_path, device.ci_cap_minor)):
            _write(caps / path, migs.capability_file(minor, migs.ACCESS_MODE), migs.ACCESS_MODE)


def _write_graphics_files(host: FakeHost) -> None:
    """Vulkan, EGL and OpenCL loader manifests, and OptiX's data file."""
    vulkan, egl, gbm, opencl, optix = (host.root / path for path in GRAPHICS_FILES)
    _write(vulkan, texts.vulkan_icd())
    _write(egl, texts.egl_vendor())
    _write(gbm, texts.egl_gbm_platform())
    _write(opencl, texts.opencl_icd())
    _write(optix, texts.nvoptix_bin(host.driver_version))


def _build_tools(host: FakeHost) -> None:
    """The driver's programs: the MPS control daemon, nvidia-modprobe and nvidia-smi stand-ins."""
    native.build_mps_control(host.root / native.MPS_CONTROL)
    native.build_modprobe(host.modprobe_path, host.driver_version)
    native.build_nvidia_smi(host.root / native.NVIDIA_SMI)


def _build(host: FakeHost) -> None:
    """Lays out every part of the host under host.root."""
    topology = _topology(host)
    # The static links of the tools (~0.3 s each) run beside the library builds.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tools = pool.submit(_build_tools, host)
        mig_minors = migs.mig_minors(len(host.gpus)) if host.mig_enabled else ""
        native.build_libraries(host.root, host.driver_version, topology, mig_minors)
        tools.result()
    native.run_ldconfig(host.root)
    _write_driver_files(host, topology)
    _write_devices(host)
    _write_procfs(host)
    _write_graphics_files(host)
    _make_socket(host.root / "run" / "nvidia-persistenced" / "socket")
    # Debian's /var/run -> /run, relative so that it resolves inside the host root from anywhere.
    (host.root / "var").mkdir(mode=0o755)
    (host.root / "var" / "run").symlink_to("../run")
    _write(host.config_path, texts.gpuhook_config(host.root))


_HEALTH_KINDS = ("retired-pages", "row-remap-pending", "row-remap-failure")


def _check_unhealthy(unhealthy: Mapping[int, Sequence[str]], gpus: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """Validate the unhealthy GPUs' problem names."""
    out = []
    for index, problems in sorted(unhealthy.items()):
        if not 0 <= index < gpus:
            raise FakeHostError(f"unhealthy GPU {index} does not exist (the host has {gpus})")
        for problem in problems:
            if problem not in _HEALTH_KINDS and not (problem.startswith("xid:") and problem[4:].isdigit()):
                raise FakeHostError(f"unknown GPU problem {problem!r}; expected {', '.join(_HEALTH_KINDS)} or xid:<n>")
        out.append((index, tuple(problems)))
    return tuple(out)


def create_host(
    dir: Path,
    *,
    gpus: int,
    driver: str = DEFAULT_DRIVER,
    cuda: str = DEFAULT_CUDA,
    model: str = DEFAULT_MODEL,
    mig: Mapping[int, Sequence[str] | str] | None = None,
    unhealthy: Mapping[int, Sequence[str]] | None = None,
    missing_nodes: Sequence[str] = (),
) -> FakeHost:
    """Builds a simulated GPU host in dir, which must be new or empty.

    mig puts GPUs in MIG mode with GPU instances of the given profiles, in
    creation order: {0: ("1g.10gb", "1g.10gb")}; an empty list leaves MIG on
    with no instances; a string is read as comma-separated profiles.
    missing_nodes leaves driver nodes out of dev, e.g. ("nvidia-uvm", "nvidia-uvm-tools") as
    after a boot; their modules stay in /proc/devices, so usr/bin/nvidia-modprobe makes them.
    """
    try:
        validate_driver_version(driver)
        encode_cuda_version(cuda)
        validate_model_name(model)
        devices = make_gpus(gpus, driver, lookup_model(model))
        layouts = migs.normalise_layouts(mig)
        mig_devices = migs.make_mig_devices(devices, layouts, driver)
        devices = tuple(replace(gpu, mig_enabled=True) if gpu.index in layouts else gpu for gpu in devices)
    except ValueError as error:
        raise FakeHostError(str(error)) from error
    if os.geteuid() != 0:
        # mknod needs CAP_MKNOD and ldconfig -r needs chroot.
        raise FakeHostError("building a simulated GPU host needs root (device nodes, ldconfig -r)")
    root = Path(dir).resolve()
    host = FakeHost(
        root=root,
        config_path=root / "gpuhook.yaml",
        driver_version=driver,
        cuda_version=cuda,
        model=model,
        gpus=devices,
        uvm_major=texts.UVM_MAJOR,
        caps_major=texts.CAPS_MAJOR,
        nvidia_major=texts.NVIDIA_MAJOR,
        mig_devices=mig_devices,
        unhealthy=_check_unhealthy(unhealthy or {}, gpus),
        missing_nodes=tuple(missing_nodes),
    )
    known = [name for name, _, _ in _driver_nodes(host)]
    unknown = sorted(set(missing_nodes) - set(known))
    if unknown:
        raise FakeHostError(f"missing_nodes: {', '.join(unknown)} is not a driver node; expected some of "
                            f"{', '.join(known)}")
    existed = _prepare_root(root)
    try:
        _build(host)
    except BaseException:
        _discard(root, existed)
        raise
    return host
