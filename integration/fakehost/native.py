"""The driver's shared libraries: what exists, and building them with gcc."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

LIB_DIR = "usr/lib/x86_64-linux-gnu"
#: The 32-bit (i386) copies NVIDIA's installer puts beside the 64-bit ones, for NVIDIA_DRIVER_CAPABILITIES=compat32.
LIB32_DIR = "usr/lib/i386-linux-gnu"
MOCK_NVML_SOURCE = Path(__file__).with_name("mocknvml.c")
MPS_CONTROL_SOURCE = Path(__file__).with_name("mpscontrol.c")
NVIDIA_SMI_SOURCE = Path(__file__).with_name("nvidiasmi.c")
MODPROBE_SOURCE = Path(__file__).with_name("modprobe.c")
#: Where the driver installs the MPS control daemon, relative to root.
MPS_CONTROL = "usr/bin/nvidia-cuda-mps-control"
#: nvidia-smi, an NVML client of whatever libnvidia-ml.so.1 it finds (nvidiasmi.c).
NVIDIA_SMI = "usr/bin/nvidia-smi"
#: The nvidia-modprobe stand-in (modprobe.c), which makes nodes under root/dev.
NVIDIA_MODPROBE = "usr/bin/nvidia-modprobe"
#: The library that carries an NT_GNU_ABI_TAG note, as NVIDIA's does (nvidia-container-cli checks it).
ABI_TAGGED = "libnvidia-tls"
#: The .note.ABI-tag NVIDIA's libnvidia-tls carries: owner "GNU", NT_GNU_ABI_TAG (1), OS Linux (0), ABI 2.3.99.
_ABI_TAG_NOTE = (
    '__asm__(".pushsection .note.ABI-tag, \\"a\\", @note\\n"\n'
    '        ".balign 4\\n.long 4\\n.long 16\\n.long 1\\n.asciz \\"GNU\\"\\n"\n'
    '        ".long 0\\n.long 2\\n.long 3\\n.long 99\\n.popsection\\n");\n'
)

# Marks a SONAME whose suffix is the full driver version (libnvidia-glcore.so.550.54.15).
VER = "VER"


@dataclass(frozen=True, slots=True)
class DriverLibrary:
    """One of NVIDIA's user-space libraries and the capability it serves."""

    capability: str
    base: str  # e.g. libcuda
    soname_suffix: str  # "1", or VER for the driver version

    def soname(self, driver: str) -> str:
        """The SONAME, e.g. libcuda.so.1."""
        suffix = driver if self.soname_suffix == VER else self.soname_suffix
        return f"{self.base}.so.{suffix}"

    def file_name(self, driver: str) -> str:
        """The versioned file the driver installs, e.g. libcuda.so.550.54.15."""
        return f"{self.base}.so.{driver}"

    @property
    def marker_symbol(self) -> str:
        """The one function the placeholder exports; it returns 'VER SONAME'."""
        return "fakehost_" + re.sub(r"[^A-Za-z0-9]", "_", self.base)


def _libs(capability: str, *entries: tuple[str, str]) -> tuple[DriverLibrary, ...]:
    """Tabulates one capability's libraries."""
    return tuple(DriverLibrary(capability, base, suffix) for base, suffix in entries)


# The libraries an NVIDIA driver install provides, by NVIDIA_DRIVER_CAPABILITIES.
DRIVER_LIBRARIES: tuple[DriverLibrary, ...] = (
    *_libs("utility", ("libnvidia-ml", "1"), ("libnvidia-cfg", "1")),
    *_libs(
        "compute",
        ("libcuda", "1"),
        ("libcudadebugger", "1"),
        ("libnvidia-opencl", "1"),
        ("libnvidia-gpucomp", VER),
        ("libnvidia-ptxjitcompiler", "1"),
        ("libnvidia-allocator", "1"),
        ("libnvidia-pkcs11", VER),
        ("libnvidia-pkcs11-openssl3", VER),
        ("libnvidia-nvvm", "4"),
    ),
    *_libs(
        "video",
        ("libvdpau_nvidia", "1"),
        ("libnvidia-encode", "1"),
        ("libnvidia-opticalflow", "1"),
        ("libnvcuvid", "1"),
    ),
    *_libs(
        "graphics",
        ("libnvidia-eglcore", VER),
        ("libnvidia-glcore", VER),
        ("libnvidia-tls", VER),
        ("libnvidia-glsi", VER),
        ("libnvidia-fbc", "1"),
        ("libnvidia-rtcore", VER),
        ("libnvoptix", "1"),
        ("libGLX_nvidia", "0"),
        ("libEGL_nvidia", "0"),
        ("libGLESv2_nvidia", "2"),
        ("libGLESv1_CM_nvidia", "1"),
        ("libnvidia-glvkspirv", VER),
    ),
    *_libs("ngx", ("libnvidia-ngx", "1")),
)

NVML_LIBRARY = DRIVER_LIBRARIES[0]

_MOCK_NVML_FLAGS = (
    "-std=c11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fvisibility=hidden",
    "-pthread",
    # Fail the build, not the dlopen, if a libc symbol is missing.
    "-Wl,-z,defs",
)


class BuildError(RuntimeError):
    """A compiler or ldconfig run failed."""


def _run(argv: list[str], stdin: str | None = None) -> None:
    """Runs a build tool, turning failure into a BuildError with its output."""
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")


def _gcc() -> str:
    """Finds gcc, failing with a message that says what is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc is required to build the simulated driver libraries")
    return gcc


def _placeholder_source(lib: DriverLibrary, driver: str) -> str:
    """C source of a placeholder library: one function naming what it stands for."""
    return (
        f"/* Placeholder for NVIDIA's {lib.file_name(driver)} on a simulated GPU host. */\n"
        f'const char *{lib.marker_symbol}(void) {{ return "{driver} {lib.soname(driver)}"; }}\n'
        + (_ABI_TAG_NOTE if lib.base == ABI_TAGGED else "")
    )


def _c_string(text: str) -> str:
    """text as a C string literal, one source line per line of text ("?" escaped: no trigraphs)."""
    escaped = (
        '"' + line.replace("\\", "\\\\").replace('"', '\\"').replace("?", "\\?") + '\\n"' for line in text.splitlines()
    )
    return "\n".join(escaped) or '""'


def _build_placeholder(gcc: str, lib: DriverLibrary, driver: str, lib_dir: Path) -> None:
    """Compiles one placeholder library from source on stdin."""
    out = lib_dir / lib.file_name(driver)
    argv = [gcc, "-shared", "-fPIC", f"-Wl,-soname,{lib.soname(driver)}", "-o", str(out), "-x", "c", "-"]
    _run(argv, stdin=_placeholder_source(lib, driver))


def _build_mock_nvml(gcc: str, driver: str, lib_dir: Path, topology: str, mig_minors: str) -> None:
    """Compiles mocknvml.c as the driver's libnvidia-ml, with *topology* and *mig_minors* built in (its driver's
    view)."""
    out = lib_dir / NVML_LIBRARY.file_name(driver)
    soname = NVML_LIBRARY.soname(driver)
    hidden = '__attribute__((visibility("hidden")))'
    # mig-minors gets a leading newline so every record can be found as "\n<name> ".
    embedded = (f"const char mock_embedded_topology[] {hidden} =\n{_c_string(topology)};\n"
                f"const char mock_embedded_mig_minors[] {hidden} =\n{_c_string(chr(10) + mig_minors)};\n")
    _run(
        [
            gcc,
            *_MOCK_NVML_FLAGS,
            "-shared",
            "-fPIC",
            f"-Wl,-soname,{soname}",
            "-o",
            str(out),
            str(MOCK_NVML_SOURCE),
            "-x",
            "c",
            "-",
        ],
        stdin=embedded,
    )


def build_nvidia_smi(out: Path) -> None:
    """Compiles nvidiasmi.c to *out* (0755): dynamic against glibc, as it dlopen()s libnvidia-ml.so.1."""
    gcc = _gcc()
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([gcc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(NVIDIA_SMI_SOURCE), "-ldl"])
    out.chmod(0o755)


def build_modprobe(out: Path, driver: str) -> None:
    """Compiles modprobe.c, the nvidia-modprobe stand-in, to *out* (0755); static where libc.a exists."""
    gcc = _gcc()
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [gcc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f'-DDRIVER_VERSION="{driver}"', "-o", str(out),
            str(MODPROBE_SOURCE)]
    try:
        _run([*argv, "-static"])
    except BuildError:  # no libc.a here
        _run(argv)
    out.chmod(0o755)


def build_mps_control(out: Path) -> None:
    """Compiles mpscontrol.c, the nvidia-cuda-mps-control stand-in, to *out* (0755).

    Linked statically where this machine has a static libc, so the program runs
    in any root it is copied or chrooted into; dynamically otherwise.
    """
    gcc = _gcc()
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [gcc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(MPS_CONTROL_SOURCE)]
    try:
        _run([*argv, "-static"])
    except BuildError:  # no libc.a here
        _run(argv)
    out.chmod(0o755)


def _build_placeholder32(gcc: str, lib: DriverLibrary, driver: str, lib_dir: Path, libc: Path) -> None:
    """Compiles one 32-bit placeholder, linked against a stub libc so ldconfig files it as i386 libc6.

    Without a 32-bit libc (no gcc-multilib here) the library is linked with -nostdlib; the
    DT_NEEDED on libc.so.6 is what makes ldconfig record it as "libc6" rather than plain "ELF".
    """
    out = lib_dir / lib.file_name(driver)
    argv = [gcc, "-m32", "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{lib.soname(driver)}", "-o", str(out),
            "-x", "c", "-", "-x", "none", "-Wl,--no-as-needed", str(libc)]
    _run(argv, stdin=_placeholder_source(lib, driver))


def build_libraries(root: Path, driver: str, topology: str = "", mig_minors: str = "") -> None:
    """Builds every driver library into root's lib dir (and the 32-bit ones into LIB32_DIR), in parallel.

    *topology* and *mig_minors* are what the mock NVML answers from where its topology file is absent
    (the driver's view: mocknvml.c).
    """
    gcc = _gcc()
    lib_dir = root / LIB_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    lib32_dir = root / LIB32_DIR
    lib32_dir.mkdir(parents=True, exist_ok=True)
    libc32 = root / ".build" / "libc.so.6"
    libc32.parent.mkdir()
    _run([gcc, "-m32", "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libc.so.6", "-o", str(libc32), "-x", "c", "-"],
         stdin="int gpuhook_fake_libc32;\n")
    # One gcc per library is ~25 ms of mostly process start-up; running them
    # side by side keeps a whole host build well under a second.
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(_build_mock_nvml, gcc, driver, lib_dir, topology, mig_minors)]
        futures += [
            pool.submit(_build_placeholder, gcc, lib, driver, lib_dir)
            for lib in DRIVER_LIBRARIES
            if lib != NVML_LIBRARY
        ]
        futures += [pool.submit(_build_placeholder32, gcc, lib, driver, lib32_dir, libc32) for lib in DRIVER_LIBRARIES]
        for future in futures:
            future.result()
    shutil.rmtree(libc32.parent)


def run_ldconfig(root: Path) -> None:
    """Writes root/etc/ld.so.cache and the SONAME links, as the driver installer would."""
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text(f"/{LIB_DIR}\n/{LIB32_DIR}\n")
    ldconfig = "/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else shutil.which("ldconfig")
    if ldconfig is None:
        raise BuildError("ldconfig is required to build the simulated host's ld.so.cache")
    # -r makes ldconfig chroot into root, so the cache records root-relative paths.
    _run([ldconfig, "-r", str(root)])
