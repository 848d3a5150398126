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
    # The one shape the driver makes, gpuN/mig/giX/ciY/access, listed level by level (a walk of the whole tree
    # cost a MIG start 0.24 ms); an unreadable directory is skipped: what cannot be seen is not offered.
    paths = [f"{gpu}/mig/{gi}/{ci}/access"
             for gpu in _subdirs(str(found[0]), "gpu") for gi in _subdirs(f"{found[0]}/{gpu}/mig", "gi")
             for ci in _subdirs(f"{found[0]}/{gpu}/mig/{gi}", "ci")
             if _is_file(f"{found[0]}/{gpu}/mig/{gi}/{ci}/access")]
    return parse_mig_layout(paths)


def _subdirs(directory: str, prefix: str) -> list[str]:
    """The names of *directory*'s subdirectories (not symlinks) that start with *prefix*."""
    try:
        with os.scandir(directory) as entries:
            return [e.name for e in entries if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _is_file(path: str) -> bool:
    """Whether *path* is there and no directory (os.walk's files: a symlink to one counts)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


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
