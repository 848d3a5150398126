"""dcgm-exporter's HPC job mapping: ``<dir>/<gpu index>`` holds the ids of the containers that hold that GPU.

dcgm-exporter (``--hpc-job-mapping-dir``, ``DCGM_HPC_JOB_MAPPING_DIR``) labels each GPU's metrics
with the job ids listed, one per line, in the file named by the GPU's index. gpuhook rewrites the
files from the ledger after every change of holders; each file is replaced atomically (a
temporary file renamed over it), and a GPU nobody holds has none. Only files named by a GPU index
are touched: the directory may hold others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from gpuhook.errors import StateError
from gpuhook.sharing.ledger import Ledger
from gpuhook.sys.files import replace_at


def holders_by_gpu(ledger: Ledger, parents: Mapping[str, int]) -> dict[int, list[str]]:
    """GPU index → the ids of the containers holding it whole or a MIG device on it, in lease order.

    *parents*: every GPU and MIG UUID (case-folded) → its GPU's index.
    """
    held: dict[int, list[str]] = {}
    for lease in ledger.leases:
        for index in dict.fromkeys(parents[d.casefold()] for d in lease.devices if d.casefold() in parents):
            held.setdefault(index, []).append(lease.container_id)
    return held


def write(directory: Path, ledger: Ledger, parents: Mapping[str, int]) -> None:
    """The mapping files for *ledger*; raises StateError if the directory cannot be written."""
    held = holders_by_gpu(ledger, parents)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise StateError(f"hpc_job_mapping_dir {directory}: {err.strerror or err}") from err
    try:
        for name in os.listdir(dir_fd):
            if name.isdigit() and int(name) not in held:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
        for index, ids in held.items():
            replace_at(dir_fd, str(index), "".join(f"{i}\n" for i in ids).encode(), mode=0o644)
    except OSError as err:
        raise StateError(f"hpc_job_mapping_dir {directory}: {err.strerror or err}") from err
    finally:
        os.close(dir_fd)
