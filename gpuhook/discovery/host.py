"""The real discoverer: NVML + the driver root's files + the dev and proc roots."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpuhook import catalog
from gpuhook.config import Config
from gpuhook.discovery.hostroot import HostRoot
from gpuhook.ldcache import LdCacheEntry, parse_ldcache
from gpuhook.discovery.live import read_mig_layout
from gpuhook.discovery.nodes import char_device
from gpuhook.discovery.procdevices import parse_mig_minors, parse_proc_devices
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import DriverFile, Gpu, HostDevice, Inventory, ProcDriver

#: Where libraries live when the driver root has no ld.so.cache (e.g. /usr/local/nvidia on
#: cloud GPU images has lib64/ and bin/ only); NVIDIA's locator searches the same dirs.
LIBRARY_DIRS: Final = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib")
LIBRARY32_DIRS: Final = ("usr/lib/i386-linux-gnu", "usr/lib/arm-linux-gnueabihf", "usr/lib32", "lib32")
#: The 32-bit architecture beside each 64-bit one (compat32); ppc64le has none.
_COMPAT32_ARCH: Final = {"x86_64": "i386", "aarch64": "armhf"}
BINARY_DIRS: Final = ("usr/bin", "bin", "usr/sbin", "sbin")
PROC_DRIVER_FILES: Final = ("version", "params", "registry")
_MACHINE_ARCH: Final = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


@dataclass(frozen=True, slots=True)
class HostDiscoverer:
    """Inventories the host through the configured driver, dev and proc roots."""

    config: Config

    def discover(self) -> Inventory:
        """Ask NVML and read the driver's files; raises DiscoveryError."""
        from gpuhook.nvml.facts import read_nvml

        driver = HostRoot(self.config.driver_root)
        machine = os.uname().machine  # not platform.machine(): importing platform costs ~2 ms per start
        arch = _MACHINE_ARCH.get(machine, machine)
        libraries = _library_index(driver, arch, LIBRARY_DIRS)
        nvml = libraries.get("libnvidia-ml.so.1")
        if nvml is None:
            raise DiscoveryError(
                f"libnvidia-ml.so.1 not found under driver root {self.config.driver_root} "
                "(neither in its etc/ld.so.cache nor in its library directories); "
                "is the NVIDIA driver installed, and is driver_root right?"
            )
        # Read before NVML: an instance made while NVML answers is then either reported or unseen,
        # and an unseen one sends the next start that needs it back to NVML (see discovery.cache).
        layout = read_mig_layout(self.config.proc_root)
        facts = read_nvml(nvml)
        devices = HostRoot(self.config.dev_root)
        majors = _majors(HostRoot(self.config.proc_root))
        return Inventory(
            driver_version=facts.driver_version,
            cuda_version=facts.cuda_version,
            gpus=facts.gpus,
            mig_devices=facts.mig_devices,
            mig_layout=tuple(sorted(layout)),
            mig_minors=_mig_minors(HostRoot(self.config.proc_root), facts.gpus),
            gpu_nodes=tuple(n for g in facts.gpus if (n := _gpu_node(devices, g)) is not None),
            control_nodes=_control_nodes(devices, majors),
            libraries=_driver_libraries(libraries, facts.driver_version),
            libraries32=_driver_libraries(
                _library_index(driver, _COMPAT32_ARCH.get(arch, ""), LIBRARY32_DIRS), facts.driver_version
            ),
            binaries=tuple(f for name in catalog.ALL_BINARIES if (f := _binary(driver, name)) is not None),
            firmware=_firmware(driver, facts.driver_version),
            ipc=tuple(f for rel in catalog.IPC_SOCKETS if (f := _socket(driver, rel)) is not None),
            proc_driver=_proc_driver(HostRoot(self.config.proc_root)),
            configs=tuple(f for rel in catalog.CONFIG_FILES if (f := _regular(driver, rel)) is not None),
        )


def _library_index(root: HostRoot, arch: str, fallback_dirs: tuple[str, ...]) -> dict[str, Path]:
    """SONAME → resolved host path of the driver root's libraries for *arch* (ld.so.cache, else *fallback_dirs*)."""
    if not arch:
        return {}
    cache = root.read_bytes("etc/ld.so.cache")
    index: dict[str, Path] = {}
    if cache is not None:
        for entry in parse_ldcache(cache):
            if entry.arch == arch and _is_driver_library(entry) and entry.key not in index:
                found = root.resolve(entry.value)
                if found is not None and stat.S_ISREG(found[1].st_mode):
                    index[entry.key] = found[0]
        return index
    # No cache (a driver folder like /usr/local/nvidia with lib64/ and a 32-bit lib/): search the dirs,
    # keeping only ELF files of the wanted word size.
    elf_class = b"\x01" if arch in _COMPAT32_ARCH.values() else b"\x02"
    for directory in fallback_dirs:
        for name in root.listdir(directory):
            if name.startswith(catalog.ALL_LIBRARY_PREFIXES) and name not in index:
                found = root.resolve(f"{directory}/{name}")
                if found is not None and stat.S_ISREG(found[1].st_mode) and _elf_class(found[0]) == elf_class:
                    index[name] = found[0]
    return index


def _elf_class(path: Path) -> bytes:
    """EI_CLASS of an ELF file (b"\\x01" 32-bit, b"\\x02" 64-bit), or b"" for anything else."""
    with open(path, "rb") as handle:
        ident = handle.read(5)
    return ident[4:5] if ident[:4] == b"\x7fELF" else b""


def _is_driver_library(entry: LdCacheEntry) -> bool:
    """An NVIDIA driver library (by name prefix, at a name boundary)."""
    return any(entry.key == p or entry.key.startswith(p + ".") for p in catalog.ALL_LIBRARY_PREFIXES)


def _driver_libraries(index: dict[str, Path], version: str) -> tuple[DriverFile, ...]:
    """The versioned driver libraries (``*.so.<driver version>``), one per file."""
    files = {path.name: path for path in index.values() if path.name.endswith(f".so.{version}")}
    return tuple(DriverFile(name=name, host_path=path) for name, path in sorted(files.items()))


def driver_program(driver_root: Path, name: str) -> Path | None:
    """A program of the driver root that gpuhook runs on the host (nvidia-modprobe), or None."""
    found = _binary(HostRoot(driver_root), name)
    return found.host_path if found is not None else None


def _binary(root: HostRoot, name: str) -> DriverFile | None:
    """The first regular file *name* in the root's binary dirs."""
    for directory in BINARY_DIRS:
        found = root.resolve(f"{directory}/{name}")
        if found is not None and stat.S_ISREG(found[1].st_mode):
            return DriverFile(name=name, host_path=found[0])
    return None


def _firmware(root: HostRoot, version: str) -> tuple[DriverFile, ...]:
    """GSP firmware for this driver version (``lib/firmware/nvidia/<version>/gsp*.bin``)."""
    rel = f"lib/firmware/nvidia/{version}"
    out = []
    for name in root.listdir(rel):
        found = root.resolve(f"{rel}/{name}")
        if name.startswith("gsp") and name.endswith(".bin") and found and stat.S_ISREG(found[1].st_mode):
            out.append(DriverFile(name=f"/{rel}/{name}", host_path=found[0]))
    return tuple(out)


def _mig_minors(proc: HostRoot, gpus: tuple[Gpu, ...]) -> tuple[tuple[str, int], ...]:
    """The capability minors of this host's GPUs (and of MIG config/monitor), if the driver lists them."""
    data = proc.read_bytes("proc/driver/nvidia-caps/mig-minors")
    if data is None:
        return ()
    ours = {f"gpu{g.minor}" for g in gpus} | {"config", "monitor"}
    return tuple(e for e in parse_mig_minors(data.decode("ascii", "replace")) if e[0].split("/")[0] in ours)


def _regular(root: HostRoot, rel: str) -> DriverFile | None:
    """A regular file of the driver, named by its path (the same in the container)."""
    found = root.resolve(rel)
    if found is None or not stat.S_ISREG(found[1].st_mode):
        return None
    return DriverFile(name=f"/{rel}", host_path=found[0])


def _socket(root: HostRoot, rel: str) -> DriverFile | None:
    """An IPC socket of the driver's daemons, if it is running."""
    found = root.resolve(rel)
    if found is None or not stat.S_ISSOCK(found[1].st_mode):
        return None
    return DriverFile(name=f"/{rel}", host_path=found[0])


def _majors(proc: HostRoot) -> dict[str, int]:
    """Character-device majors from the proc root's /proc/devices."""
    data = proc.read_bytes("proc/devices")
    if data is None:
        raise DiscoveryError(f"{proc.path}/proc/devices not found; is proc_root right?")
    return dict(parse_proc_devices(data.decode("ascii", "replace")))


def _gpu_node(root: HostRoot, gpu: Gpu) -> HostDevice | None:
    """/dev/nvidia<minor> of *gpu*."""
    node = char_device(root, f"nvidia{gpu.minor}")
    if node is not None and (node.major, node.minor) != (catalog.NVIDIA_MAJOR, gpu.minor):
        raise DiscoveryError(
            f"{node.host_path} is {node.major}:{node.minor}, but GPU {gpu.index} ({gpu.uuid}) is "
            f"{catalog.NVIDIA_MAJOR}:{gpu.minor}; recreate the node (nvidia-modprobe -c={gpu.minor})"
        )
    return node


def _control_nodes(root: HostRoot, majors: dict[str, int]) -> tuple[HostDevice, ...]:
    """nvidiactl, nvidia-uvm(-tools) and nvidia-modeset, checked against /proc/devices."""
    nodes = []
    for name in catalog.CONTROL_NODES:
        node = char_device(root, name)
        if node is None:
            continue
        driver = "nvidia-uvm" if name.startswith("nvidia-uvm") else None
        expected = majors.get(driver) if driver else catalog.NVIDIA_MAJOR
        if expected is not None and node.major != expected:
            raise DiscoveryError(
                f"{node.host_path} has major {node.major} but /proc/devices gives {driver or 'nvidia'} "
                f"major {expected}; the node is stale: recreate it (nvidia-modprobe -u -c=0)"
            )
        nodes.append(node)
    return tuple(nodes)


def _proc_driver(proc: HostRoot) -> ProcDriver | None:
    """The host's /proc/driver/nvidia text files and per-GPU directories."""
    found = proc.resolve("proc/driver/nvidia")
    if found is None:
        return None
    files = []
    for name in PROC_DRIVER_FILES:
        data = proc.read_bytes(f"proc/driver/nvidia/{name}")
        if data is not None:
            files.append((name, data.decode("utf-8", "replace")))
    return ProcDriver(host_dir=found[0], files=tuple(files), gpu_dirs=proc.listdir("proc/driver/nvidia/gpus"))
