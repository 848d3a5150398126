"""Character-device nodes under the dev root, looked up by name (symlinks refused)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuhook import catalog
from gpuhook.discovery.hostroot import HostRoot
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import HostDevice


def char_device(root: HostRoot, name: str) -> HostDevice | None:
    """/dev/<name> under the dev root, if it is a character device (symlinks are refused)."""
    path = root.path / "dev" / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        raise DiscoveryError(f"{path} is not a character device; remove it and reload the NVIDIA driver")
    return HostDevice(name=name, host_path=path, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))


def caps_nodes(dev_root: Path) -> tuple[HostDevice, ...]:
    """/dev/nvidia-caps/nvidia-capN under *dev_root* (made as MIG instances are: read at each start)."""
    root = HostRoot(dev_root)
    names = [f"nvidia-caps/{n}" for n in root.listdir("dev/nvidia-caps") if n.startswith("nvidia-cap")]
    return tuple(node for name in names if (node := char_device(root, name)) is not None)


def extra_nodes(dev_root: Path) -> tuple[HostDevice, ...]:
    """IMEX channels and the feature-gated devices present under *dev_root* (a few listdirs, no NVML)."""
    root = HostRoot(dev_root)
    prefixes = tuple(p for names in catalog.GATED_NODES.values() for p in names if "/" not in p)
    names = [n for n in root.listdir("dev") if n.startswith(prefixes)]
    for sub in ("infiniband", catalog.IMEX_DIR):
        names += [f"{sub}/{n}" for n in root.listdir(f"dev/{sub}")]
    return tuple(node for name in sorted(names) if (node := char_device(root, name)) is not None)
