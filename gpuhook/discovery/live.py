"""The facts read fresh at every GPU start, without NVML: ``read_live`` builds a ``LiveFacts``.

Each is a few listdirs or one bounded read, and only what the start's ``LiveNeeds``
asks for is read: the IMEX channels and gated nodes, the kernel log's Xid errors, and
the MIG layout with its capability nodes. The MIG layout is the tree the driver keeps
under ``/proc/driver/nvidia/capabilities``: ``gpu<minor>/mig/gi<G>/access`` for each GPU
instance and ``gpu<minor>/mig/gi<G>/ci<C>/access`` for each compute instance in it; a
compute instance is one MIG device. Only names are read, never the files.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from gpuhook.config import Config
from gpuhook.discovery.health import read_xids
from gpuhook.discovery.hostroot import HostRoot
from gpuhook.discovery.nodes import caps_nodes, extra_nodes
from gpuhook.inventory import DriverFile, LiveFacts, LiveNeeds, MigInstance

CAPABILITIES: Final = "proc/driver/nvidia/capabilities"
_COMPUTE_INSTANCE: Final = re.compile(r"gpu([0-9]+)/mig/gi([0-9]+)/ci([0-9]+)/access")


def parse_mig_layout(paths: Iterable[str]) -> frozenset[MigInstance]:
    """The compute instances among paths relative to the capabilities directory (others are ignored)."""
    found = (_COMPUTE_INSTANCE.fullmatch(path.strip()) for path in paths)
    return frozenset(MigInstance(gpu_minor=int(m[1]), gi=int(m[2]), ci=int(m[3])) for m in found if m)


def read_mig_layout(proc_root: Path) -> frozenset[MigInstance]:
    """The compute instances under the proc root's capabilities directory (none without one)."""
    found = HostRoot(proc_root).resolve(CAPABILITIES)
    if found is None or not stat.S_ISDIR(found[1].st_mode):
        return frozenset()
    top = found[0]
    paths: list[str] = []
    # An unreadable directory is skipped (os.walk's default): what cannot be seen is not offered.
    for directory, _dirs, files in os.walk(top):
        rel = os.path.relpath(directory, top)
        paths += (os.path.normpath(f"{rel}/{name}") for name in files)
    return parse_mig_layout(paths)


def read_live(config: Config, needs: LiveNeeds) -> LiveFacts:
    """The live facts *needs* asks for, read now under the configured roots."""
    return LiveFacts(
        extra_nodes=extra_nodes(config.dev_root) if needs.extra_nodes else (),
        xid_errors=read_xids(config.dev_root) if needs.xids else (),
        mig_instances=read_mig_layout(config.proc_root) if needs.mig else None,
        caps_nodes=caps_nodes(config.dev_root) if needs.mig else (),
        mps_pipe=mps_pipe(config.driver_root, config.mps_pipe_directory) if needs.mps else None,
    )


def mps_pipe(driver_root: Path, directory: Path | None) -> DriverFile | None:
    """The MPS pipe directory under the driver root, if it is one root owns and only root can write.

    It is mounted read-write into containers, and it usually lives in the world-writable /tmp: a
    directory (or a symlink) someone else made there is never mounted. The sticky /tmp keeps a
    root-owned one from being swapped after this check; the mount opens it without following a
    symlink.
    """
    if directory is None:
        return None
    parent = HostRoot(driver_root).resolve(str(directory.parent).lstrip("/") or ".")
    if parent is None:
        return None
    path = parent[0] / directory.name
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return None
    return DriverFile(name=str(directory), host_path=path)
