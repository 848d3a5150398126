"""A simulated NVIDIA GPU host: driver libraries, mock NVML, /dev and /proc in one directory.

Its usr/bin/nvidia-cuda-mps-control is a working stand-in for NVIDIA's MPS
control daemon (mpscontrol.c: -d, client mode, the real commands, pipe
directory and control.log); usr/bin/nvidia-smi is an NVML client of the
libnvidia-ml.so.1 it finds (nvidiasmi.c), so in a container it shows what the
container was given (the mock's driver view, mocknvml.c); usr/bin/nvidia-modprobe
makes the driver's nodes as the real one does, logging each call (modprobe.c:
FakeHost.modprobe_calls, break_modprobe); the other driver tools are inert scripts.

gpuhook reaches it through its ordinary settings: driver_root, dev_root and
proc_root all point at the host's directory (see FakeHost.config_path).
"""

from .builder import (
    DEFAULT_CUDA,
    DEFAULT_DRIVER,
    DEFAULT_MODEL,
    GATED_NODES,
    GRAPHICS_FILES,
    FakeHost,
    FakeHostError,
    create_host,
)
from .mig import MIG_PROFILES, FakeMigDevice
from .models import KNOWN_MODELS, FakeGpu
from .native import DRIVER_LIBRARIES, BuildError, DriverLibrary

__all__ = [
    "DEFAULT_CUDA",
    "DEFAULT_DRIVER",
    "DEFAULT_MODEL",
    "DRIVER_LIBRARIES",
    "GATED_NODES",
    "GRAPHICS_FILES",
    "KNOWN_MODELS",
    "MIG_PROFILES",
    "BuildError",
    "DriverLibrary",
    "FakeGpu",
    "FakeHost",
    "FakeHostError",
    "FakeMigDevice",
    "create_host",
]
