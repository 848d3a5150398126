"""Tests of the simulated GPU host (integration/fakehost): layout, mock NVML, CLI.

Building a host needs root (device nodes, ldconfig -r) and gcc.  Every NVML
scenario runs in its own Python process: pynvml keeps module-level state, and
the mock NVML logs per process, so each scenario must start fresh.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from integration.fakehost import DRIVER_LIBRARIES, FakeHost, FakeHostError, create_host, mig, models, native

REPO = Path(__file__).resolve().parents[2]
GPUS = 4
H100_PCI_DEVICE_ID = 0x233010DE  # device 0x2330, vendor 0x10de (NVIDIA)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHost]:
    """One default 4-GPU host, shared: building is the slow part."""
    yield create_host(tmp_path_factory.mktemp("fakehost") / "host", gpus=GPUS)


# ---- helpers -------------------------------------------------------------

# Prepended to every NVML scenario.  `nvml`/`raw` count the C calls the
# scenario makes so the mock's own count (calls.log) can be checked against it.
_PRELUDE = '''
import ctypes, json, os, sys
import pynvml

pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
made = 0
out = {}

def nvml(fn, *args):
    """Calls one pynvml wrapper (each makes exactly one C call)."""
    global made
    made += 1
    return fn(*args)

def code(fn, *args):
    """The NVML error code that calling fn returns (0 for success)."""
    try:
        nvml(fn, *args)
    except pynvml.NVMLError as error:
        return error.value
    return 0

def text(value):
    """pynvml structures hand char arrays back as str or bytes, by version."""
    return value.decode() if isinstance(value, bytes) else value

def raw(name, *args):
    """Calls an NVML symbol directly through ctypes; returns its nvmlReturn_t."""
    global made
    made += 1
    return getattr(pynvml.nvmlLib, name)(*args)
'''


def run_nvml(lib: Path, body: str) -> dict[str, Any]:
    """Runs an NVML scenario in a fresh interpreter; returns its `out` plus pid and call count."""
    script = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(dict(out, pid=os.getpid(), made=made)))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(lib)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def logged_calls(host: FakeHost, pid: int) -> list[int]:
    """The call counts calls.log holds for one process."""
    return [count for logged_pid, count in host.nvml_calls() if logged_pid == pid]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs `python -m integration.fakehost` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "integration.fakehost", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def readelf_soname(path: Path) -> str:
    """The SONAME recorded in an ELF file's dynamic section."""
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    match = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", dynamic)
    assert match, dynamic
    return match.group(1)


def info_fields(text: str) -> dict[str, str]:
    """Parses a /proc/driver/nvidia/gpus/*/information file the way its readers do."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


# ---- layout ----------------------------------------------------------------


def test_driver_libraries_are_x86_64_elf_with_realistic_sonames(host: FakeHost) -> None:
    """Every library exists under its versioned name and carries its real SONAME."""
    driver = host.driver_version
    assert len(DRIVER_LIBRARIES) == 28
    for lib in DRIVER_LIBRARIES:
        path = host.lib_dir / f"{lib.base}.so.{driver}"
        header = path.read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and header[4] == 2, path  # ELF, 64-bit
        assert int.from_bytes(header[18:20], "little") == 62, path  # EM_X86_64
        assert readelf_soname(path) == lib.soname(driver)
    sonames = {lib.base: lib.soname(driver) for lib in DRIVER_LIBRARIES}
    assert sonames["libcuda"] == "libcuda.so.1"
    assert sonames["libnvidia-ml"] == "libnvidia-ml.so.1"
    assert sonames["libnvidia-nvvm"] == "libnvidia-nvvm.so.4"
    assert sonames["libGLX_nvidia"] == "libGLX_nvidia.so.0"
    assert sonames["libnvidia-glcore"] == f"libnvidia-glcore.so.{driver}"


def test_placeholder_libraries_load_and_name_themselves(host: FakeHost) -> None:
    """Each placeholder loads (dlopen) and its one function names the library it stands for."""
    for lib in DRIVER_LIBRARIES:
        if lib.base == "libnvidia-ml":
            continue  # the mock NVML is exercised in subprocesses below
        handle = ctypes.CDLL(str(host.lib_dir / lib.file_name(host.driver_version)))
        marker = getattr(handle, lib.marker_symbol)
        marker.restype = ctypes.c_char_p
        assert marker().decode() == f"{host.driver_version} {lib.soname(host.driver_version)}"


def test_ld_so_cache_maps_every_soname(host: FakeHost) -> None:
    """The host's own ld.so.cache resolves each SONAME to a root-relative path."""
    assert (host.root / "etc/ld.so.conf").read_text() == "/usr/lib/x86_64-linux-gnu\n/usr/lib/i386-linux-gnu\n"
    listing = subprocess.run(
        ["/sbin/ldconfig", "-p", "-C", str(host.ld_cache)], capture_output=True, text=True, check=True
    ).stdout
    cached = dict(re.findall(r"^\s+(\S+) \(libc6,x86-64\) => (\S+)$", listing, re.MULTILINE))
    for lib in DRIVER_LIBRARIES:
        soname = lib.soname(host.driver_version)
        assert cached.get(soname) == f"/usr/lib/x86_64-linux-gnu/{soname}", listing
    assert cached["libcuda.so.1"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    # The 32-bit copies are filed as i386 libc6 (plain "libc6", no arch tag), as NVIDIA's really are.
    cached32 = dict(re.findall(r"^\s+(\S+) \(libc6\) => (\S+)$", listing, re.MULTILINE))
    assert cached32["libcuda.so.1"] == "/usr/lib/i386-linux-gnu/libcuda.so.1"
    # ldconfig also made the SONAME links, pointing at the versioned files.
    assert os.readlink(host.lib_dir / "libcuda.so.1") == f"libcuda.so.{host.driver_version}"
    assert os.readlink(host.lib_dir / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{host.driver_version}"


def char_devices(dev: Path) -> dict[str, tuple[int, int, int]]:
    """Every node under dev (relative path -> major, minor, mode); directories are 0755, and besides nodes
    only the kernel log stand-in ``kmsg`` (a regular file the simulated host writes Xid lines into)."""
    found = {}
    for path in sorted(dev.rglob("*")):
        info = os.lstat(path)
        if path == dev / "kmsg":
            assert stat.S_ISREG(info.st_mode), path
            continue
        if stat.S_ISDIR(info.st_mode):
            assert stat.S_IMODE(info.st_mode) == 0o755, path
            continue
        assert stat.S_ISCHR(info.st_mode), path
        found[str(path.relative_to(dev))] = (os.major(info.st_rdev), os.minor(info.st_rdev), stat.S_IMODE(info.st_mode))
    return found


# NVSwitch, GPUDirect Storage, GDRCopy and RDMA nodes, as on a DGX.
GATED = {
    "nvidia-nvswitchctl": (508, 255),
    "nvidia-nvswitch0": (508, 0),
    "nvidia-nvswitch1": (508, 1),
    "nvidia-fs0": (507, 0),
    "nvidia-fs1": (507, 1),
    "gdrdrv": (506, 0),
    "infiniband/uverbs0": (231, 192),
    "infiniband/rdma_cm": (10, 58),
}


def base_devices(host: FakeHost) -> dict[str, tuple[int, int, int]]:
    """The nodes every simulated host has: GPUs, control, UVM, IMEX channels, gated (all 0666)."""
    expected = {f"nvidia{gpu.minor}": (195, gpu.minor) for gpu in host.gpus}
    expected |= {
        "nvidiactl": (195, 255),
        "nvidia-modeset": (195, 254),
        "nvidia-uvm": (host.uvm_major, 0),
        "nvidia-uvm-tools": (host.uvm_major, 1),
    }
    expected |= {f"nvidia-caps-imex-channels/channel{n}": (509, n) for n in range(4)}
    expected |= GATED
    return {name: (major, minor, 0o666) for name, (major, minor) in expected.items()}


def test_device_nodes(host: FakeHost) -> None:
    """The driver's character devices and a DGX's gated ones, with their numbers and mode 0666."""
    assert host.uvm_major == 511
    assert (host.imex_major, host.imex_channels) == (509, (0, 1, 2, 3))
    assert (host.nvswitch_major, host.nvidia_fs_major, host.gdrdrv_major) == (508, 507, 506)
    assert {name: (major, minor) for name, major, minor in host.gated_nodes} == GATED
    # No MIG, so no /dev/nvidia-caps.
    assert char_devices(host.root / "dev") == base_devices(host)


def test_proc_devices_has_the_kernel_format(host: FakeHost) -> None:
    """Two sections, "%3d %s" lines, and the NVIDIA majors the nodes use."""
    text = (host.root / "proc/devices").read_text()
    chars, sep, blocks = text.partition("\n\nBlock devices:\n")
    assert sep and chars.startswith("Character devices:\n") and blocks.endswith("\n")
    char_lines = chars.splitlines()[1:]
    for line in char_lines + blocks.splitlines():
        assert re.fullmatch(r"[ \d]{2}\d \S+", line), line
    assert "  1 mem" in char_lines and "  5 /dev/tty" in char_lines
    majors = {name: int(major) for major, name in (line.split() for line in char_lines)}
    assert majors["nvidia-frontend"] == host.nvidia_major == 195
    assert majors["nvidia-uvm"] == host.uvm_major
    assert majors["nvidia-caps"] == host.caps_major == 510
    assert majors["nvidia-caps-imex-channels"] == host.imex_major == 509
    assert (majors["nvidia-nvswitch"], majors["nvidia-fs"], majors["gdrdrv"]) == (508, 507, 506)
    assert (majors["misc"], majors["infiniband_mad"]) == (10, 231)
    verbs = [line for line in char_lines if line.endswith(" infiniband_verbs")]
    assert verbs == ["231 infiniband_verbs", "240 infiniband_verbs"]  # fixed and dynamic region
    numbers = [int(line.split()[0]) for line in char_lines]
    assert numbers == sorted(numbers)


def test_proc_driver_nvidia(host: FakeHost) -> None:
    """version, params, registry and the empty capabilities directory."""
    nvidia = host.root / "proc/driver/nvidia"
    version = (nvidia / "version").read_text()
    assert re.fullmatch(
        r"NVRM version: NVIDIA UNIX x86_64 Kernel Module  550\.54\.15  "
        r"\w{3} \w{3} [ \d]\d [\d:]{8} UTC \d{4}\n"
        r"GCC version:  gcc version \S+ .*\n",
        version,
    ), version
    params = dict(line.split(": ", 1) for line in (nvidia / "params").read_text().splitlines())
    assert params["ModifyDeviceFiles"] == "1"
    assert params["DeviceFileMode"] == "438"  # 0666
    assert (nvidia / "registry").read_text() == 'Binary: ""\n'
    # Without MIG there are no MIG capabilities to publish.
    assert list((nvidia / "capabilities").iterdir()) == []
    assert not (host.root / "proc/driver/nvidia-caps").exists()
    assert host.mig_devices == () and not host.mig_enabled


def test_proc_gpu_information(host: FakeHost) -> None:
    """One information file per GPU, named and filled like the driver's."""
    gpus_dir = host.root / "proc/driver/nvidia/gpus"
    assert sorted(p.name for p in gpus_dir.iterdir()) == sorted(gpu.proc_bus_id for gpu in host.gpus)
    for gpu in host.gpus:
        text = (gpus_dir / gpu.proc_bus_id / "information").read_text()
        assert text.startswith(f"Model: \t\t {gpu.name}\nIRQ:   \t\t ")
        assert f"\nDevice Minor: \t {gpu.minor}\n" in text
        fields = info_fields(text)
        assert fields["GPU UUID"] == gpu.uuid
        assert fields["Bus Location"] == gpu.proc_bus_id
        assert fields["Bus Type"] == "PCIe"
        assert fields["GPU Excluded"] == "No"
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", gpu.proc_bus_id)


def test_gpu_identities_are_distinct_and_stable(host: FakeHost) -> None:
    """UUIDs, minors and bus ids: NVML formats, unique, deterministic per driver."""
    assert [gpu.index for gpu in host.gpus] == [gpu.minor for gpu in host.gpus] == list(range(GPUS))
    for gpu in host.gpus:
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", gpu.uuid)
        assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", gpu.pci_bus_id)
    assert len({gpu.uuid for gpu in host.gpus}) == GPUS
    assert len({gpu.pci_bus_id for gpu in host.gpus}) == GPUS
    model = models.lookup_model(host.model)
    again = models.make_gpus(GPUS, host.driver_version, model)
    assert [gpu.uuid for gpu in again] == [gpu.uuid for gpu in host.gpus]
    other = models.make_gpus(GPUS, "535.104.05", model)
    assert not {gpu.uuid for gpu in other} & {gpu.uuid for gpu in host.gpus}
    # Past eight GPUs the bus ids move to the next PCI domain, as on big hosts.
    many = models.make_gpus(16, host.driver_version, model)
    assert len({gpu.pci_bus_id for gpu in many}) == 16
    assert many[8].pci_bus_id.startswith("00000001:")


def test_tools_firmware_and_socket(host: FakeHost) -> None:
    """Executable tool scripts, non-empty GSP firmware and the persistenced socket."""
    for tool in ("nvidia-debugdump", "nvidia-persistenced"):
        path = host.root / "usr/bin" / tool
        assert path.read_text().startswith("#!/bin/sh\n") and os.access(path, os.X_OK), tool
    for tool in ("nvidia-smi", "nvidia-modprobe", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        assert os.access(host.root / "usr/bin" / tool, os.X_OK), tool
    smi = subprocess.run(
        [host.root / "usr/bin/nvidia-smi"], capture_output=True, text=True, check=True
    ).stdout
    assert "Driver Version: 550.54.15" in smi and "CUDA Version: 12.4" in smi
    assert all(gpu.pci_bus_id in smi for gpu in host.gpus)
    listing = subprocess.run(
        [host.root / "usr/bin/nvidia-smi", "-L"], capture_output=True, text=True, check=True
    ).stdout
    assert listing.splitlines() == [f"GPU {g.index}: {g.name} (UUID: {g.uuid})" for g in host.gpus]
    for firmware in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert (host.root / "lib/firmware/nvidia/550.54.15" / firmware).stat().st_size > 0
    assert stat.S_ISSOCK(os.lstat(host.root / "run/nvidia-persistenced/socket").st_mode)


def test_graphics_files(host: FakeHost) -> None:
    """Vulkan/EGL loader manifests naming the driver's libraries, the OpenCL ICD and nvoptix.bin."""
    share = host.root / "usr/share"
    assert json.loads((share / "vulkan/icd.d/nvidia_icd.json").read_text()) == {
        "file_format_version": "1.0.0",
        "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3.277"},
    }
    assert json.loads((share / "glvnd/egl_vendor.d/10_nvidia.json").read_text()) == {
        "file_format_version": "1.0.0",
        "ICD": {"library_path": "libEGL_nvidia.so.0"},
    }
    assert json.loads((share / "egl/egl_external_platform.d/15_nvidia_gbm.json").read_text()) == {
        "file_format_version": "1.0.0",
        "ICD": {"library_path": "libnvidia-egl-gbm.so.1"},
    }
    assert (host.root / "etc/OpenCL/vendors/nvidia.icd").read_text() == "libnvidia-opencl.so.1\n"
    sonames = {lib.soname(host.driver_version) for lib in DRIVER_LIBRARIES}
    assert {"libGLX_nvidia.so.0", "libEGL_nvidia.so.0", "libnvidia-opencl.so.1"} <= sonames
    assert 0 < (share / "nvidia/nvoptix.bin").stat().st_size < 4096
    for path in (
        "usr/share/vulkan/icd.d/nvidia_icd.json",
        "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "etc/OpenCL/vendors/nvidia.icd",
        "usr/share/nvidia/nvoptix.bin",
    ):
        assert stat.S_IMODE((host.root / path).stat().st_mode) == 0o644, path


def test_gpuhook_config(host: FakeHost) -> None:
    """gpuhook.yaml points all three roots, the inventory cache and the lease ledger at the host, and nothing else."""
    text = host.config_path.read_text()
    assert text.startswith(f"# gpuhook config for the simulated GPU host in {host.root}\n")
    assert yaml.safe_load(text) == {
        "driver_root": str(host.root),
        "dev_root": str(host.root),
        "proc_root": str(host.root),
        "log_file": str(host.root / "gpuhook.log"),
        "log_level": "debug",
        "cache_dir": str(host.root / "run/gpuhook"),
        "state_dir": str(host.root / "run/gpuhook"),
    }


def test_mock_nvml_files(host: FakeHost) -> None:
    """The topology the mock reads and the empty, world-writable call log."""
    assert host.topology_path.read_text().startswith("mock-nvml-topology 1\n")
    assert stat.S_IMODE(host.calls_log_path.stat().st_mode) == 0o666


# ---- mock NVML through pynvml ----------------------------------------------

_REPORT = """
nvml(pynvml.nvmlInit)
out["driver"] = nvml(pynvml.nvmlSystemGetDriverVersion)
out["cuda"] = nvml(pynvml.nvmlSystemGetCudaDriverVersion)
out["cuda_v2"] = nvml(pynvml.nvmlSystemGetCudaDriverVersion_v2)
out["nvml"] = nvml(pynvml.nvmlSystemGetNVMLVersion)
out["count"] = nvml(pynvml.nvmlDeviceGetCount)
out["gpus"] = []
for i in range(out["count"]):
    h = nvml(pynvml.nvmlDeviceGetHandleByIndex, i)
    pci = nvml(pynvml.nvmlDeviceGetPciInfo, h)
    mem = nvml(pynvml.nvmlDeviceGetMemoryInfo, h)
    uuid = nvml(pynvml.nvmlDeviceGetUUID, h)
    out["gpus"].append({
        "uuid": uuid,
        "minor": nvml(pynvml.nvmlDeviceGetMinorNumber, h),
        "index": nvml(pynvml.nvmlDeviceGetIndex, h),
        "name": nvml(pynvml.nvmlDeviceGetName, h),
        "brand": nvml(pynvml.nvmlDeviceGetBrand, h),
        "cc": nvml(pynvml.nvmlDeviceGetCudaComputeCapability, h),
        "bus_id": text(pci.busId),
        "bus_id_legacy": text(pci.busIdLegacy),
        "pci": [pci.domain, pci.bus, pci.device, pci.pciDeviceId, pci.pciSubSystemId],
        "memory": [mem.total, mem.free, mem.used],
        "memory_v2": nvml(pynvml.nvmlDeviceGetMemoryInfo, h, pynvml.nvmlMemory_v2).total,
        "mig": code(pynvml.nvmlDeviceGetMigMode, h) or nvml(pynvml.nvmlDeviceGetMigMode, h),
        "persistence": nvml(pynvml.nvmlDeviceGetPersistenceMode, h),
        "by_uuid_index": nvml(pynvml.nvmlDeviceGetIndex, nvml(pynvml.nvmlDeviceGetHandleByUUID, uuid)),
    })
nvml(pynvml.nvmlShutdown)
"""


def test_pynvml_sees_the_topology(host: FakeHost) -> None:
    """Everything gpuhook asks NVML for matches the host, via pynvml's own wrappers."""
    got = run_nvml(host.nvml_library, _REPORT)
    assert got["driver"] == "550.54.15"
    assert got["cuda"] == got["cuda_v2"] == 12040
    assert got["nvml"] == "12.550.54.15"
    assert got["count"] == GPUS
    for gpu, seen in zip(host.gpus, got["gpus"], strict=True):
        domain, bus, rest = gpu.pci_bus_id.split(":")
        assert seen["uuid"] == gpu.uuid
        assert seen["minor"] == seen["index"] == seen["by_uuid_index"] == gpu.index
        assert seen["name"] == "NVIDIA H100 80GB HBM3"
        assert seen["brand"] == pynvml.NVML_BRAND_TESLA
        assert seen["cc"] == [9, 0]
        assert seen["bus_id"] == gpu.pci_bus_id
        assert seen["bus_id_legacy"] == gpu.pci_bus_id[4:]
        assert seen["pci"][:3] == [int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)]
        assert seen["pci"][3] == H100_PCI_DEVICE_ID
        assert seen["memory"] == [81559 * 2**20, 81559 * 2**20, 0]
        assert seen["memory_v2"] == 81559 * 2**20
        assert seen["mig"] == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
        assert seen["persistence"] == pynvml.NVML_FEATURE_ENABLED
    assert logged_calls(host, got["pid"]) == [got["made"]]


_ERRORS = """
E = pynvml
out["before_init"] = [code(E.nvmlDeviceGetCount), code(E.nvmlSystemGetDriverVersion), code(E.nvmlShutdown)]
nvml(E.nvmlInit)
h = nvml(E.nvmlDeviceGetHandleByIndex, 0)
out["bad_index"] = [code(E.nvmlDeviceGetHandleByIndex, i) for i in (4, 64, 2**32 - 1)]
try:
    nvml(E.nvmlDeviceGetHandleByIndex, 4)
except E.NVMLError_InvalidArgument:
    out["bad_index_class"] = True
out["unknown_uuid"] = code(E.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")
buf = ctypes.create_string_buffer(96)
version_len = len(nvml(E.nvmlSystemGetDriverVersion))
out["short"] = [
    raw("nvmlDeviceGetUUID", h, buf, 10),
    raw("nvmlSystemGetDriverVersion", buf, version_len),
    raw("nvmlSystemGetDriverVersion", buf, version_len + 1),
    raw("nvmlDeviceGetName", h, buf, 5),
]
minor = ctypes.c_uint()
not_a_handle = ctypes.c_void_p(ctypes.cast(h, ctypes.c_void_p).value + 1)
out["null"] = [
    raw("nvmlDeviceGetName", h, None, 96),
    raw("nvmlDeviceGetCount_v2", None),
    raw("nvmlDeviceGetHandleByIndex_v2", 0, None),
    raw("nvmlDeviceGetMinorNumber", h, None),
    raw("nvmlDeviceGetMinorNumber", None, ctypes.byref(minor)),
    raw("nvmlDeviceGetMinorNumber", ctypes.c_void_p(64), ctypes.byref(minor)),
    raw("nvmlDeviceGetMinorNumber", not_a_handle, ctypes.byref(minor)),
    raw("nvmlDeviceGetHandleByUUID", None, ctypes.byref(ctypes.c_void_p())),
]
memory = E.c_nvmlMemory_v2_t()
memory.version = 1
out["memory_version"] = raw("nvmlDeviceGetMemoryInfo_v2", h, ctypes.byref(memory))
out["strings"] = [nvml(E.nvmlErrorString, c) for c in (0, 2, 6, 7, 12345)]
nvml(E.nvmlShutdown)
out["after_shutdown"] = [code(E.nvmlDeviceGetCount), code(E.nvmlShutdown), code(E.nvmlDeviceGetUUID, h)]
"""


def test_pynvml_error_codes(host: FakeHost) -> None:
    """NVML's error contract: uninitialised, invalid argument, not found, short buffer."""
    got = run_nvml(host.nvml_library, _ERRORS)
    uninit, invalid = pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_INVALID_ARGUMENT
    short = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert got["before_init"] == [uninit] * 3
    assert got["bad_index"] == [invalid] * 3
    assert got["bad_index_class"] is True
    assert got["unknown_uuid"] == pynvml.NVML_ERROR_NOT_FOUND
    assert got["short"] == [short, short, pynvml.NVML_SUCCESS, short]
    assert got["null"] == [invalid] * 8
    assert got["memory_version"] == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert got["strings"] == [
        "Success",
        "Invalid Argument",
        "Not Found",
        "Insufficient Size",
        "Unknown Error",
    ]
    assert got["after_shutdown"] == [uninit] * 3
    # One line, written by the shutdown that balanced the init; later calls
    # are logged when the process exits.
    assert logged_calls(host, got["pid"]) == [got["made"] - 3, 3]


def test_init_is_reference_counted(host: FakeHost) -> None:
    """Two inits need two shutdowns; only the last one writes the call log."""
    got = run_nvml(
        host.nvml_library,
        """
        nvml(pynvml.nvmlInit)
        nvml(pynvml.nvmlInit)
        nvml(pynvml.nvmlShutdown)
        out["still"] = nvml(pynvml.nvmlDeviceGetCount)
        nvml(pynvml.nvmlShutdown)
        out["logged_after_last"] = open(sys.argv[1].rsplit("/usr/", 1)[0] + "/etc/mock-nvml/calls.log").read()
        out["after"] = code(pynvml.nvmlDeviceGetCount)
        """,
    )
    assert got["still"] == GPUS
    assert got["after"] == pynvml.NVML_ERROR_UNINITIALIZED
    assert f"{got['pid']} 5\n" in got["logged_after_last"]
    assert logged_calls(host, got["pid"]) == [5, 1]


def test_calls_are_logged_at_exit_without_shutdown(host: FakeHost) -> None:
    """A process that never shuts NVML down still leaves its count."""
    got = run_nvml(host.nvml_library, "nvml(pynvml.nvmlInit)\nnvml(pynvml.nvmlDeviceGetCount)\n")
    assert logged_calls(host, got["pid"]) == [got["made"]] == [2]


def test_loading_without_calling_logs_nothing(host: FakeHost) -> None:
    """Loading the library is not an NVML call: no line, which is what benchmarks check."""
    got = run_nvml(host.lib_dir / "libnvidia-ml.so.1", "")
    assert got["made"] == 0
    assert logged_calls(host, got["pid"]) == []


_HAMMER_C = r"""
/* Calls nvmlDeviceGetCount_v2 from many threads at once, through dlopen. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

typedef int (*count_fn)(unsigned int *);
static count_fn get_count;
static int failures;

static void *hammer(void *unused)
{
    unsigned int n;
    (void)unused;
    for (int i = 0; i < CALLS; i++)
        if (get_count(&n) != 0 || n != GPUS)
            __atomic_fetch_add(&failures, 1, __ATOMIC_RELAXED);
    return NULL;
}

int main(int argc, char **argv)
{
    pthread_t threads[THREADS];
    void *lib = argc == 2 ? dlopen(argv[1], RTLD_NOW) : NULL;
    if (lib == NULL)
        return 2;
    int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
    int (*shutdown)(void) = (int (*)(void))dlsym(lib, "nvmlShutdown");
    get_count = (count_fn)dlsym(lib, "nvmlDeviceGetCount_v2");
    if (init() != 0)
        return 3;
    for (int t = 0; t < THREADS; t++)
        pthread_create(&threads[t], NULL, hammer, NULL);
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);
    printf("%d %d\n", (int)getpid(), failures);
    return shutdown();
}
"""


def test_call_count_is_exact_across_threads(host: FakeHost, tmp_path: Path) -> None:
    """Native threads calling at once lose no counts (the counter is atomic)."""
    threads, calls = 8, 200_000
    source = tmp_path / "hammer.c"
    source.write_text(_HAMMER_C)
    program = tmp_path / "hammer"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-Wall",
            "-Werror",
            "-pthread",
            f"-DTHREADS={threads}",
            f"-DCALLS={calls}",
            f"-DGPUS={GPUS}",
            "-o",
            str(program),
            str(source),
        ],
        check=True,
    )
    result = subprocess.run(
        [program, host.lib_dir / "libnvidia-ml.so.1"], capture_output=True, text=True, timeout=120, check=True
    )
    pid, failures = map(int, result.stdout.split())
    assert failures == 0
    assert logged_calls(host, pid) == [1 + threads * calls + 1]


def test_mock_nvml_without_or_with_broken_topology(host: FakeHost, tmp_path: Path) -> None:
    """No topology reads as no driver; a malformed one fails init and says where."""
    lib_dir = tmp_path / native.LIB_DIR
    lib_dir.mkdir(parents=True)
    lib = lib_dir / host.nvml_library.name
    shutil.copy2(host.nvml_library, lib)
    init = 'out["init"] = code(pynvml.nvmlInit)\n'
    assert run_nvml(lib, init)["init"] == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    topology = tmp_path / "etc/mock-nvml/topology"
    topology.parent.mkdir(parents=True)
    good = host.topology_path.read_text()
    topology.write_text(good.replace("gpu 1 1 ", "gpu 1 1 not-enough-fields\n#", 1))
    broken = run_nvml(lib, init)
    assert broken["init"] == pynvml.NVML_ERROR_UNKNOWN
    assert f"{topology.resolve()}:" in broken["stderr"] and "malformed gpu record" in broken["stderr"]
    topology.write_text(good + "mig 1 0 7 0 MIG-00000000-0000-0000-0000-000000000000 1024 X MIG 1g.10gb\n")
    stray = run_nvml(lib, init)
    assert stray["init"] == pynvml.NVML_ERROR_UNKNOWN
    assert "mig record for a gpu whose MIG mode is not enabled" in stray["stderr"]
    topology.write_text(good)
    assert run_nvml(lib, init + 'out["n"] = nvml(pynvml.nvmlDeviceGetCount)\n')["n"] == GPUS


# ---- other models, validation, CLI -------------------------------------------

_MODEL_REPORT = """
nvml(pynvml.nvmlInit)
h = nvml(pynvml.nvmlDeviceGetHandleByIndex, 0)
out["driver"] = nvml(pynvml.nvmlSystemGetDriverVersion)
out["cuda"] = nvml(pynvml.nvmlSystemGetCudaDriverVersion)
out["name"] = nvml(pynvml.nvmlDeviceGetName, h)
out["cc"] = nvml(pynvml.nvmlDeviceGetCudaComputeCapability, h)
out["brand"] = nvml(pynvml.nvmlDeviceGetBrand, h)
out["memory"] = nvml(pynvml.nvmlDeviceGetMemoryInfo, h).total
out["mig"] = code(pynvml.nvmlDeviceGetMigMode, h)
out["max_mig"] = nvml(pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
out["mig_0"] = code(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 0)
nvml(pynvml.nvmlShutdown)
"""


@pytest.mark.parametrize(
    ("model", "cc", "brand", "memory_mib", "mig", "mig_0"),
    [
        (
            "Tesla T4",
            [7, 5],
            pynvml.NVML_BRAND_TESLA,
            15360,
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            pynvml.NVML_ERROR_NOT_SUPPORTED,
        ),
        # MIG-capable with MIG off: no MIG device slots at all.
        (
            "NVIDIA A100-SXM4-80GB",
            [8, 0],
            pynvml.NVML_BRAND_TESLA,
            81920,
            pynvml.NVML_SUCCESS,
            pynvml.NVML_ERROR_INVALID_ARGUMENT,
        ),
        (
            "ACME Accelerator 9000",
            [8, 0],
            pynvml.NVML_BRAND_NVIDIA,
            16384,
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            pynvml.NVML_ERROR_NOT_SUPPORTED,
        ),
    ],
)
def test_other_models_and_versions(
    tmp_path: Path, model: str, cc: list[int], brand: int, memory_mib: int, mig: int, mig_0: int
) -> None:
    """Model table and fallback, another driver and CUDA version, a socket path past sun_path."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    host = create_host(deep, gpus=1, driver="535.104.05", cuda="12.2", model=model)
    assert readelf_soname(host.lib_dir / "libnvidia-glcore.so.535.104.05") == "libnvidia-glcore.so.535.104.05"
    assert stat.S_ISSOCK(os.lstat(host.root / "run/nvidia-persistenced/socket").st_mode)
    got = run_nvml(host.nvml_library, _MODEL_REPORT)
    assert (got["driver"], got["cuda"], got["name"]) == ("535.104.05", 12020, model)
    assert (got["cc"], got["brand"], got["memory"], got["mig"]) == (cc, brand, memory_mib * 2**20, mig)
    # nvml.h: the maximum is zero when MIG is not supported or not enabled.
    assert (got["max_mig"], got["mig_0"]) == (0, mig_0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpus": 0},
        {"gpus": 65},
        {"gpus": 1, "driver": "latest"},
        {"gpus": 1, "cuda": "12"},
        {"gpus": 1, "model": "bad\nname"},
        {"gpus": 1, "model": "x" * 64},
    ],
)
def test_create_host_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    """Bad arguments fail before anything is written."""
    with pytest.raises(FakeHostError):
        create_host(tmp_path / "host", **kwargs)
    assert not (tmp_path / "host").exists()


def test_failed_build_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails half-way leaves neither a new nor a pre-existing empty dir dirty."""

    def broken_ldconfig(root: Path) -> None:
        raise native.BuildError("ldconfig exploded")

    monkeypatch.setattr(native, "run_ldconfig", broken_ldconfig)
    with pytest.raises(native.BuildError):
        create_host(tmp_path / "new", gpus=1)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(native.BuildError):
        create_host(tmp_path / "empty", gpus=1)
    assert list((tmp_path / "empty").iterdir()) == []


def test_create_host_refuses_non_empty_dir(tmp_path: Path) -> None:
    """The API refuses to build over existing files."""
    (tmp_path / "keep").write_text("mine")
    with pytest.raises(FakeHostError, match="is not empty"):
        create_host(tmp_path, gpus=1)
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_cli_create(tmp_path: Path) -> None:
    """`create DIR --gpus 4` builds a host and names its config."""
    result = run_cli("create", str(tmp_path / "h"), "--gpus", "4")
    assert result.returncode == 0, result.stderr
    root = (tmp_path / "h").resolve()
    assert f"gpuhook config: {root}/gpuhook.yaml" in result.stdout
    assert yaml.safe_load((root / "gpuhook.yaml").read_text())["dev_root"] == str(root)
    assert sorted(p.name for p in (root / "dev").glob("nvidia[0-9]*")) == [f"nvidia{i}" for i in range(4)]
    assert (root / "etc/mock-nvml/topology").read_text().count("\ngpu ") == 4
    assert (root / "etc/mock-nvml/calls.log").read_bytes() == b""


def test_cli_refuses_non_empty_dir(tmp_path: Path) -> None:
    """A non-empty DIR is an error with a clear message, and is left alone."""
    (tmp_path / "keep").write_text("mine")
    result = run_cli("create", str(tmp_path), "--gpus", "4")
    assert result.returncode == 1
    assert "is not empty" in result.stderr and str(tmp_path.resolve()) in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_cli_mig(tmp_path: Path) -> None:
    """`--mig 0:1g.10gb,1g.10gb` on two GPUs: two MIG devices on GPU 0, their caps, nodes and NVML view."""
    result = run_cli("create", str(tmp_path / "h"), "--gpus", "2", "--mig", "0:1g.10gb,1g.10gb")
    assert result.returncode == 0, result.stderr
    root = (tmp_path / "h").resolve()
    summary = re.findall(r"^    MIG (\d): 1g\.10gb MIG-[0-9a-f-]{36} gi (\d) ci 0 caps (\S+)$", result.stdout, re.M)
    assert summary == [("0", "7", "nvidia-cap66,nvidia-cap67"), ("1", "8", "nvidia-cap75,nvidia-cap76")]
    caps = {
        name: numbers for name, numbers in char_devices(root / "dev").items() if name.startswith("nvidia-caps/")
    }
    assert caps == {
        "nvidia-caps/nvidia-cap1": (510, 1, 0o400),
        "nvidia-caps/nvidia-cap2": (510, 2, 0o444),
        "nvidia-caps/nvidia-cap66": (510, 66, 0o444),
        "nvidia-caps/nvidia-cap67": (510, 67, 0o444),
        "nvidia-caps/nvidia-cap75": (510, 75, 0o444),
        "nvidia-caps/nvidia-cap76": (510, 76, 0o444),
    }
    capabilities = root / "proc/driver/nvidia/capabilities"
    assert sorted(str(p.relative_to(capabilities)) for p in capabilities.rglob("*") if p.is_file()) == [
        "gpu0/mig/gi7/access",
        "gpu0/mig/gi7/ci0/access",
        "gpu0/mig/gi8/access",
        "gpu0/mig/gi8/ci0/access",
        "mig/config",
        "mig/monitor",
    ]
    assert (capabilities / "gpu0/mig/gi8/ci0/access").read_text() == (
        "DeviceFileMinor: 76\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    )
    topology = (root / "etc/mock-nvml/topology").read_text()
    assert " enabled 1 NVIDIA H100 80GB HBM3\n" in topology and " disabled 1 NVIDIA H100 80GB HBM3\n" in topology
    assert len(re.findall(r"^mig 0 [01] [78] 0 MIG-", topology, re.M)) == 2
    listing = subprocess.run([root / "usr/bin/nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(
        r"GPU 0: .*\n  MIG 1g\.10gb     Device  0: \(UUID: MIG-.*\)\n  MIG 1g\.10gb     Device  1: \(UUID: MIG-.*\)\n"
        r"GPU 1: .*\n",
        listing,
    ), listing
    # The same request split over two --mig options builds the same host.
    again = run_cli("create", str(tmp_path / "h2"), "--gpus", "2", "--mig", "0:1g.10gb", "--mig", "0:1g.10gb")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "h2/etc/mock-nvml/topology").read_text() == topology


@pytest.mark.parametrize(
    ("mig_args", "message"),
    [
        (["0:1g.10gb,7g.80gb"], "needs 8 compute slices; a GPU has 7"),
        (["0:1g.5gb"], "NVIDIA H100 80GB HBM3 has no MIG profile '1g.5gb'; its profiles are 1g.10gb, "),
        (["2:1g.10gb"], "--mig names GPU 2, but the host has GPUs 0-1"),
        (["0:4g.40gb", "0:4g.40gb"], "needs 8 compute slices"),
    ],
)
def test_cli_refuses_bad_mig(tmp_path: Path, mig_args: list[str], message: str) -> None:
    """A MIG layout that cannot exist is an error naming the problem; nothing is built."""
    options = [arg for value in mig_args for arg in ("--mig", value)]
    result = run_cli("create", str(tmp_path / "h"), "--gpus", "2", *options)
    assert result.returncode == 1
    assert result.stderr.startswith("fakehost: error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "h").exists()


def test_cli_refuses_malformed_mig(tmp_path: Path) -> None:
    """--mig that is not GPU:PROFILE[,PROFILE...] is a usage error."""
    for value in ("zero", "0:", "0:1g.10gb,", "x:1g.10gb", "0:big"):
        malformed = run_cli("create", str(tmp_path / "h"), "--gpus", "2", "--mig", value)
        assert malformed.returncode == 2 and "GPU:PROFILE" in malformed.stderr, value
    assert not (tmp_path / "h").exists()


# ---- MIG ---------------------------------------------------------------------

# GPU 0 fully partitioned four ways, GPU 1 without MIG, GPU 2 one whole-GPU
# instance, GPU 3 in MIG mode with no instances yet.
MIG_LAYOUT = {0: ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), 2: ("7g.80gb",), 3: ()}
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHost]:
    """A 4-GPU H100 host with MIG_LAYOUT."""
    yield create_host(tmp_path_factory.mktemp("fakehost-mig") / "host", gpus=GPUS, mig=MIG_LAYOUT)


def test_mig_devices(mig_host: FakeHost) -> None:
    """FakeHost.mig_devices: creation order, driver GI ids by size, CI 0, stable MIG UUIDs, cap minors."""
    assert mig_host.mig_enabled
    assert [gpu.mig_enabled for gpu in mig_host.gpus] == [True, False, True, True]
    got = [(m.parent_index, m.index, m.profile, m.gi, m.ci) for m in mig_host.mig_devices]
    assert got == [
        (0, 0, "3g.40gb", 1, 0),
        (0, 1, "2g.20gb", 3, 0),
        (0, 2, "1g.10gb", 7, 0),
        (0, 3, "1g.10gb", 8, 0),
        (2, 0, "7g.80gb", 0, 0),
    ]
    for device in mig_host.mig_devices:
        assert re.fullmatch(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", device.uuid)
        assert device.parent_minor == mig_host.gpus[device.parent_index].minor
        assert device.gi_cap_minor == 3 + 135 * device.parent_minor + 9 * device.gi
        assert device.ci_cap_minor == device.gi_cap_minor + 1 + device.ci
        assert device.name == f"NVIDIA H100 80GB HBM3 MIG {device.profile}"
    assert len({m.uuid for m in mig_host.mig_devices}) == 5
    assert not {m.uuid for m in mig_host.mig_devices} & {g.uuid for g in mig_host.gpus}
    # Deterministic: the same layout on another build has the same UUIDs.
    gpus = models.make_gpus(GPUS, "550.54.15", models.lookup_model(mig_host.model))
    again = mig.make_mig_devices(gpus, MIG_LAYOUT, "550.54.15")
    assert again == mig_host.mig_devices
    # Memory: the instance's share of the GPU's 8 memory slices, in 256 MiB steps.
    memory = {m.profile: m.memory_total // 2**20 for m in mig_host.mig_devices}
    assert memory == {"3g.40gb": 40704, "2g.20gb": 20224, "1g.10gb": 9984, "7g.80gb": 81408}


@pytest.mark.parametrize(
    ("model", "profiles", "gis"),
    [
        ("NVIDIA H100 80GB HBM3", ["7g.80gb"], [0]),
        ("NVIDIA H100 80GB HBM3", ["4g.40gb", "3g.40gb"], [1, 2]),
        ("NVIDIA H100 80GB HBM3", ["3g.40gb", "3g.40gb"], [1, 2]),
        ("NVIDIA H100 80GB HBM3", ["4g.40gb", "2g.20gb", "1g.10gb"], [1, 3, 7]),
        ("NVIDIA H100 80GB HBM3", ["1g.10gb", "2g.20gb", "2g.20gb", "2g.20gb"], [7, 3, 4, 5]),
        ("NVIDIA H100 80GB HBM3", ["1g.10gb"] * 7, list(range(7, 14))),
        ("NVIDIA H100 80GB HBM3", ["1g.20gb"] * 4, [7, 8, 9, 10]),
        ("NVIDIA H100 80GB HBM3", ["1g.10gb+me", "1g.10gb"], [7, 8]),
        ("NVIDIA H100 PCIe", ["3g.40gb", "1g.10gb"], [1, 7]),
        ("NVIDIA A100-SXM4-80GB", ["2g.20gb", "1g.20gb"], [3, 7]),
        ("NVIDIA A100-SXM4-40GB", ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"], [1, 3, 7, 8]),
        ("NVIDIA A100-SXM4-40GB", ["7g.40gb"], [0]),
    ],
)
def test_mig_gpu_instance_ids(model: str, profiles: list[str], gis: list[int]) -> None:
    """GI ids as the driver assigns them: 7g 0, 4g 1, 3g 1-2, 2g 3-6, 1g 7-14, lowest free first."""
    gpus = models.make_gpus(1, "550.54.15", models.lookup_model(model))
    devices = mig.make_mig_devices(gpus, {0: profiles}, "550.54.15")
    assert [(d.index, d.profile, d.gi, d.ci) for d in devices] == [
        (i, p, gi, 0) for i, (p, gi) in enumerate(zip(profiles, gis, strict=True))
    ]


def test_mig_profiles_per_model() -> None:
    """The GPU instance profiles each MIG model offers, and only those models."""
    names = {model: [p.name for p in profiles] for model, profiles in mig.MIG_PROFILES.items()}
    h100 = ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert names == {
        "NVIDIA H100 80GB HBM3": h100,
        "NVIDIA H100 PCIe": h100,
        "NVIDIA A100-SXM4-80GB": h100,
        "NVIDIA A100-SXM4-40GB": ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        "NVIDIA H200": ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    }
    capable = {name for name in models.KNOWN_MODELS if models.lookup_model(name).mig_capable}
    assert capable == set(mig.MIG_PROFILES)


@pytest.mark.parametrize(
    ("model", "layout", "message"),
    [
        (H100, {0: ["9g.90gb"]}, "has no MIG profile '9g.90gb'; its profiles are 1g.10gb, 1g.10gb+me, 1g.20gb"),
        ("NVIDIA A100-SXM4-40GB", {0: ["1g.10gb", "3g.40gb"]}, "NVIDIA A100-SXM4-40GB has no MIG profile '3g.40gb'"),
        ("NVIDIA H100 80GB HBM3", {0: ["4g.40gb", "4g.40gb"]}, "needs 8 compute slices; a GPU has 7"),
        ("NVIDIA H100 80GB HBM3", {0: ["1g.10gb"] * 8}, "needs 8 compute slices; a GPU has 7"),
        ("NVIDIA H100 80GB HBM3", {0: ["1g.20gb"] * 5}, "needs 10 memory slices; a GPU has 8"),
        ("NVIDIA H100 80GB HBM3", {0: ["3g.40gb", "3g.40gb", "1g.10gb"]}, "needs 9 memory slices"),
        (H100, {0: ["3g.40gb", "4g.40gb"]}, "no GPU instance id is left for 4g.40gb after 3g.40gb (gi 1)"),
        ("NVIDIA H100 80GB HBM3", {0: ["1g.10gb+me", "1g.10gb+me"]}, "more than one +me profile"),
        ("NVIDIA H100 80GB HBM3", {0: ["1c.3g.40gb"]}, "'1c.3g.40gb' is a compute instance profile"),
        ("NVIDIA H100 80GB HBM3", {1: ["1g.10gb"]}, "--mig names GPU 1, but the host has GPUs 0-0"),
        ("NVIDIA H100 80GB HBM3", {-1: ["1g.10gb"]}, "--mig names GPU -1"),
        ("NVIDIA H100 80GB HBM3", {"0": ["1g.10gb"]}, "mig keys are GPU indices, got '0'"),
        ("Tesla T4", {0: ["1g.10gb"]}, "GPU 0 (Tesla T4) has no MIG profiles; MIG-capable models: NVIDIA H100"),
        ("ACME Accelerator 9000", {0: []}, "GPU 0 (ACME Accelerator 9000) has no MIG profiles"),
    ],
)
def test_create_host_refuses_bad_mig(tmp_path: Path, model: str, layout: dict[Any, list[str]], message: str) -> None:
    """Unknown profiles, layouts that do not fit, MIG on a non-MIG model: clear errors, nothing written."""
    with pytest.raises(FakeHostError) as error:
        create_host(tmp_path / "host", gpus=1, model=model, mig=layout)
    assert message in str(error.value)
    assert not (tmp_path / "host").exists()


def test_create_host_accepts_a_comma_separated_string(tmp_path: Path) -> None:
    """mig={0: "1g.10gb,1g.10gb"} is the CLI's syntax and means the same as a tuple."""
    host = create_host(tmp_path / "host", gpus=1, mig={0: "1g.10gb,1g.10gb"})
    assert [(m.profile, m.gi) for m in host.mig_devices] == [("1g.10gb", 7), ("1g.10gb", 8)]


def test_mig_minors_table(mig_host: FakeHost) -> None:
    """The driver's full table: config, monitor, then 15 GIs x (1 + 8 CIs) per GPU for all 32 GPUs."""
    text = mig_host.mig_minors_path.read_text()
    assert stat.S_IMODE(mig_host.mig_minors_path.stat().st_mode) == 0o444
    rows = [line.split(" ") for line in text.splitlines()]
    assert text.endswith("\n") and all(len(row) == 2 for row in rows)
    assert [int(minor) for _, minor in rows] == list(range(1, 4323))
    table = dict((name, int(minor)) for name, minor in rows)
    assert len(table) == 4322
    # The values NVIDIA's documentation and tools quote.
    assert table["config"] == 1 and table["monitor"] == 2
    assert table["gpu0/gi0/access"] == 3 and table["gpu0/gi0/ci0/access"] == 4 and table["gpu0/gi0/ci2/access"] == 6
    assert table["gpu3/gi3/ci3/access"] == 439 and table["gpu6/gi11/ci7/access"] == 920
    assert rows[-1] == ["gpu31/gi14/ci7/access", "4322"]
    order = [name for name, _ in rows[2:11]]
    assert order == ["gpu0/gi0/access"] + [f"gpu0/gi0/ci{ci}/access" for ci in range(8)]
    for device in mig_host.mig_devices:
        assert table[device.gi_cap] == device.gi_cap_minor
        assert table[device.ci_cap] == device.ci_cap_minor
    # More GPUs than the driver's 32 still get their rows.
    assert mig.mig_minors(40).splitlines()[-1] == "gpu39/gi14/ci7/access 5402"


def test_mig_capability_files(mig_host: FakeHost) -> None:
    """mig/config, mig/monitor and one access file per existing GI and CI, in the driver's format and modes."""
    caps = mig_host.capabilities_dir
    files = {str(p.relative_to(caps)): p for p in caps.rglob("*") if p.is_file()}
    expected = {"mig/config": (1, 0o400), "mig/monitor": (2, 0o444)}
    for device in mig_host.mig_devices:
        expected[device.gi_proc_path] = (device.gi_cap_minor, 0o444)
        expected[device.ci_proc_path] = (device.ci_cap_minor, 0o444)
    assert sorted(files) == sorted(expected)
    assert "gpu2/mig/gi0/ci0/access" in files and "gpu0/mig/gi8/access" in files
    assert not any(name.startswith(("gpu1/", "gpu3/")) for name in files)
    for name, (minor, mode) in expected.items():
        assert files[name].read_text() == f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
        assert stat.S_IMODE(files[name].stat().st_mode) == mode, name


def test_mig_device_nodes(mig_host: FakeHost) -> None:
    """/dev/nvidia-caps: config (0400), monitor and every existing GI/CI access cap (0444), nvidia-caps major."""
    nodes = char_devices(mig_host.root / "dev")
    caps = {name: numbers for name, numbers in nodes.items() if name.startswith("nvidia-caps/")}
    expected = {"nvidia-caps/nvidia-cap1": (510, 1, 0o400), "nvidia-caps/nvidia-cap2": (510, 2, 0o444)}
    for device in mig_host.mig_devices:
        for minor in (device.gi_cap_minor, device.ci_cap_minor):
            expected[f"nvidia-caps/nvidia-cap{minor}"] = (mig_host.caps_major, minor, 0o444)
    assert caps == expected
    assert {name: numbers for name, numbers in nodes.items() if name not in caps} == base_devices(mig_host)
    assert sorted(minor for _, minor, _ in caps.values()) == [1, 2, 12, 13, 30, 31, 66, 67, 75, 76, 273, 274]


_MIG_REPORT = """
E = pynvml
nvml(E.nvmlInit)
out["count"] = nvml(E.nvmlDeviceGetCount)
out["gpus"] = []
for i in range(out["count"]):
    h = nvml(E.nvmlDeviceGetHandleByIndex, i)
    gpu = {
        "mode": nvml(E.nvmlDeviceGetMigMode, h),
        "max": nvml(E.nvmlDeviceGetMaxMigDeviceCount, h),
        "is_mig": nvml(E.nvmlDeviceIsMigDeviceHandle, h).value,
        "gi_of_gpu": code(E.nvmlDeviceGetGpuInstanceId, h),
        "ci_of_gpu": code(E.nvmlDeviceGetComputeInstanceId, h),
        "parent_of_gpu": code(E.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h),
        "slots": [code(E.nvmlDeviceGetMigDeviceHandleByIndex, h, j) for j in range(8)],
        "migs": [],
    }
    for j in range(gpu["max"]):
        try:
            m = nvml(E.nvmlDeviceGetMigDeviceHandleByIndex, h, j)
        except E.NVMLError_NotFound:
            continue
        uuid = nvml(E.nvmlDeviceGetUUID, m)
        gi = nvml(E.nvmlDeviceGetGpuInstanceId, m)
        ci = nvml(E.nvmlDeviceGetComputeInstanceId, m)
        parent = nvml(E.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, m)
        legacy = "MIG-" + nvml(E.nvmlDeviceGetUUID, h) + f"/{gi}/{ci}"
        mem = nvml(E.nvmlDeviceGetMemoryInfo, m)
        gpu["migs"].append({
            "slot": j,
            "uuid": uuid,
            "is_mig": nvml(E.nvmlDeviceIsMigDeviceHandle, m).value,
            "gi": gi,
            "ci": ci,
            "name": nvml(E.nvmlDeviceGetName, m),
            "memory": [mem.total, mem.free, mem.used],
            "memory_v2": nvml(E.nvmlDeviceGetMemoryInfo, m, E.nvmlMemory_v2).total,
            "cc": nvml(E.nvmlDeviceGetCudaComputeCapability, m),
            "brand": nvml(E.nvmlDeviceGetBrand, m),
            "parent_index": nvml(E.nvmlDeviceGetIndex, parent),
            "parent_uuid": nvml(E.nvmlDeviceGetUUID, parent),
            "by_uuid": nvml(E.nvmlDeviceGetUUID, nvml(E.nvmlDeviceGetHandleByUUID, uuid)),
            "by_legacy_uuid": nvml(E.nvmlDeviceGetUUID, nvml(E.nvmlDeviceGetHandleByUUID, legacy)),
            "gpu_only": [
                code(E.nvmlDeviceGetMinorNumber, m),
                code(E.nvmlDeviceGetIndex, m),
                code(E.nvmlDeviceGetPciInfo, m),
                code(E.nvmlDeviceGetPersistenceMode, m),
                code(E.nvmlDeviceGetMigMode, m),
            ],
            "wrong_kind": [
                code(E.nvmlDeviceGetMaxMigDeviceCount, m),
                code(E.nvmlDeviceGetMigDeviceHandleByIndex, m, 0),
            ],
        })
    out["gpus"].append(gpu)
out["unknown"] = [
    code(E.nvmlDeviceGetHandleByUUID, "MIG-00000000-0000-0000-0000-000000000000"),
    code(E.nvmlDeviceGetHandleByUUID, "MIG-" + out["gpus"][0]["migs"][0]["parent_uuid"] + "/14/0"),
    code(E.nvmlDeviceGetHandleByUUID, "MIG-" + out["gpus"][0]["migs"][0]["parent_uuid"] + "/1/0/"),
    code(E.nvmlDeviceGetHandleByUUID, "MIG-GPU-nonsense/1/0"),
]
nvml(E.nvmlShutdown)
"""


def test_pynvml_sees_mig_devices(mig_host: FakeHost) -> None:
    """MIG mode, MIG device handles and their identities through pynvml, with exact call counting."""
    got = run_nvml(mig_host.nvml_library, _MIG_REPORT)
    invalid, not_found = pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert got["count"] == GPUS  # MIG devices are not counted as GPUs
    enabled = [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert [g["mode"] for g in got["gpus"]] == [enabled, [pynvml.NVML_DEVICE_MIG_DISABLE] * 2, enabled, enabled]
    assert [g["max"] for g in got["gpus"]] == [7, 0, 7, 7]
    for gpu in got["gpus"]:
        assert gpu["is_mig"] == 0
        assert [gpu["gi_of_gpu"], gpu["ci_of_gpu"], gpu["parent_of_gpu"]] == [invalid] * 3
    assert got["gpus"][0]["slots"] == [0] * 4 + [not_found] * 3 + [invalid]
    assert got["gpus"][1]["slots"] == [invalid] * 8  # MIG off: there are no slots
    assert got["gpus"][2]["slots"] == [0] + [not_found] * 6 + [invalid]
    assert got["gpus"][3]["slots"] == [not_found] * 7 + [invalid]
    seen = [(g_index, m) for g_index, g in enumerate(got["gpus"]) for m in g["migs"]]
    assert len(seen) == len(mig_host.mig_devices)
    for (g_index, m), device in zip(seen, mig_host.mig_devices, strict=True):
        parent = mig_host.gpus[device.parent_index]
        assert (g_index, m["slot"]) == (device.parent_index, device.index)
        assert m["uuid"] == m["by_uuid"] == m["by_legacy_uuid"] == device.uuid
        assert (m["is_mig"], m["gi"], m["ci"]) == (1, device.gi, device.ci)
        assert m["name"] == device.name == f"NVIDIA H100 80GB HBM3 MIG {device.profile}"
        assert m["memory"] == [device.memory_total, device.memory_total, 0]
        assert m["memory_v2"] == device.memory_total
        assert (m["cc"], m["brand"]) == ([9, 0], pynvml.NVML_BRAND_TESLA)
        assert (m["parent_index"], m["parent_uuid"]) == (parent.index, parent.uuid)
        assert m["gpu_only"] == [not_supported] * 5
        assert m["wrong_kind"] == [invalid] * 2
    assert got["unknown"] == [not_found] * 4
    assert logged_calls(mig_host, got["pid"]) == [got["made"]]


def test_nvidia_smi_lists_mig_devices(mig_host: FakeHost) -> None:
    """nvidia-smi -L indents each GPU's MIG devices under it, as the real one does."""
    listing = subprocess.run(
        [mig_host.root / "usr/bin/nvidia-smi", "-L"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    migs = {(m.parent_index, m.index): m for m in mig_host.mig_devices}
    expected = []
    for gpu in mig_host.gpus:
        expected.append(f"GPU {gpu.index}: {gpu.name} (UUID: {gpu.uuid})")
        expected += [
            f"  MIG {m.profile:<11} Device {m.index:2d}: (UUID: {m.uuid})"
            for (parent, _), m in migs.items()
            if parent == gpu.index
        ]
    assert listing == expected
    assert listing[1] == f"  MIG 3g.40gb     Device  0: (UUID: {mig_host.mig_devices[0].uuid})"


def test_unhealthy_gpus_reach_nvml_and_the_kernel_log(tmp_path: Path) -> None:
    """unhealthy={1: xid:79 + retired-pages}: an NVRM Xid line in dev/kmsg and NVML's pending flag."""
    host = create_host(tmp_path / "host", gpus=2, unhealthy={1: ("xid:79", "retired-pages")})
    assert "NVRM: Xid (PCI:0000:2a:00): 79," in (host.root / "dev/kmsg").read_text()
    code = (
        "import ctypes, pynvml\n"
        f"pynvml.nvmlLib = ctypes.CDLL({str(host.nvml_library)!r})\n"
        "pynvml.nvmlInit()\n"
        "print([pynvml.nvmlDeviceGetRetiredPagesPendingStatus(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0, 1]"
    with pytest.raises(FakeHostError, match="unknown GPU problem 'bad'"):
        create_host(tmp_path / "other", gpus=1, unhealthy={0: ("bad",)})
