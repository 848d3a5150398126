"""The simulated host's nvidia-smi (an NVML client) and nvidia-modprobe stand-in, the mock NVML's driver view,
and the fidelity NVIDIA's own nvidia-container-cli checks (the ABI note, nvmlDeviceGetPciInfo, /var/run).

The driver view is what a container sees: the library and nvidia-smi are copied into a fresh root (so the
mock's topology file is absent there) with only some nodes, procfs directories and capability files.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, FakeHostError, create_host, native

UVM = ("nvidia-uvm", "nvidia-uvm-tools")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """Three GPUs, booted without the nvidia-uvm nodes (the module is loadable: /proc/devices lists it)."""
    return create_host(tmp_path_factory.mktemp("tools") / "host", gpus=3, missing_nodes=UVM)


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """Two GPUs; GPU 0 in MIG mode with a 3g.40gb (GI 1) and a 1g.10gb (GI 7)."""
    return create_host(tmp_path_factory.mktemp("toolsmig") / "host", gpus=2, mig={0: ("3g.40gb", "1g.10gb")})


def smi(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs root's nvidia-smi."""
    return subprocess.run([root / native.NVIDIA_SMI, *args], capture_output=True, text=True, timeout=60, check=False)


def copy_node(host: FakeHost, view: Path, rel: str) -> None:
    """Copies one device node (same major:minor and mode) into the view."""
    info = os.stat(host.root / "dev" / rel)
    (view / "dev" / rel).parent.mkdir(parents=True, exist_ok=True)
    os.mknod(view / "dev" / rel, info.st_mode, info.st_rdev)


def make_view(host: FakeHost, view: Path, *, nodes: Iterable[str], gpu_dirs: Iterable[int] | None = None,
              caps: Iterable[str] = ()) -> Path:
    """A root like a container's: the mock NVML and nvidia-smi, the given nodes (under dev), the procfs dirs of
    *gpu_dirs* (None: no /proc/driver/nvidia at all, as without a kernel module) and capability files."""
    lib = view / native.LIB_DIR
    lib.mkdir(parents=True)
    shutil.copy2(host.nvml_library, lib)
    (lib / "libnvidia-ml.so.1").symlink_to(host.nvml_library.name)
    (view / "usr/bin").mkdir(parents=True)
    shutil.copy2(host.root / native.NVIDIA_SMI, view / native.NVIDIA_SMI)
    for rel in nodes:
        copy_node(host, view, rel)
    if gpu_dirs is not None:
        proc = view / "proc/driver/nvidia"
        proc.mkdir(parents=True)
        shutil.copy2(host.root / "proc/driver/nvidia/version", proc / "version")
        for index in gpu_dirs:
            name = host.gpus[index].proc_bus_id
            shutil.copytree(host.root / "proc/driver/nvidia/gpus" / name, proc / "gpus" / name)
        for rel in caps:
            (proc / "capabilities" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(host.capabilities_dir / rel, proc / "capabilities" / rel)
    return view


def listing_line(host: FakeHost, index: int, shown_as: int) -> str:
    """nvidia-smi -L's line for host GPU *index*, numbered *shown_as* as the viewer's NVML numbers it."""
    gpu = host.gpus[index]
    return f"GPU {shown_as}: {gpu.name} (UUID: {gpu.uuid})"


# ---- nvidia-smi -------------------------------------------------------------


def test_nvidia_smi_is_a_dynamic_elf_that_dlopens_nvml(host: FakeHost) -> None:
    """A real program linked against glibc only: libnvidia-ml.so.1 is dlopen()ed, not a DT_NEEDED."""
    path = host.root / native.NVIDIA_SMI
    assert path.read_bytes()[:4] == b"\x7fELF" and os.access(path, os.X_OK)
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    assert "libc.so.6" in dynamic and "libnvidia-ml" not in dynamic


def test_nvidia_smi_on_the_host_shows_every_gpu(host: FakeHost) -> None:
    """On the host: the table (versions, every bus id and memory size), -L, --version and --query-gpu csv."""
    table = smi(host.root)
    assert table.returncode == 0, table.stdout
    assert "Driver Version: 550.54.15" in table.stdout and "CUDA Version: 12.4" in table.stdout
    mib = host.gpus[0].memory_total >> 20
    assert [g.pci_bus_id in table.stdout for g in host.gpus] == [True] * 3
    assert table.stdout.count(f"0MiB / {mib}MiB") == 3
    assert smi(host.root, "-L").stdout.splitlines() == [listing_line(host, i, i) for i in range(3)]
    assert "DRIVER version      : 550.54.15\nCUDA Version        : 12.4\n" in smi(host.root, "--version").stdout
    query = smi(host.root, "--query-gpu=index,name,uuid,pci.bus_id,memory.total", "--format=csv")
    assert query.stdout.splitlines() == ["index, name, uuid, pci.bus_id, memory.total [MiB]"] + [
        f"{g.index}, {g.name}, {g.uuid}, {g.pci_bus_id}, {mib} MiB" for g in host.gpus]
    bare = smi(host.root, "--query-gpu=uuid", "--format=csv,noheader")
    assert bare.stdout.splitlines() == [g.uuid for g in host.gpus]


def test_nvidia_smi_refuses_unknown_arguments(host: FakeHost) -> None:
    """An unknown option or query field: exit 2 and nvidia-smi's message, before any NVML call."""
    bad = smi(host.root, "--bogus")
    assert bad.returncode == 2 and "Invalid combination of input arguments" in bad.stdout
    field = smi(host.root, "--query-gpu=index,bogus", "--format=csv")
    assert field.returncode == 2 and 'Field "bogus" is not a valid field to query.' in field.stdout


def test_driver_view_lists_only_the_gpus_whose_nodes_and_procfs_it_has(host: FakeHost, tmp_path: Path) -> None:
    """GPU 1's node and procfs dir: one GPU, numbered 0; GPU 0's node without its dir or GPU 2's dir without its
    node adds nothing; without /proc/driver/nvidia (no kernel module) the nodes alone decide."""
    view = make_view(host, tmp_path / "a", nodes=("nvidiactl", "nvidia0", "nvidia1"), gpu_dirs=(1, 2))
    assert smi(view, "-L").stdout.splitlines() == [listing_line(host, 1, 0)]
    table = smi(view).stdout
    assert host.gpus[1].pci_bus_id in table and host.gpus[0].pci_bus_id not in table
    bare = make_view(host, tmp_path / "b", nodes=("nvidiactl", "nvidia0", "nvidia2"))
    assert smi(bare, "-L").stdout.splitlines() == [listing_line(host, 0, 0), listing_line(host, 2, 1)]


def test_driver_view_without_driver_nodes_or_gpus(host: FakeHost, tmp_path: Path) -> None:
    """No nvidiactl: "couldn't communicate with the NVIDIA driver" (exit 9); no GPU node: "No devices were
    found" (exit 6); a procfs of another driver version: version mismatch (exit 18)."""
    none = smi(make_view(host, tmp_path / "a", nodes=(), gpu_dirs=(0,)), "-L")
    assert none.returncode == 9 and "couldn't communicate with the NVIDIA driver" in none.stdout
    empty = smi(make_view(host, tmp_path / "b", nodes=("nvidiactl",), gpu_dirs=(0,)), "-L")
    assert (empty.returncode, empty.stdout) == (6, "No devices were found\n")
    other = make_view(host, tmp_path / "c", nodes=("nvidiactl", "nvidia0"), gpu_dirs=(0,))
    version = other / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace("550.54.15", "535.104.05"))
    mismatch = smi(other, "-L")
    assert mismatch.returncode == 18 and "Driver/library version mismatch" in mismatch.stdout


def test_driver_view_lists_only_the_mig_devices_it_holds(mig_host: FakeHost, tmp_path: Path) -> None:
    """The 1g.10gb's GI and CI capability files and nodes: GPU 0 with that one MIG device, as Device 0; its CI
    node missing: none; without procfs the minors come from the module's table."""
    wanted = mig_host.mig_devices[1]
    caps = (f"gpu0/mig/gi{wanted.gi}/access", f"gpu0/mig/gi{wanted.gi}/ci{wanted.ci}/access")
    nodes = ("nvidiactl", "nvidia0", f"nvidia-caps/nvidia-cap{wanted.gi_cap_minor}",
             f"nvidia-caps/nvidia-cap{wanted.ci_cap_minor}")
    expected = [listing_line(mig_host, 0, 0), f"  MIG 1g.10gb     Device  0: (UUID: {wanted.uuid})"]
    view = make_view(mig_host, tmp_path / "a", nodes=nodes, gpu_dirs=(0,), caps=caps)
    assert smi(view, "-L").stdout.splitlines() == expected
    half = make_view(mig_host, tmp_path / "b", nodes=nodes[:3], gpu_dirs=(0,), caps=caps)
    assert smi(half, "-L").stdout.splitlines() == expected[:1]
    bare = make_view(mig_host, tmp_path / "c", nodes=nodes)
    assert smi(bare, "-L").stdout.splitlines() == expected
    assert len(smi(mig_host.root, "-L").stdout.splitlines()) == 4  # the host sees both MIG devices and GPU 1


# ---- the mock NVML's unversioned nvmlDeviceGetPciInfo -----------------------

_PCI_V1 = '''
import ctypes, sys
class PciV1(ctypes.Structure):
    _fields_ = [("busId", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("reserved", ctypes.c_uint * 4)]
lib = ctypes.CDLL(sys.argv[1])
handle, pci = ctypes.c_void_p(), PciV1()
assert lib.nvmlInit() == 0 and lib.nvmlDeviceGetHandleByIndex(1, ctypes.byref(handle)) == 0
print(lib.nvmlDeviceGetPciInfo(handle, ctypes.byref(pci)), pci.busId.decode(), pci.bus, hex(pci.pciDeviceId))
'''


def test_mock_nvml_exports_the_unversioned_pci_info(host: FakeHost) -> None:
    """nvmlDeviceGetPciInfo (as well as _v2/_v3) is exported and fills the v1 nvmlPciInfo_t layout."""
    symbols = subprocess.run(["nm", "-D", "--defined-only", host.nvml_library], capture_output=True, text=True,
                             check=True).stdout.split()
    assert {"nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3"} <= set(symbols)
    out = subprocess.run([sys.executable, "-c", _PCI_V1, host.nvml_library], capture_output=True, text=True,
                         check=True).stdout
    gpu = host.gpus[1]
    assert out.split() == ["0", "0000:2A:00.0", str(0x2A), hex(gpu.pci_device_id)]


# ---- what nvidia-container-cli checks ----------------------------------------


def test_libnvidia_tls_carries_the_abi_tag_note(host: FakeHost) -> None:
    """Both libnvidia-tls builds have NVIDIA's NT_GNU_ABI_TAG note (OS Linux, ABI 2.3.99); other libraries none."""
    for lib_dir in (native.LIB_DIR, native.LIB32_DIR):
        notes = subprocess.run(["readelf", "-n", host.root / lib_dir / "libnvidia-tls.so.550.54.15"],
                               capture_output=True, text=True, check=True).stdout
        assert "NT_GNU_ABI_TAG" in notes and "OS: Linux, ABI: 2.3.99" in notes, notes
    other = subprocess.run(["readelf", "-n", host.lib_dir / "libcuda.so.550.54.15"], capture_output=True, text=True,
                           check=True).stdout
    assert "NT_GNU_ABI_TAG" not in other


def test_var_run_is_a_relative_link_to_run(host: FakeHost) -> None:
    """var/run -> ../run, as Debian's /var/run -> /run, and the run directory exists."""
    assert os.readlink(host.root / "var/run") == "../run"
    assert (host.root / "var/run").resolve() == host.root / "run" and (host.root / "run").is_dir()


# ---- nvidia-modprobe ---------------------------------------------------------


def modprobe(host: FakeHost, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs the host's nvidia-modprobe stand-in."""
    return subprocess.run([host.modprobe_path, *args], capture_output=True, text=True, timeout=60, check=False)


def node(host: FakeHost, rel: str) -> tuple[int, int, int]:
    """(major, minor, permission bits) of a character node under the host's dev."""
    info = os.lstat(host.root / "dev" / rel)
    assert stat.S_ISCHR(info.st_mode), rel
    return os.major(info.st_rdev), os.minor(info.st_rdev), stat.S_IMODE(info.st_mode)


def test_missing_nodes_are_left_out_and_checked(host: FakeHost, tmp_path: Path) -> None:
    """missing_nodes leaves those nodes out but /proc/devices still lists the module; unknown names are refused."""
    assert "nvidia-uvm" in (host.root / "proc/devices").read_text()
    with pytest.raises(FakeHostError, match="missing_nodes: nvidia-bogus is not a driver node; expected some of"):
        create_host(tmp_path / "x", gpus=1, missing_nodes=("nvidia-bogus",))


def test_modprobe_makes_the_nodes_the_real_one_does(host: FakeHost) -> None:
    """-u -c 0 the uvm nodes, -c N a GPU node, --create-nvidia-device-file=255 nvidiactl, -m -c 0 modeset, each
    with the host's major and 0666; every call is logged with its argv."""
    for rel in (*UVM, "nvidia2", "nvidiactl", "nvidia-modeset"):
        (host.root / "dev" / rel).unlink(missing_ok=True)
    before = len(host.modprobe_calls())
    for args in (("-u", "-c", "0"), ("-c", "2"), ("--create-nvidia-device-file=255",), ("-m", "-c=0")):
        done = modprobe(host, *args)
        assert done.returncode == 0, done.stderr
    assert node(host, "nvidia-uvm") == (host.uvm_major, 0, 0o666)
    assert node(host, "nvidia-uvm-tools") == (host.uvm_major, 1, 0o666)
    assert node(host, "nvidia2") == (host.nvidia_major, 2, 0o666)
    assert node(host, "nvidiactl") == (host.nvidia_major, 255, 0o666)
    assert node(host, "nvidia-modeset") == (host.nvidia_major, 254, 0o666)
    assert not (host.root / "dev/nvidia0").exists() or node(host, "nvidia0")[1] == 0  # -u -c 0 makes no nvidia0
    assert host.modprobe_calls()[before:] == [
        (str(host.modprobe_path), "-u", "-c", "0"), (str(host.modprobe_path), "-c", "2"),
        (str(host.modprobe_path), "--create-nvidia-device-file=255"), (str(host.modprobe_path), "-m", "-c=0")]
    again = modprobe(host, "-u", "-c", "0")  # already right: left alone
    assert again.returncode == 0 and node(host, "nvidia-uvm") == (host.uvm_major, 0, 0o666)


def test_modprobe_makes_a_capability_node(mig_host: FakeHost) -> None:
    """-f and --nvlink-capability-device-file=: the capability file's minor and mode, the nvidia-caps major."""
    device = mig_host.mig_devices[0]
    for rel, minor, flag in ((device.gi_proc_path, device.gi_cap_minor, "-f"),
                             (device.ci_proc_path, device.ci_cap_minor, "--nvlink-capability-device-file=")):
        (mig_host.root / f"dev/nvidia-caps/nvidia-cap{minor}").unlink()
        path = f"/proc/driver/nvidia/capabilities/{rel}"
        done = modprobe(mig_host, *((flag, path) if flag == "-f" else (flag + path,)))
        assert done.returncode == 0, done.stderr
        assert node(mig_host, f"nvidia-caps/nvidia-cap{minor}") == (mig_host.caps_major, minor, 0o444)
    absent = modprobe(mig_host, "-f", "/proc/driver/nvidia/capabilities/gpu1/mig/gi9/access")
    assert absent.returncode == 1 and "cannot read" in absent.stderr and "gpu1/mig/gi9/access" in absent.stderr


def test_modprobe_refuses_unknown_flags_and_fails_when_broken(host: FakeHost) -> None:
    """An unknown flag: exit 2 naming it; break_modprobe: exit 1 with its message (and nothing made) until
    repaired; each call still logged."""
    bogus = modprobe(host, "--bogus")
    assert bogus.returncode == 2 and '"--bogus"' in bogus.stderr
    (host.root / "dev/nvidia-uvm").unlink(missing_ok=True)
    host.break_modprobe("FATAL: Module nvidia-uvm not found in directory /lib/modules/6.1.0")
    try:
        broken = modprobe(host, "-u", "-c", "0")
        assert broken.returncode == 1
        assert broken.stderr == "nvidia-modprobe: FATAL: Module nvidia-uvm not found in directory /lib/modules/6.1.0\n"
        assert not (host.root / "dev/nvidia-uvm").exists()
    finally:
        host.repair_modprobe()
    assert modprobe(host, "-u", "-c", "0").returncode == 0 and (host.root / "dev/nvidia-uvm").exists()
    calls = host.modprobe_calls()[-3:]
    assert calls == [(str(host.modprobe_path), "--bogus")] + [(str(host.modprobe_path), "-u", "-c", "0")] * 2
