"""Reading a bundle's config.json: the one host read the no-GPU fast path makes after stdin.

Kept apart from ``cli.common`` so that the fast path imports only this and the
OCI parser, not the config, planning and platform modules the GPU path needs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuhook.errors import SpecError
from gpuhook.oci.spec import SPEC_LIMIT, BundleSpec, parse_spec


def read_spec(bundle: Path) -> BundleSpec:
    """Read and parse ``<bundle>/config.json`` (size-capped)."""
    path = bundle / "config.json"
    try:
        bundle_fd = os.open(bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # O_NOFOLLOW: never a symlink to a host file; O_NONBLOCK: a FIFO cannot hang the open.
            fd = os.open("config.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=bundle_fd)
        finally:
            os.close(bundle_fd)
    except OSError as err:
        raise SpecError(f"cannot open {path}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path} is not a regular file")
        if st.st_size > SPEC_LIMIT:
            raise SpecError(f"{path} is {st.st_size} bytes; the limit is {SPEC_LIMIT}")
        return parse_spec(handle.read(SPEC_LIMIT + 1), bundle)
