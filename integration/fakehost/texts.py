"""Text contents of the simulated host: procfs files, tool scripts, config (nvidia-smi is nvidiasmi.c)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .models import FakeGpu

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
MODESET_MINOR = 254
# Dynamic majors are handed out downwards from 511; NVIDIA's modules load
# late, so on real hosts they usually get the highest ones.
UVM_MAJOR = 511
CAPS_MAJOR = 510
IMEX_MAJOR = 509
NVSWITCH_MAJOR = 508
NVIDIA_FS_MAJOR = 507
GDRDRV_MAJOR = 506
# Fixed majors: the InfiniBand verbs/MAD region and the misc class (rdma_cm).
INFINIBAND_MAJOR = 231
MISC_MAJOR = 10

# A plausible kernel-module build stamp; nothing parses it.
_BUILD_DATE = "Tue Mar  5 22:23:56 UTC 2024"
_GCC = "gcc version 12.2.0 (Debian 12.2.0-14) "

_CHAR_DEVICES = (
    (1, "mem"),
    (4, "/dev/vc/0"),
    (4, "tty"),
    (4, "ttyS"),
    (5, "/dev/tty"),
    (5, "/dev/console"),
    (5, "/dev/ptmx"),
    (7, "vcs"),
    (MISC_MAJOR, "misc"),
    (13, "input"),
    (29, "fb"),
    (128, "ptm"),
    (136, "pts"),
    (180, "usb"),
    (189, "usb_device"),
    (NVIDIA_MAJOR, "nvidia-frontend"),
    (202, "cpu/msr"),
    (203, "cpu/cpuid"),
    (226, "drm"),
    (INFINIBAND_MAJOR, "infiniband_mad"),
    (INFINIBAND_MAJOR, "infiniband_verbs"),
    (238, "aux"),
    (240, "infiniband_verbs"),
    (241, "nvme-generic"),
    (242, "nvme"),
    (243, "hidraw"),
    (244, "ipmidev"),
    (245, "bsg"),
    (246, "watchdog"),
    (247, "ptp"),
    (248, "pps"),
    (249, "rtc"),
    (250, "dax"),
    (251, "tpm"),
    (252, "gpiochip"),
    (GDRDRV_MAJOR, "gdrdrv"),
    (NVIDIA_FS_MAJOR, "nvidia-fs"),
    (NVSWITCH_MAJOR, "nvidia-nvswitch"),
    (IMEX_MAJOR, "nvidia-caps-imex-channels"),
    (CAPS_MAJOR, "nvidia-caps"),
    (UVM_MAJOR, "nvidia-uvm"),
)

_BLOCK_DEVICES = (
    (7, "loop"),
    (8, "sd"),
    (9, "md"),
    (11, "sr"),
    (65, "sd"),
    (66, "sd"),
    (128, "sd"),
    (253, "device-mapper"),
    (254, "mdp"),
    (259, "blkext"),
)

# A 550-series /proc/driver/nvidia/params; ModifyDeviceFiles: 1 says the
# driver (not an admin) owns the /dev/nvidia* nodes.
_PARAMS = (
    ("ResmanDebugLevel", "4294967295"),
    ("RmLogonRC", "1"),
    ("ModifyDeviceFiles", "1"),
    ("DeviceFileUID", "0"),
    ("DeviceFileGID", "0"),
    ("DeviceFileMode", "438"),
    ("InitializeSystemMemoryAllocations", "1"),
    ("UsePageAttributeTable", "4294967295"),
    ("EnableMSI", "1"),
    ("EnablePCIeGen3", "0"),
    ("MemoryPoolSize", "0"),
    ("KMallocHeapMaxSize", "0"),
    ("VMallocHeapMaxSize", "0"),
    ("IgnoreMMIOCheck", "0"),
    ("TCEBypassMode", "0"),
    ("EnableStreamMemOPs", "0"),
    ("EnableUserNUMAManagement", "1"),
    ("NvLinkDisable", "0"),
    ("RmProfilingAdminOnly", "1"),
    ("PreserveVideoMemoryAllocations", "0"),
    ("EnableS0ixPowerManagement", "0"),
    ("S0ixPowerManagementVideoMemoryThreshold", "256"),
    ("DynamicPowerManagement", "3"),
    ("DynamicPowerManagementVideoMemoryThreshold", "200"),
    ("RegisterPCIDriver", "1"),
    ("EnablePCIERelaxedOrderingMode", "0"),
    ("EnableResizableBar", "0"),
    ("EnableGpuFirmware", "18"),
    ("EnableGpuFirmwareLogs", "2"),
    ("RmNvlinkBandwidthLinkCount", "0"),
    ("EnableDbgBreakpoint", "0"),
    ("OpenRmEnableUnsupportedGpus", "1"),
    ("DmaRemapPeerMmio", "1"),
    ("RegistryDwords", '""'),
    ("RegistryDwordsPerDevice", '""'),
    ("RmMsg", '""'),
    ("GpuBlacklist", '""'),
    ("TemporaryFilePath", '""'),
    ("ExcludedGpus", '""'),
)


def proc_devices() -> str:
    """/proc/devices, formatted as fs/proc/devices.c does ("%3d %s")."""
    chars = "".join(f"{major:3d} {name}\n" for major, name in _CHAR_DEVICES)
    blocks = "".join(f"{major:3d} {name}\n" for major, name in _BLOCK_DEVICES)
    return f"Character devices:\n{chars}\nBlock devices:\n{blocks}"


def proc_version(driver: str) -> str:
    """/proc/driver/nvidia/version (nv-procfs.c: nv_procfs_read_version)."""
    return f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  {_BUILD_DATE}\nGCC version:  {_GCC}\n"


def proc_params() -> str:
    """/proc/driver/nvidia/params."""
    return "".join(f"{key}: {value}\n" for key, value in _PARAMS)


def proc_registry() -> str:
    """/proc/driver/nvidia/registry with no registry keys set."""
    return 'Binary: ""\n'


def proc_gpu_information(gpu: FakeGpu, driver: str) -> str:
    """/proc/driver/nvidia/gpus/<bus>/information (nv-procfs.c: nv_procfs_read_gpu_info)."""
    return (
        f"Model: \t\t {gpu.name}\n"
        f"IRQ:   \t\t {gpu.index + 16}\n"
        f"GPU UUID: \t {gpu.uuid}\n"
        f"Video BIOS: \t {gpu.vbios.lower()}\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {gpu.proc_bus_id}\n"
        f"Device Minor: \t {gpu.minor}\n"
        f"GPU Firmware: \t {driver}\n"
        "GPU Excluded:\t No\n"
    )


def tool_script(name: str, driver: str) -> str:
    """A stand-in for one of the driver's other tools: reports itself, succeeds."""
    return (
        "#!/bin/sh\n"
        f"# {name} stand-in on a gpuhook simulated GPU host (there is no GPU).\n"
        'if [ "$1" = "--version" ] || [ "$1" = "-v" ]; then\n'
        f"  echo '{name}: version {driver}'\n"
        "  exit 0\n"
        "fi\n"
        f"echo '{name}: simulated GPU host, driver {driver}; nothing to do' >&2\n"
        "exit 0\n"
    )


# What the driver installs for the Vulkan, EGL and OpenCL loaders to find it.
def vulkan_icd() -> str:
    """/usr/share/vulkan/icd.d/nvidia_icd.json (550 series: Vulkan 1.3.277)."""
    return _loader_json({"library_path": "libGLX_nvidia.so.0", "api_version": "1.3.277"})


def egl_vendor() -> str:
    """/usr/share/glvnd/egl_vendor.d/10_nvidia.json: libglvnd's EGL vendor entry."""
    return _loader_json({"library_path": "libEGL_nvidia.so.0"})


def egl_gbm_platform() -> str:
    """/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json: the GBM external platform."""
    return _loader_json({"library_path": "libnvidia-egl-gbm.so.1"})


def opencl_icd() -> str:
    """/etc/OpenCL/vendors/nvidia.icd: the one library the OpenCL ICD loader opens."""
    return "libnvidia-opencl.so.1\n"


def nvoptix_bin(driver: str) -> bytes:
    """A stand-in for /usr/share/nvidia/nvoptix.bin (OptiX's precompiled data)."""
    return b"NVOPTIX\0" + f"simulated nvoptix.bin {driver}\n".encode()


def _loader_json(icd: dict[str, str]) -> str:
    """A loader manifest laid out as NVIDIA's installer writes them."""
    fields = ",\n".join(f"        {json.dumps(key)} : {json.dumps(value)}" for key, value in icd.items())
    return f'{{\n    "file_format_version" : "1.0.0",\n    "ICD" : {{\n{fields}\n    }}\n}}\n'


def _yaml_scalar(text: str) -> str:
    """A YAML scalar: plain when unambiguous, else a JSON (= YAML) string."""
    if re.fullmatch(r"/[A-Za-z0-9_./+@-]*", text):
        return text
    return json.dumps(text)


def gpuhook_config(root: Path) -> str:
    """The gpuhook config that points every root at the simulated host."""
    value = _yaml_scalar(str(root))
    log = _yaml_scalar(str(root / "gpuhook.log"))
    # The host's own /run, so that tests and demos never touch the real /run/gpuhook.
    cache = _yaml_scalar(str(root / "run" / "gpuhook"))
    return (
        f"# gpuhook config for the simulated GPU host in {value}\n"
        f"driver_root: {value}\n"
        f"dev_root: {value}\n"
        f"proc_root: {value}\n"
        f"log_file: {log}\n"
        "log_level: debug\n"
        f"cache_dir: {cache}\n"
        f"state_dir: {cache}\n"
    )
