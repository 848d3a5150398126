"""Pure data: which driver files and device nodes each capability brings.

From libnvidia-container's ``nvc_info.c`` lists (nvidia-toolkit.md §3.1–3.3).
Libraries are matched by *prefix* against ld.so.cache keys and must end in
``.so.<driver version>``, as libnvidia-container does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final

from gpuhook.request.model import Capability

LIBRARIES: Final[Mapping[Capability, tuple[str, ...]]] = MappingProxyType({
    Capability.UTILITY: ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so"),
    Capability.COMPUTE: (
        "libcuda.so", "libcudadebugger.so", "libnvidia-opencl.so", "libnvidia-gpucomp.so",
        "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so",
        "libnvidia-compiler.so", "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
        "libnvidia-nvvm.so", "libnvidia-tileiras.so",
    ),
    Capability.VIDEO: ("libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so", "libnvcuvid.so"),
    Capability.GRAPHICS: (
        "libnvidia-eglcore.so", "libnvidia-glcore.so", "libnvidia-tls.so", "libnvidia-glsi.so",
        "libnvidia-fbc.so", "libnvidia-ifr.so", "libnvidia-rtcore.so", "libnvoptix.so",
        "libGLX_nvidia.so", "libEGL_nvidia.so", "libGLESv2_nvidia.so", "libGLESv1_CM_nvidia.so",
        "libnvidia-glvkspirv.so", "libnvidia-cbl.so",
    ),
    Capability.NGX: ("libnvidia-ngx.so",),
})

#: The libraries without which a capability cannot work at all (NVML for utility, the CUDA driver for
#: compute): a GPU start whose capabilities need one the driver lacks is refused, never started without
#: it. Every other library of LIBRARIES is optional (a headless driver has no graphics ones): skipped.
REQUIRED_LIBRARIES: Final[Mapping[Capability, tuple[str, ...]]] = MappingProxyType({
    Capability.UTILITY: ("libnvidia-ml.so",),
    Capability.COMPUTE: ("libcuda.so",),
})

#: Every library prefix the driver may have, for discovery.
ALL_LIBRARY_PREFIXES: Final = tuple(p for prefixes in LIBRARIES.values() for p in prefixes)

BINARIES: Final[Mapping[Capability, tuple[str, ...]]] = MappingProxyType({
    Capability.UTILITY: ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    Capability.COMPUTE: ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
})

ALL_BINARIES: Final = tuple(b for names in BINARIES.values() for b in names)

#: IPC sockets (host path relative to the driver root) and the capability that mounts them.
#: Where CUDA looks for the MPS control daemon's pipes when CUDA_MPS_PIPE_DIRECTORY is unset: where a container
#: gets the pipe directory of the MPS daemon gpuhook runs for its GPU, so that images need no variable.
MPS_PIPE_DIRECTORY: Final = "/tmp/nvidia-mps"
#: The MPS daemon's binary, in the driver root (never the container's).
MPS_CONTROL: Final = "nvidia-cuda-mps-control"

IPC_SOCKETS: Final[Mapping[str, Capability]] = MappingProxyType({
    "run/nvidia-persistenced/socket": Capability.UTILITY,
    "run/nvidia-fabricmanager/socket": Capability.UTILITY,
})

#: Config files the driver installs (relative to the driver root, mounted at the same path), and the
#: capability that needs each: the files NVIDIA's CLI never mounted (lnc#132, nvidia-docker#1520).
CONFIG_FILES: Final[Mapping[str, Capability]] = MappingProxyType({
    "usr/share/vulkan/icd.d/nvidia_icd.json": Capability.GRAPHICS,
    "etc/vulkan/icd.d/nvidia_icd.json": Capability.GRAPHICS,
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json": Capability.GRAPHICS,
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": Capability.GRAPHICS,
    "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json": Capability.GRAPHICS,
    "usr/share/nvidia/nvoptix.bin": Capability.GRAPHICS,
    "etc/OpenCL/vendors/nvidia.icd": Capability.COMPUTE,
})

#: Feature-gated device families (NVIDIA_<NAME>=enabled) → node name prefixes under /dev.
GATED_NODES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "gds": ("nvidia-fs",),
    "mofed": ("infiniband/uverbs", "infiniband/rdma_cm"),
    "nvswitch": ("nvidia-nvswitch",),
    "gdrcopy": ("gdrdrv",),
})
IMEX_DIR: Final = "nvidia-caps-imex-channels"

#: libnvidia-container's implied sets (options.h ``container_opts``):
#: video needs the compute libraries, display needs the graphics ones.
_IMPLIED_LIBRARIES: Final = MappingProxyType({
    Capability.VIDEO: frozenset({Capability.VIDEO, Capability.COMPUTE}),
    Capability.DISPLAY: frozenset({Capability.GRAPHICS}),
})

#: Control nodes (name under /dev) and the capability that needs them; None = always.
CONTROL_NODES: Final[Mapping[str, Capability | None]] = MappingProxyType({
    "nvidiactl": None,
    "nvidia-uvm": Capability.COMPUTE,
    "nvidia-uvm-tools": Capability.COMPUTE,
    "nvidia-modeset": Capability.DISPLAY,
})

#: nvidia-modprobe's arguments that create a missing control node (loading its module first), as NVIDIA's
#: load-kmods does; nvidia-modeset is left out: it is optional (display), skipped when absent, as before.
MODPROBE_CONTROL: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "nvidiactl": ("-c", "255"),
    "nvidia-uvm": ("-u", "-c", "0"),
    "nvidia-uvm-tools": ("-u", "-c", "0"),
})


def modprobe_gpu(minor: int) -> tuple[str, ...]:
    """nvidia-modprobe's arguments that create /dev/nvidia<minor>."""
    return ("-c", str(minor))


def modprobe_capability(cap: str) -> tuple[str, ...]:
    """nvidia-modprobe's arguments that create the node of the capability *cap* (``gpu0/mig/gi1/access``)."""
    return ("-f", f"/proc/driver/nvidia/capabilities/{cap}")


#: The character-device major of /dev/nvidiactl and /dev/nvidiaN (fixed by the driver).
NVIDIA_MAJOR: Final = 195
NVIDIACTL_MINOR: Final = 255
MODESET_MINOR: Final = 254


def library_capabilities(caps: Iterable[Capability]) -> frozenset[Capability]:
    """The capabilities whose libraries *caps* needs (video ⇒ compute, display ⇒ graphics)."""
    out: set[Capability] = set()
    for cap in caps:
        out |= _IMPLIED_LIBRARIES.get(cap, frozenset({cap}))
    return frozenset(out)


def library_prefixes(caps: Iterable[Capability]) -> tuple[str, ...]:
    """Library name prefixes to inject for *caps*."""
    wanted = library_capabilities(caps)
    return tuple(p for cap, prefixes in LIBRARIES.items() if cap in wanted for p in prefixes)


def required_libraries(caps: Iterable[Capability]) -> frozenset[str]:
    """The library prefixes *caps* cannot do without (video ⇒ compute's libcuda)."""
    wanted = library_capabilities(caps)
    return frozenset(p for cap, prefixes in REQUIRED_LIBRARIES.items() if cap in wanted for p in prefixes)


def binaries(caps: Iterable[Capability]) -> tuple[str, ...]:
    """Binary names to inject for *caps*."""
    wanted = frozenset(caps)
    return tuple(b for cap, names in BINARIES.items() if cap in wanted for b in names)
