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

from integration.fakehost import DRIVER_LIBRARIES, FakeHost, FakeHostError, create_host, models, native

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
    assert (host.root / "etc/ld.so.conf").read_text() == "/usr/lib/x86_64-linux-gnu\n"
    listing = subprocess.run(
        ["/sbin/ldconfig", "-p", "-C", str(host.ld_cache)], capture_output=True, text=True, check=True
    ).stdout
    cached = dict(re.findall(r"^\s+(\S+) \(libc6,x86-64\) => (\S+)$", listing, re.MULTILINE))
    for lib in DRIVER_LIBRARIES:
        soname = lib.soname(host.driver_version)
        assert cached.get(soname) == f"/usr/lib/x86_64-linux-gnu/{soname}", listing
    assert cached["libcuda.so.1"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    # ldconfig also made the SONAME links, pointing at the versioned files.
    assert os.readlink(host.lib_dir / "libcuda.so.1") == f"libcuda.so.{host.driver_version}"
    assert os.readlink(host.lib_dir / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{host.driver_version}"


def test_device_nodes(host: FakeHost) -> None:
    """The driver's character devices, with NVIDIA's numbers and mode 0666."""
    expected = {f"nvidia{gpu.minor}": (195, gpu.minor) for gpu in host.gpus}
    expected |= {
        "nvidiactl": (195, 255),
        "nvidia-modeset": (195, 254),
        "nvidia-uvm": (host.uvm_major, 0),
        "nvidia-uvm-tools": (host.uvm_major, 1),
    }
    assert host.uvm_major == 511
    assert sorted(p.name for p in (host.root / "dev").iterdir()) == sorted(expected)
    for name, (major, minor) in expected.items():
        info = os.lstat(host.root / "dev" / name)
        assert stat.S_ISCHR(info.st_mode), name
        assert stat.S_IMODE(info.st_mode) == 0o666, name
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (major, minor), name


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
    assert list((nvidia / "capabilities").iterdir()) == []


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
    for tool in ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"):
        path = host.root / "usr/bin" / tool
        assert path.read_text().startswith("#!/bin/sh\n") and os.access(path, os.X_OK), tool
    for tool in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
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


def test_gpuhook_config(host: FakeHost) -> None:
    """gpuhook.yaml points all three roots and the inventory cache at the host, and nothing else."""
    text = host.config_path.read_text()
    assert text.startswith(f"# gpuhook config for the simulated GPU host in {host.root}\n")
    assert yaml.safe_load(text) == {
        "driver_root": str(host.root),
        "dev_root": str(host.root),
        "proc_root": str(host.root),
        "log_file": str(host.root / "gpuhook.log"),
        "log_level": "debug",
        "cache_dir": str(host.root / "run/gpuhook"),
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
nvml(pynvml.nvmlShutdown)
"""


@pytest.mark.parametrize(
    ("model", "cc", "brand", "memory_mib", "mig"),
    [
        ("Tesla T4", [7, 5], pynvml.NVML_BRAND_TESLA, 15360, pynvml.NVML_ERROR_NOT_SUPPORTED),
        ("NVIDIA A100-SXM4-80GB", [8, 0], pynvml.NVML_BRAND_TESLA, 81920, pynvml.NVML_SUCCESS),
        ("ACME Accelerator 9000", [8, 0], pynvml.NVML_BRAND_NVIDIA, 16384, pynvml.NVML_ERROR_NOT_SUPPORTED),
    ],
)
def test_other_models_and_versions(
    tmp_path: Path, model: str, cc: list[int], brand: int, memory_mib: int, mig: int
) -> None:
    """Model table and fallback, another driver and CUDA version, a socket path past sun_path."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    host = create_host(deep, gpus=1, driver="535.104.05", cuda="12.2", model=model)
    assert readelf_soname(host.lib_dir / "libnvidia-glcore.so.535.104.05") == "libnvidia-glcore.so.535.104.05"
    assert stat.S_ISSOCK(os.lstat(host.root / "run/nvidia-persistenced/socket").st_mode)
    got = run_nvml(host.nvml_library, _MODEL_REPORT)
    assert (got["driver"], got["cuda"], got["name"]) == ("535.104.05", 12020, model)
    assert (got["cc"], got["brand"], got["memory"], got["mig"]) == (cc, brand, memory_mib * 2**20, mig)


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


def test_cli_refuses_mig(tmp_path: Path) -> None:
    """--mig is parsed, then refused until MIG is simulated for real."""
    result = run_cli("create", str(tmp_path / "h"), "--gpus", "2", "--mig", "0:1g.10gb,3g.40gb")
    assert result.returncode == 2
    assert "MIG simulation is not implemented yet" in result.stderr
    assert not (tmp_path / "h").exists()
    malformed = run_cli("create", str(tmp_path / "h"), "--gpus", "2", "--mig", "zero")
    assert malformed.returncode == 2 and "GPU:PROFILE" in malformed.stderr
